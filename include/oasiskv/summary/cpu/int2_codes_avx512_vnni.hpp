// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The AVX512_VNNI scoring kernel of `qminmax_int2_summary` (codes and the integer query:
//! `int2_codes_layout.hpp`): whole 16-token entries scored with 16-bit integer products, 32
//! per instruction, against the int8 bounds of `quantized_minmax_summary`. Compiled with
//! `OASISKV_TARGET_AVX512VNNI`, chosen at run time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/summary/cpu/int2_codes_avx512.hpp"
#include "oasiskv/summary/cpu/int2_codes_layout.hpp"

#if OASISKV_X86_KERNELS

#include "oasiskv/cpu/kernel_begin.hpp"

namespace oasiskv::cpu::detail {

// With the bounds as int8 codes `H`, `L` at a power-of-two scale `s` (quantized_minmax_summary),
// `k'_x = s (L_x + u_x D_x / 3)` with `D = H - L`, and a query row quantized to 16-bit integers,
// `q ~ alpha Q`, a dot product is `alpha s (C + A / 3)` with the integers `C = sum_x Q_x L_x` and
// `A = sum_x Q_x u_x D_x`. `vpdpwssd` multiplies pairs of dimensions, 32 products per
// instruction (twice the f32 FMA's 16): per pair of dimensions the 16 tokens' codes are widened
// to 16-bit lanes (a byte shuffle, a variable shift, a mask), multiplied by the pair's `D`, and
// multiplied into every row's accumulator; the rows' `C` come from one more accumulator whose
// lanes are the rows.

//! The most dimensions the VNNI kernel's stack buffers hold.
inline constexpr std::uint32_t int2_avx512_vnni_max_dim = 256;

// R <= 12 rows (one pass of `z`: `pairs` at row 0 of the pass, `columns` its [d / 2][16]) against
// one group of 16 tokens whose bounds are `bound` (quantized_minmax_summary::bound_words) at
// scale `s`; `d` a multiple of 32, at most int2_avx512_vnni_max_dim.
template <int R>
OASISKV_TARGET_AVX512VNNI inline void int2_block_avx512_vnni(
    const std::uint32_t* words, const std::uint32_t* bound, float s, std::uint32_t d,
    std::uint32_t tokens, const std::int32_t* pairs, const std::int32_t* columns,
    const float* alpha, float scale, float* out) {
  const std::uint32_t half = d / 2;
  alignas(64) std::int32_t dpair[int2_avx512_vnni_max_dim / 2], lpair[int2_avx512_vnni_max_dim / 2];
  for (std::uint32_t p = 0; p < half; p += 16) {  // bytes hi, -lo, hi, -lo: to int16 D and L
    const __m512i g = _mm512_loadu_si512(bound + p);
    const __m512i hi = _mm512_srai_epi16(_mm512_slli_epi16(g, 8), 8);
    const __m512i nlo = _mm512_srai_epi16(g, 8);
    _mm512_store_si512(dpair + p, _mm512_add_epi16(hi, nlo));
    _mm512_store_si512(lpair + p, _mm512_sub_epi16(_mm512_setzero_si512(), nlo));
  }
  // 16-bit lane 2i + j (token i, dimension 2p + j): byte j * 4 + i / 4 of the pair's two code
  // words (broadcast to every 128-bit lane), shifted right by 2 (i % 4).
  const __m512i route = _mm512_set_epi8(-1, 7, -1, 3, -1, 7, -1, 3, -1, 7, -1, 3, -1, 7, -1, 3,  //
                                        -1, 6, -1, 2, -1, 6, -1, 2, -1, 6, -1, 2, -1, 6, -1, 2,  //
                                        -1, 5, -1, 1, -1, 5, -1, 1, -1, 5, -1, 1, -1, 5, -1, 1,  //
                                        -1, 4, -1, 0, -1, 4, -1, 0, -1, 4, -1, 0, -1, 4, -1, 0);
  const __m512i shifts = _mm512_set_epi16(6, 6, 4, 4, 2, 2, 0, 0, 6, 6, 4, 4, 2, 2, 0, 0,  //
                                          6, 6, 4, 4, 2, 2, 0, 0, 6, 6, 4, 4, 2, 2, 0, 0);
  const __m512i three = _mm512_set1_epi16(3);
  __m512i acc[R];
  OASISKV_UNROLL(12)
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_si512();
  }
  __m512i c = _mm512_setzero_si512();
  for (std::uint32_t p = 0; p < half; ++p) {
    std::uint64_t two;
    std::memcpy(&two, words + 2 * p, 8);
    const __m512i u = _mm512_and_si512(
        _mm512_srlv_epi16(
            _mm512_shuffle_epi8(_mm512_set1_epi64(static_cast<long long>(two)), route), shifts),
        three);
    const __m512i v = _mm512_mullo_epi16(u, _mm512_set1_epi32(dpair[p]));
    OASISKV_UNROLL(12)
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_dpwssd_epi32(
          acc[r], v, _mm512_set1_epi32(pairs[static_cast<std::size_t>(r) * half + p]));
    }
    c = _mm512_dpwssd_epi32(c, _mm512_loadu_si512(columns + std::size_t{p} * 16),
                            _mm512_set1_epi32(lpair[p]));
  }
  // Row r, token t: alpha_r s (C_r + A_rt / 3).
  const __m512 a = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << R) - 1u), alpha);
  const __m512 cs = _mm512_mul_ps(_mm512_cvtepi32_ps(c), _mm512_mul_ps(a, _mm512_set1_ps(s)));
  __m512 f[R];
  OASISKV_UNROLL(12)
  for (int r = 0; r < R; ++r) {
    f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_set1_ps(alpha[r] * s / 3.0f),
                           _mm512_permutexvar_ps(_mm512_set1_epi32(r), cs));
  }
  int2_epilogue_avx512<R>(f, tokens, scale, out);
}

// int2_block_avx512_vnni for all rows of `z`, in its passes of up to 12.
OASISKV_TARGET_AVX512VNNI inline void int2_block_rows_avx512_vnni(const std::uint32_t* words,
                                                                  const std::uint32_t* bound,
                                                                  float s, std::uint32_t tokens,
                                                                  const int2_query& z, float scale,
                                                                  float* out) {
  using pass =
      void (*)(const std::uint32_t*, const std::uint32_t*, float, std::uint32_t, std::uint32_t,
               const std::int32_t*, const std::int32_t*, const float*, float, float*);
  static constexpr pass passes[12] = {
      &int2_block_avx512_vnni<1>,  &int2_block_avx512_vnni<2>,  &int2_block_avx512_vnni<3>,
      &int2_block_avx512_vnni<4>,  &int2_block_avx512_vnni<5>,  &int2_block_avx512_vnni<6>,
      &int2_block_avx512_vnni<7>,  &int2_block_avx512_vnni<8>,  &int2_block_avx512_vnni<9>,
      &int2_block_avx512_vnni<10>, &int2_block_avx512_vnni<11>, &int2_block_avx512_vnni<12>};
  const std::uint32_t half = z.d / 2;
  for (std::uint32_t r = 0; r < z.n; r += 12) {
    const std::uint32_t rows = z.n - r < 12 ? z.n - r : 12;
    passes[rows - 1](words, bound, s, z.d, tokens, z.pairs.data() + std::size_t{r} * half,
                     z.columns.data() + std::size_t{r / 12} * half * 16, z.alpha.data() + r, scale,
                     out + r);
  }
}

}  // namespace oasiskv::cpu::detail

#include "oasiskv/cpu/kernel_end.hpp"
#endif  // OASISKV_X86_KERNELS
