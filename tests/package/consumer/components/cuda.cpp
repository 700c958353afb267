// SPDX-License-Identifier: Apache-2.0
// oasiskv::cuda from a plain C++ file: the CUDA runtime's headers and library come with it (the
// .cuh models need nvcc; components/cuda_device.cu includes one).
#include <cuda_runtime_api.h>

#include <cstdio>
#include <oasiskv/oasiskv.hpp>

int main() {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  std::printf("cuda: %d device(s) (%s), oasiskv %d.%d.%d\n", e == cudaSuccess ? devices : 0,
              cudaGetErrorName(e), oasiskv::version.major, oasiskv::version.minor,
              oasiskv::version.patch);
  return 0;
}
