// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The dispatcher of the top-k kernels (`top_k_scalar.hpp`, `top_k_avx512.hpp`):
//! `keep_top`, which `block_selector` and `cascade_summary`'s first stage call. Every path keeps
//! the same entries.
#pragma once

#include <cstdint>
#include <vector>

#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/cpu/top_k_avx512.hpp"
#include "oasiskv/cpu/top_k_scalar.hpp"

namespace oasiskv::cpu::detail {

//! @brief Appends `base + i` for the `k` highest `cand[i]` (`i < m`, `0 < k < m`), ascending,
//! ties to the lower index, NaN as `+inf`. `isa` is already resolved: `cpu_isa::avx512` and
//! `avx512_vnni` run the AVX-512 kernel, every other path the scalar one. `ranked` and `pool` are
//! reused scratch.
inline void keep_top(cpu_isa isa, const float* cand, std::uint32_t m, std::uint32_t k,
                     std::uint32_t base, std::vector<float>& ranked, std::vector<float>& pool,
                     std::vector<std::uint32_t>& out) {
#if OASISKV_X86_KERNELS
  if (isa_includes(isa, cpu_isa::avx512)) {
    keep_top_avx512(cand, m, k, base, pool, out);
    return;
  }
#endif
  (void)isa;
  keep_top_scalar(cand, m, k, base, ranked, pool, out);
}

}  // namespace oasiskv::cpu::detail
