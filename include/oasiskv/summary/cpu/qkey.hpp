// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The dispatcher of `quantized_key_summary`'s scoring kernels (`qkey_scalar.hpp`,
//! `qkey_avx2.hpp`; codes: `qkey_layout.hpp`): `qkey_score_entry`.
#pragma once

#include <cstddef>
#include <cstdint>

#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/summary/cpu/qkey_avx2.hpp"
#include "oasiskv/summary/cpu/qkey_layout.hpp"
#include "oasiskv/summary/cpu/qkey_scalar.hpp"

namespace oasiskv::cpu::detail {

//! @brief `out[r]` for the `n` query rows `q` (`[n][d]`) against one (entry, KV head) of a
//! `quantized_key_summary<Bits>`: its codes (`[d][tp]`) and per-token scales `sc`; `scale` == 0
//! gives the max of the dequantized dot products, > 0 the scaled log-sum-exp. `dots` is
//! `[n][tp]` scratch. `isa` is already resolved: `cpu_isa::avx2` and every wider path run the
//! AVX2 kernel, `scalar` the portable one.
template <int Bits>
inline void qkey_score_entry(cpu_isa isa, const std::uint8_t* codes, const float* sc,
                             std::uint32_t d, std::uint32_t tp, const float* q, std::uint32_t n,
                             float scale, float* dots, float* out) {
#if OASISKV_X86_KERNELS
  if (isa_includes(isa, cpu_isa::avx2)) {
    qkey_dots_avx2<Bits>(codes, d, tp, q, n, dots);
    for (std::uint32_t r = 0; r < n; ++r) {
      out[r] = qkey_reduce_avx2(dots + std::size_t{r} * tp, sc, tp, scale);
    }
    return;
  }
#endif
  (void)isa;
  qkey_dots_scalar<Bits>(codes, d, tp, q, n, dots);
  for (std::uint32_t r = 0; r < n; ++r) {
    out[r] = qkey_reduce_scalar(dots + std::size_t{r} * tp, sc, tp, scale);
  }
}

}  // namespace oasiskv::cpu::detail
