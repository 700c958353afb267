// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The dispatch of the two quantized summaries' scoring: `qkey_score_entry`
//! (`quantized_key_summary`: `summary/cpu/qkey_*.hpp`) and `qminmax_run`
//! (`quantized_minmax_summary`: `summary/cpu/qminmax_*.hpp`), each calling the per-ISA kernel
//! its summary chose.
#pragma once

#include <cstddef>
#include <cstdint>

#include "oasiskv/core/isa.hpp"
#include "oasiskv/summary/cpu/minmax_layout.hpp"
#include "oasiskv/summary/cpu/qkey_avx2.hpp"
#include "oasiskv/summary/cpu/qkey_scalar.hpp"
#include "oasiskv/summary/cpu/qminmax_avx512vnni.hpp"
#include "oasiskv/summary/cpu/qminmax_scalar.hpp"

namespace oasiskv::detail {

//! @brief `out[r]` for the `n` query rows `q` (`[n][d]`) against one (entry, KV head) of a
//! `quantized_key_summary<Bits>`: its codes (`[d][tp]`) and per-token scales `sc`; `scale` == 0
//! gives the max of the dequantized dot products, > 0 the scaled log-sum-exp. `dots` is
//! `[n][tp]` scratch. `cpu_isa::avx2` and `avx512` (already resolved) run the AVX2 kernel.
template <int Bits>
inline void qkey_score_entry(cpu_isa isa, const std::uint8_t* codes, const float* sc,
                             std::uint32_t d, std::uint32_t tp, const float* q, std::uint32_t n,
                             float scale, float* dots, float* out) {
#if OASISKV_X86_KERNELS
  if (isa != cpu_isa::scalar) {
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

//! @brief Lanes `[lane0, lane0 + count)` of one `quantized_minmax_summary` tile against every
//! row: entry `i0 + k`, row `r` of `out` = `dot * (scale * t[r]) + slack[r] * norm + bias`. The
//! VNNI kernel where `vnni` (the summary checked the CPU), else the scalar one.
inline void qminmax_run(bool vnni, const std::int8_t* tile, const float* scale, const float* norm,
                        const float* bias, std::uint32_t d, std::uint32_t lane0,
                        std::uint32_t count, const std::uint32_t* qw, const float* t,
                        const float* slack, std::uint32_t n, const score_sink& out,
                        std::size_t i0) {
#if OASISKV_X86_KERNELS
  if (vnni) {
    qminmax_run_vnni(tile, scale, norm, bias, d, lane0, count, qw, t, slack, n, out, i0);
    return;
  }
#endif
  (void)vnni;
  qminmax_run_scalar(tile, scale, norm, bias, d, lane0, count, qw, t, slack, n, out, i0);
}

}  // namespace oasiskv::detail
