// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The dispatcher of the CPU decode kernel's block functions (`block_scalar.hpp`,
//! `block_avx2.hpp`, `block_avx512.hpp`): `range_kernel` picks the `range_fn` of a path, element
//! type and head dim, once per call of `cpu::sparse_decode::decode`.
#pragma once

#include <cstdint>

#include "oasiskv/attention/cpu/block_avx2.hpp"
#include "oasiskv/attention/cpu/block_avx512.hpp"
#include "oasiskv/attention/cpu/block_scalar.hpp"
#include "oasiskv/attention/cpu/range.hpp"
#include "oasiskv/core/dtype.hpp"
#include "oasiskv/cpu/isa.hpp"

namespace oasiskv::cpu::detail {

//! @brief The `range_fn` of resolved path `isa` for element type `t` and head dim `d`: the
//! AVX-512 kernel for head dims 64 and 128 (`avx512` and `avx512_vnni`), the AVX2 block function
//! for every other head dim there and on `avx2`, the portable one on `scalar`; the head dims 64
//! and 128 compiled in, every other read at run time.
inline range_fn range_kernel(cpu_isa isa, dtype t, std::uint32_t d) {
  return visit_dtype(t, [&](auto elem) -> range_fn {
    using T = decltype(elem);
#if OASISKV_X86_KERNELS
    if (isa_includes(isa, cpu_isa::avx512) && d == 64) {
      return &avx512::range<T, 64>;
    }
    if (isa_includes(isa, cpu_isa::avx512) && d == 128) {
      return &avx512::range<T, 128>;
    }
    if (isa_includes(isa, cpu_isa::avx2)) {
      return d == 64    ? &range_blocks<T, &avx2::block<T, 64>>
             : d == 128 ? &range_blocks<T, &avx2::block<T, 128>>
                        : &range_blocks<T, &avx2::block<T, 0>>;
    }
#endif
    (void)isa;
    return d == 64    ? &range_blocks<T, &block_scalar<T, 64>>
           : d == 128 ? &range_blocks<T, &block_scalar<T, 128>>
                      : &range_blocks<T, &block_scalar<T, 0>>;
  });
}

}  // namespace oasiskv::cpu::detail
