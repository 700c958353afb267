// SPDX-License-Identifier: Apache-2.0
//! The second translation unit of test_cuda_two_units (see two_units.test.cu).
#include "cuda/two_units.cuh"

namespace oasiskv::testing {
std::array<const void*, 4> header_kernels_other_unit() {
  return header_kernels_here();
}
}  // namespace oasiskv::testing
