// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The dispatcher of `qminmax_int2_summary`'s scoring kernels (`int2_codes_scalar.hpp`,
//! `int2_codes_avx512.hpp`, `int2_codes_avx512_vnni.hpp`; codes: `int2_codes_layout.hpp`):
//! `int2_score_entry` in f32 on every path, and the integer kernel of whole entries where the
//! path has one (`int2_prepare_integer`, `int2_score_integer`).
#pragma once

#include <cstddef>
#include <cstdint>

#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/summary/cpu/int2_codes_avx512.hpp"
#include "oasiskv/summary/cpu/int2_codes_avx512_vnni.hpp"
#include "oasiskv/summary/cpu/int2_codes_layout.hpp"
#include "oasiskv/summary/cpu/int2_codes_scalar.hpp"

namespace oasiskv::cpu::detail {

//! @brief `out[r]` for the `n` query rows `q` (`[n][d]`) against the first `tokens` tokens of
//! one (entry, KV head) of `qminmax_int2_summary`: its codes (`[d][groups]` words) between
//! `lo` and `lo + 3 step` per dimension; `scale` == 0 gives the max of the dequantized dot
//! products, > 0 the scaled log-sum-exp. `dots` is `[n][groups * 16]` scratch. `isa` is already
//! resolved: `cpu_isa::avx512` and `avx512_vnni` run the AVX-512 kernels, every other path the
//! portable one.
inline void int2_score_entry(cpu_isa isa, const std::uint32_t* words, std::uint32_t groups,
                             const float* lo, const float* step, std::uint32_t d,
                             std::uint32_t tokens, const float* q, std::uint32_t n, float scale,
                             float* dots, float* out) {
  const std::uint32_t tp = groups * int2_lanes;
#if OASISKV_X86_KERNELS
  if (isa_includes(isa, cpu_isa::avx512) && groups == 1) {
    int2_block_rows_avx512(words, lo, step, d, tokens, q, n, scale, out);
    return;
  }
  if (isa_includes(isa, cpu_isa::avx512)) {
    int2_dots_avx512(words, groups, lo, step, d, q, n, dots);
    for (std::uint32_t r = 0; r < n; ++r) {
      out[r] = int2_reduce_avx512(dots + std::size_t{r} * tp, tokens, scale);
    }
    return;
  }
#endif
  (void)isa;
  int2_dots_scalar(words, groups, lo, step, d, q, n, dots);
  for (std::uint32_t r = 0; r < n; ++r) {
    out[r] = int2_reduce_scalar(dots + std::size_t{r} * tp, tokens, scale);
  }
}

//! @brief Whether path `isa` scores whole entries of these shapes with the integer kernel
//! (`int2_score_integer`): `cpu_isa::avx512_vnni`, one group of codes per entry, a head
//! dimension `d` its buffers take, and finite query rows, which it then quantizes into `z`.
inline bool int2_prepare_integer(cpu_isa isa, std::uint32_t groups, std::uint32_t d, const float* q,
                                 std::uint32_t n, int2_query& z) {
#if OASISKV_X86_KERNELS
  return isa_includes(isa, cpu_isa::avx512_vnni) && groups == 1 && d % 32 == 0 &&
         d <= int2_avx512_vnni_max_dim && int2_quantize_query(q, n, d, z);
#else
  (void)isa, (void)groups, (void)d, (void)q, (void)n, (void)z;
  return false;
#endif
}

//! @brief `out[r]` for every row of `z` against the first `tokens` tokens of one whole entry:
//! its codes (`[d]` words) between the int8 bounds `bound`
//! (`quantized_minmax_summary::bound_words`) at scale `s`; `scale` as in `int2_score_entry`.
//! Only for a `z` that `int2_prepare_integer` accepted.
inline void int2_score_integer(const std::uint32_t* words, const std::uint32_t* bound, float s,
                               std::uint32_t tokens, const int2_query& z, float scale, float* out) {
#if OASISKV_X86_KERNELS
  int2_block_rows_avx512_vnni(words, bound, s, tokens, z, scale, out);
#else
  (void)words, (void)bound, (void)s, (void)tokens, (void)z, (void)scale, (void)out;
#endif
}

}  // namespace oasiskv::cpu::detail
