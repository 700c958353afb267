// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The dispatch of `block_selector`'s top-k pass: `keep_top` calls the per-ISA kernel of
//! `predictor/cpu/select_*.hpp` for the selector's code path. Every path keeps the same blocks.
#pragma once

#include <cstdint>
#include <vector>

#include "oasiskv/core/isa.hpp"
#include "oasiskv/predictor/cpu/select_avx512.hpp"
#include "oasiskv/predictor/cpu/select_scalar.hpp"

namespace oasiskv::detail {

//! @brief Appends `base + i` for the `k` highest `cand[i]` (`i < m`, `0 < k < m`), ascending,
//! ties to the lower index, NaN as `+inf`. `isa` is already resolved: `cpu_isa::avx512` runs the
//! AVX-512 kernel, every other path the scalar one. `ranked` and `pool` are reused scratch.
inline void keep_top(cpu_isa isa, const float* cand, std::uint32_t m, std::uint32_t k,
                     std::uint32_t base, std::vector<float>& ranked, std::vector<float>& pool,
                     std::vector<std::uint32_t>& out) {
#if OASISKV_X86_KERNELS
  if (isa == cpu_isa::avx512) {
    keep_top_avx512(cand, m, k, base, pool, out);
    return;
  }
#endif
  (void)isa;
  keep_top_scalar(cand, m, k, base, ranked, pool, out);
}

}  // namespace oasiskv::detail
