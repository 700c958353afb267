// SPDX-License-Identifier: Apache-2.0
// A .cu of the consumer's own, compiled by nvcc against oasiskv::cuda's installed headers.
#include <cstdio>
#include <oasiskv/tier/cuda/device_tier.cuh>

int main() {
  std::printf("cuda_device: %zu-byte device_tier\n", sizeof(oasiskv::cuda::device_tier));
  return 0;
}
