// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The code layout of `qminmax_int2_summary` and its scoring kernels: the dot products of
//! query rows with one (entry, KV head)'s keys dequantized from 2-bit codes between per-dimension
//! bounds, and the epilogue that folds them into the max or the scaled log-sum-exp. A portable
//! kernel (the yardstick) and an AVX-512 one (`OASISKV_TARGET_AVX512`, chosen at run time).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "oasiskv/core/isa.hpp"
#include "oasiskv/summary/cpu/math_avx512.hpp"

namespace oasiskv::detail {

// Tokens are stored in groups of 16: one 32-bit word holds the 2-bit codes of one dimension for
// 16 tokens, token `16 g + i` at bits `[2 i, 2 i + 2)` of word `[x][g]`.
inline constexpr std::uint32_t int2_lanes = 16;

// Code `u` in [0, 3] of dimension x, token t, in an (entry, KV head)'s `[d][groups]` words.
inline std::uint32_t int2_code(const std::uint32_t* words, std::uint32_t groups, std::uint32_t x,
                               std::uint32_t t) noexcept {
  return (words[std::size_t{x} * groups + t / int2_lanes] >> (2 * (t % int2_lanes))) & 3u;
}

// The dequantized element: `lo + u * step`.
inline float int2_value(float lo, float step, std::uint32_t u) noexcept {
  return lo + static_cast<float>(u) * step;
}

// `dots[r][t] = sum_x q[r][x] * (lo[x] + u(x, t) * step[x])` for the `groups * 16` token lanes.
inline void int2_dots_scalar(const std::uint32_t* words, std::uint32_t groups, const float* lo,
                             const float* step, std::uint32_t d, const float* q, std::uint32_t n,
                             float* dots) {
  const std::uint32_t tp = groups * int2_lanes;
  thread_local std::vector<float> wide;  // [d][tp]: the dequantized keys, transposed
  wide.resize(std::size_t{d} * tp);
  for (std::uint32_t x = 0; x < d; ++x) {
    for (std::uint32_t t = 0; t < tp; ++t) {
      wide[std::size_t{x} * tp + t] = int2_value(lo[x], step[x], int2_code(words, groups, x, t));
    }
  }
  for (std::uint32_t r = 0; r < n; ++r) {
    float* o = dots + std::size_t{r} * tp;
    std::fill(o, o + tp, 0.0f);
    const float* qr = q + std::size_t{r} * d;
    for (std::uint32_t x = 0; x < d; ++x) {
      const float* w = wide.data() + std::size_t{x} * tp;
      for (std::uint32_t t = 0; t < tp; ++t) {  // independent lanes: vectorises
        o[t] += qr[x] * w[t];
      }
    }
  }
}

// One row's epilogue over its first `tokens` dot products `v`: their max, or for `scale` > 0
// `max + log(sum_t exp(scale * (v_t - max))) / scale`.
inline float int2_reduce_scalar(const float* v, std::uint32_t tokens, float scale) {
  float m = -std::numeric_limits<float>::infinity();
  for (std::uint32_t t = 0; t < tokens; ++t) {
    m = v[t] > m ? v[t] : m;
  }
  if (scale == 0.0f || !std::isfinite(m)) {
    return m;
  }
  float sum = 0.0f;
  for (std::uint32_t t = 0; t < tokens; ++t) {
    sum += std::exp(scale * (v[t] - m));
  }
  return m + std::log(sum) / scale;
}

// ---- AVX-512 VNNI: 16-bit integer products ------------------------------------------------
//
// With the bounds as int8 codes `H`, `L` at a power-of-two scale `s` (quantized_minmax_summary),
// `k'_x = s (L_x + u_x D_x / 3)` with `D = H - L`, and a query row quantized to 16-bit integers,
// `q ~ alpha Q`, a dot product is `alpha s (C + A / 3)` with the integers `C = sum_x Q_x L_x` and
// `A = sum_x Q_x u_x D_x`. `vpdpwssd` multiplies pairs of dimensions, 32 products per
// instruction (twice the f32 FMA's 16): per pair of dimensions the 16 tokens' codes are widened
// to 16-bit lanes (a byte shuffle, a variable shift, a mask), multiplied by the pair's `D`, and
// multiplied into every row's accumulator; the rows' `C` come from one more accumulator whose
// lanes are the rows.

//! The query rows of one scoring call, quantized for `int2_block_vnni`.
struct int2_query {
  std::uint32_t n = 0, d = 0;
  std::vector<float> alpha;           //!< [n]: row r ~ alpha[r] * Q_r
  std::vector<std::int32_t> pairs;    //!< [n][d / 2]: (Q_2p, Q_2p+1) as the low / high int16
  std::vector<std::int32_t> columns;  //!< [passes of 12 rows][d / 2][16]: the pairs, rows in lanes
};

//! The largest |Q| for head dimension `d`: `d * Q * 3 * 254` (the largest `A`) fits in int32.
inline std::int32_t int2_query_limit(std::uint32_t d) noexcept {
  const std::int64_t limit =
      std::int64_t{std::numeric_limits<std::int32_t>::max()} / (762 * std::int64_t{d});
  return static_cast<std::int32_t>(std::min<std::int64_t>(32767, limit));
}

//! Quantizes `n` rows of `d` (even) values per row, `alpha = max |q| / int2_query_limit(d)`
//! (0 for an all-zero row). False if a value is not finite (the caller scores in f32 instead).
inline bool int2_quantize_query(const float* q, std::uint32_t n, std::uint32_t d, int2_query& z) {
  const std::int32_t limit = int2_query_limit(d);
  const std::uint32_t half = d / 2, passes = (n + 11) / 12;
  z.n = n;
  z.d = d;
  z.alpha.assign(n, 0.0f);
  z.pairs.assign(std::size_t{n} * half, 0);
  z.columns.assign(std::size_t{passes} * half * 16, 0);
  for (std::uint32_t r = 0; r < n; ++r) {
    const float* row = q + std::size_t{r} * d;
    float amax = 0.0f;
    for (std::uint32_t x = 0; x < d; ++x) {
      if (!std::isfinite(row[x])) {
        return false;
      }
      amax = std::max(amax, std::fabs(row[x]));
    }
    const float alpha = amax / static_cast<float>(limit);
    z.alpha[r] = alpha;
    const float inv = alpha > 0.0f ? 1.0f / alpha : 0.0f;
    for (std::uint32_t p = 0; p < half; ++p) {
      const auto lo = static_cast<std::int32_t>(std::nearbyint(row[2 * p] * inv));
      const auto hi = static_cast<std::int32_t>(std::nearbyint(row[2 * p + 1] * inv));
      const std::int32_t word = static_cast<std::int32_t>(
          (static_cast<std::uint32_t>(hi) << 16) | (static_cast<std::uint32_t>(lo) & 0xffffu));
      z.pairs[std::size_t{r} * half + p] = word;
      z.columns[(std::size_t{r / 12} * half + p) * 16 + r % 12] = word;
    }
  }
  return true;
}

#if OASISKV_X86_KERNELS

// As in math_avx512.hpp: gcc 12's unmasked AVX-512 intrinsics (the variable shift, the
// reductions) start from _mm512_undefined_*(), which -Wuninitialized reports once inlined.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

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
                    exp16_normal(_mm512_mul_ps(
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

//! The most dimensions the VNNI kernel's stack buffers hold.
inline constexpr std::uint32_t int2_vnni_max_dim = 256;

// R <= 12 rows (one pass of `z`: `pairs` at row 0 of the pass, `columns` its [d / 2][16]) against
// one group of 16 tokens whose bounds are `bound` (quantized_minmax_summary::bound_words) at
// scale `s`; `d` a multiple of 32, at most int2_vnni_max_dim.
template <int R>
OASISKV_TARGET_AVX512VNNI inline void int2_block_vnni(const std::uint32_t* words,
                                                      const std::uint32_t* bound, float s,
                                                      std::uint32_t d, std::uint32_t tokens,
                                                      const std::int32_t* pairs,
                                                      const std::int32_t* columns,
                                                      const float* alpha, float scale, float* out) {
  const std::uint32_t half = d / 2;
  alignas(64) std::int32_t dpair[int2_vnni_max_dim / 2], lpair[int2_vnni_max_dim / 2];
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

// int2_block_vnni for all rows of `z`, in its passes of up to 12.
OASISKV_TARGET_AVX512VNNI inline void int2_block_rows_vnni(const std::uint32_t* words,
                                                           const std::uint32_t* bound, float s,
                                                           std::uint32_t tokens,
                                                           const int2_query& z, float scale,
                                                           float* out) {
  using pass =
      void (*)(const std::uint32_t*, const std::uint32_t*, float, std::uint32_t, std::uint32_t,
               const std::int32_t*, const std::int32_t*, const float*, float, float*);
  static constexpr pass passes[12] = {
      &int2_block_vnni<1>, &int2_block_vnni<2>,  &int2_block_vnni<3>,  &int2_block_vnni<4>,
      &int2_block_vnni<5>, &int2_block_vnni<6>,  &int2_block_vnni<7>,  &int2_block_vnni<8>,
      &int2_block_vnni<9>, &int2_block_vnni<10>, &int2_block_vnni<11>, &int2_block_vnni<12>};
  const std::uint32_t half = z.d / 2;
  for (std::uint32_t r = 0; r < z.n; r += 12) {
    const std::uint32_t rows = z.n - r < 12 ? z.n - r : 12;
    passes[rows - 1](words, bound, s, z.d, tokens, z.pairs.data() + std::size_t{r} * half,
                     z.columns.data() + std::size_t{r / 12} * half * 16, z.alpha.data() + r, scale,
                     out + r);
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // OASISKV_X86_KERNELS

//! @brief `out[r]` for the `n` query rows `q` (`[n][d]`) against the first `tokens` tokens of
//! one (entry, KV head) of `qminmax_int2_summary`: its codes (`[d][groups]` words) between
//! `lo` and `lo + 3 step` per dimension; `scale` == 0 gives the max of the dequantized dot
//! products, > 0 the scaled log-sum-exp. `dots` is `[n][groups * 16]` scratch. `cpu_isa::avx512`
//! (already resolved) runs the AVX-512 kernel, every other path the portable one.
inline void int2_score_entry(cpu_isa isa, const std::uint32_t* words, std::uint32_t groups,
                             const float* lo, const float* step, std::uint32_t d,
                             std::uint32_t tokens, const float* q, std::uint32_t n, float scale,
                             float* dots, float* out) {
  const std::uint32_t tp = groups * int2_lanes;
#if OASISKV_X86_KERNELS
  if (isa == cpu_isa::avx512 && groups == 1) {
    int2_block_rows_avx512(words, lo, step, d, tokens, q, n, scale, out);
    return;
  }
  if (isa == cpu_isa::avx512) {
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

}  // namespace oasiskv::detail
