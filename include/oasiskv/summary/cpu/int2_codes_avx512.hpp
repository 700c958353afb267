// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The AVX-512 scoring kernels of `qminmax_int2_summary` (codes: `int2_codes_layout.hpp`):
//! 16 tokens per vector, each dimension's codes dequantized once and multiplied into every row,
//! and the epilogue in registers. Compiled with `OASISKV_TARGET_AVX512`, chosen at run time.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/cpu/math_avx512.hpp"
#include "oasiskv/summary/cpu/int2_codes_layout.hpp"

#if OASISKV_X86_KERNELS

#include "oasiskv/cpu/kernel_begin.hpp"

namespace oasiskv::cpu::detail {

// One dimension of 16 tokens dequantized from its code word: `lo + u_i * step` (a variable
// shift, a mask, a convert and one FMA).
OASISKV_TARGET_AVX512 inline __m512 int2_keys16(std::uint32_t word, float lo, float step) {
  const __m512i shifts =
      _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i codes = _mm512_and_si512(
      _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(word)), shifts), _mm512_set1_epi32(3));
  return _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(0xffff, codes), _mm512_set1_ps(step),
                         _mm512_set1_ps(lo));
}

// R query rows against one group of 16 tokens: each dimension's 16 codes are widened and
// dequantized once (a variable shift, a mask, a convert, one FMA with the bounds) and multiplied
// into R accumulators of 16 tokens each (no horizontal sums).
template <int R>
OASISKV_TARGET_AVX512 inline void int2_group_avx512(const std::uint32_t* words,
                                                    std::uint32_t groups, std::uint32_t g,
                                                    const float* lo, const float* step,
                                                    std::uint32_t d, const float* q, float* dots,
                                                    std::uint32_t tp) {
  __m512 acc[R];
  OASISKV_UNROLL(8)
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
  }
  for (std::uint32_t x = 0; x < d; ++x) {
    const __m512 k = int2_keys16(words[std::size_t{x} * groups + g], lo[x], step[x]);
    OASISKV_UNROLL(8)
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[static_cast<std::size_t>(r) * d + x]), k, acc[r]);
    }
  }
  OASISKV_UNROLL(8)
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(dots + static_cast<std::size_t>(r) * tp + std::size_t{g} * int2_lanes, acc[r]);
  }
}

// int2_dots_scalar, 16 tokens x up to 8 rows per pass.
OASISKV_TARGET_AVX512 inline void int2_dots_avx512(const std::uint32_t* words, std::uint32_t groups,
                                                   const float* lo, const float* step,
                                                   std::uint32_t d, const float* q, std::uint32_t n,
                                                   float* dots) {
  using pass = void (*)(const std::uint32_t*, std::uint32_t, std::uint32_t, const float*,
                        const float*, std::uint32_t, const float*, float*, std::uint32_t);
  static constexpr pass passes[8] = {
      &int2_group_avx512<1>, &int2_group_avx512<2>, &int2_group_avx512<3>, &int2_group_avx512<4>,
      &int2_group_avx512<5>, &int2_group_avx512<6>, &int2_group_avx512<7>, &int2_group_avx512<8>};
  const std::uint32_t tp = groups * int2_lanes;
  for (std::uint32_t g = 0; g < groups; ++g) {
    for (std::uint32_t r = 0; r < n; r += 8) {
      const std::uint32_t rows = n - r < 8 ? n - r : 8;
      passes[rows - 1](words, groups, g, lo, step, d, q + std::size_t{r} * d,
                       dots + std::size_t{r} * tp, tp);
    }
  }
}

// int2_reduce_scalar with the 16-lane max and the polynomial exp (about 2 ulp).
OASISKV_TARGET_AVX512 inline float int2_reduce_avx512(const float* v, std::uint32_t tokens,
                                                      float scale) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m = ninf;
  for (std::uint32_t t = 0; t < tokens; t += 16) {
    const __mmask16 k = tail16(t, tokens);
    m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, v + t));
  }
  const float mx = _mm512_reduce_max_ps(m);
  if (scale == 0.0f || !std::isfinite(mx)) {
    return mx;
  }
  const __m512 s = _mm512_set1_ps(scale), mv = _mm512_set1_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  for (std::uint32_t t = 0; t < tokens; t += 16) {
    const __mmask16 k = tail16(t, tokens);
    const __m512 e =
        exp16_normal(_mm512_mul_ps(s, _mm512_sub_ps(_mm512_maskz_loadu_ps(k, v + t), mv)));
    sum = _mm512_mask_add_ps(sum, k, sum, e);
  }
  return mx + std::log(_mm512_reduce_add_ps(sum)) / scale;
}

