// SPDX-License-Identifier: Apache-2.0
//! Shared by two_units.test.cu and two_units_other.cu: the kernels the library's headers define,
//! named from the unit that includes this.
#pragma once

#include "oasiskv/cuda/cuda.cuh"

#include <array>

namespace oasiskv::testing {

//! The host-side handles of the headers' kernels as this unit sees them.
inline std::array<const void*, 4> header_kernels_here() {
  namespace d = oasiskv::cuda::detail;
  return {reinterpret_cast<const void*>(&d::softmax_mass_kernel<>),
          reinterpret_cast<const void*>(&d::topk_select_kernel<>),
          reinterpret_cast<const void*>(&d::clear_counts_kernel<>),
          reinterpret_cast<const void*>(&d::residency_kernel<>)};
}

std::array<const void*, 4> header_kernels();             //!< from two_units.test.cu's side
std::array<const void*, 4> header_kernels_other_unit();  //!< from two_units_other.cu's side

}  // namespace oasiskv::testing