// The epilogue of R <= 16 rows' dot products with the 16 token lanes of a block (`tokens` of
// them live): each row's max (`scale` == 0) or scaled log-sum-exp into out[0..R), all rows at
// once: the 16 rows' maxima in one register, then their sums of exponentials in another, and
// one vector log.
template <int R>
OASISKV_TARGET_AVX512 inline void int2_epilogue_avx512(const __m512* acc, std::uint32_t tokens,
                                                       float scale, float* out) {
  const __mmask16 live = tail16(0, tokens);
  const __mmask16 rows = static_cast<__mmask16>((1u << R) - 1u);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 v[16];
  OASISKV_UNROLL(16)
  for (int r = 0; r < 16; ++r) {
    v[r] = r < R ? _mm512_mask_mov_ps(ninf, live, acc[r]) : ninf;
  }
  const __m512 m = transpose_reduce16<true>(v);
  if (scale == 0.0f) {
    _mm512_mask_storeu_ps(out, rows, m);
    return;
  }
  const __m512 sv = _mm512_set1_ps(scale);
  OASISKV_UNROLL(16)
  for (int r = 0; r < 16; ++r) {
    v[r] =
        r < R ? _mm512_maskz_mov_ps(
                    live,
                    exp16_nonpositive(_mm512_mul_ps(
                        sv, _mm512_sub_ps(acc[r], _mm512_permutexvar_ps(_mm512_set1_epi32(r), m)))))
              : _mm512_setzero_ps();
  }
  const __m512 sum = transpose_reduce16<false>(v);
  // A finite maximum contributes exp(0) = 1, so sum >= 1; other rows keep their maximum.
  const __mmask16 finite = _mm512_cmp_ps_mask(
      _mm512_abs_ps(m), _mm512_set1_ps(std::numeric_limits<float>::max()), _CMP_LE_OQ);
  const __m512 lse = _mm512_add_ps(m, _mm512_div_ps(log16_avx512(sum), sv));
  _mm512_mask_storeu_ps(out, rows, _mm512_mask_mov_ps(m, finite, lse));
}

// One group of at most 16 tokens (`tokens_per_block` <= 16) against R rows, the epilogue in
// registers: each row's max, or its scaled log-sum-exp, straight from its accumulator.
template <int R>
OASISKV_TARGET_AVX512 inline void int2_block_avx512(const std::uint32_t* words, const float* lo,
                                                    const float* step, std::uint32_t d,
                                                    std::uint32_t tokens, const float* q,
                                                    float scale, float* out) {
  __m512 acc[R];
  OASISKV_UNROLL(12)
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
  }
  for (std::uint32_t x = 0; x < d; ++x) {
    const __m512 k = int2_keys16(words[x], lo[x], step[x]);
    OASISKV_UNROLL(12)
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[static_cast<std::size_t>(r) * d + x]), k, acc[r]);
    }
  }
  int2_epilogue_avx512<R>(acc, tokens, scale, out);
}

// int2_block_avx512 for n rows, in passes of up to 12.
OASISKV_TARGET_AVX512 inline void int2_block_rows_avx512(const std::uint32_t* words,
                                                         const float* lo, const float* step,
                                                         std::uint32_t d, std::uint32_t tokens,
                                                         const float* q, std::uint32_t n,
                                                         float scale, float* out) {
  using pass = void (*)(const std::uint32_t*, const float*, const float*, std::uint32_t,
                        std::uint32_t, const float*, float, float*);
  static constexpr pass passes[12] = {
      &int2_block_avx512<1>,  &int2_block_avx512<2>,  &int2_block_avx512<3>,
      &int2_block_avx512<4>,  &int2_block_avx512<5>,  &int2_block_avx512<6>,
      &int2_block_avx512<7>,  &int2_block_avx512<8>,  &int2_block_avx512<9>,
      &int2_block_avx512<10>, &int2_block_avx512<11>, &int2_block_avx512<12>};
  for (std::uint32_t r = 0; r < n; r += 12) {
    const std::uint32_t rows = n - r < 12 ? n - r : 12;
    passes[rows - 1](words, lo, step, d, tokens, q + std::size_t{r} * d, scale, out + r);
  }
}

}  // namespace oasiskv::cpu::detail

#include "oasiskv/cpu/kernel_end.hpp"
#endif  // OASISKV_X86_KERNELS
