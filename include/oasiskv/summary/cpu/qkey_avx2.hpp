// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The AVX2 + FMA kernel of `quantized_key_summary` (codes: `qkey_layout.hpp`): 16 tokens x
//! up to 4 query rows per pass in registers, and a vectorised epilogue with the polynomial `exp` of
//! `math_avx2.hpp`. Compiled with `OASISKV_TARGET_AVX2`, chosen at run time; the summary's `avx512`
//! path runs it too.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/cpu/math_avx2.hpp"
#include "oasiskv/summary/cpu/qkey_layout.hpp"

#if OASISKV_X86_KERNELS

#include "oasiskv/cpu/kernel_begin.hpp"

namespace oasiskv::cpu::detail {

// 16 codes of one dimension as two vectors of 8 floats.
template <int Bits>
OASISKV_TARGET_AVX2 inline void qkey_widen16(const std::uint8_t* p, __m256& lo, __m256& hi) {
  __m128i v;
  if constexpr (Bits == 8) {
    v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i m = _mm_set1_epi8(0x0f);
    const __m128i nib =
        _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
    const __m128i eight = _mm_set1_epi8(8);
    v = _mm_sub_epi8(_mm_xor_si128(nib, eight), eight);  // sign-extend the 4-bit codes
  }
  lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
  hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
}

// R query rows against one lane group of 16 tokens: each dimension's codes are widened once
// and multiplied into 2R accumulators (16 tokens x R rows in registers, no horizontal sums).
template <int Bits, int R>
OASISKV_TARGET_AVX2 inline void qkey_group_avx2(const std::uint8_t* codes, std::size_t step,
                                                std::uint32_t d, const float* q, float* dots,
                                                std::uint32_t tp) {
  __m256 acc[R][2];
  OASISKV_UNROLL(4)
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm256_setzero_ps();
    acc[r][1] = _mm256_setzero_ps();
  }
  for (std::uint32_t x = 0; x < d; ++x) {
    __m256 lo, hi;
    qkey_widen16<Bits>(codes + std::size_t{x} * step, lo, hi);
    OASISKV_UNROLL(4)
    for (int r = 0; r < R; ++r) {
      const __m256 qb = _mm256_set1_ps(q[static_cast<std::size_t>(r) * d + x]);
      acc[r][0] = _mm256_fmadd_ps(qb, lo, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(qb, hi, acc[r][1]);
    }
  }
  OASISKV_UNROLL(4)
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(dots + static_cast<std::size_t>(r) * tp, acc[r][0]);
    _mm256_storeu_ps(dots + static_cast<std::size_t>(r) * tp + 8, acc[r][1]);
  }
}

template <int Bits>
OASISKV_TARGET_AVX2 inline void qkey_dots_avx2(const std::uint8_t* codes, std::uint32_t d,
                                               std::uint32_t tp, const float* q, std::uint32_t n,
                                               float* dots) {
  const std::size_t step = Bits == 8 ? tp : tp / 2;  // bytes per dimension
  for (std::uint32_t g = 0; g < tp; g += qkey_lanes) {
    const std::uint8_t* c = codes + (Bits == 8 ? g : g / 2);
    std::uint32_t r = 0;
    for (; r + 4 <= n; r += 4) {
      qkey_group_avx2<Bits, 4>(c, step, d, q + std::size_t{r} * d, dots + std::size_t{r} * tp + g,
                               tp);
    }
    const float* qr = q + std::size_t{r} * d;
    float* o = dots + std::size_t{r} * tp + g;
    switch (n - r) {
      case 3:
        qkey_group_avx2<Bits, 3>(c, step, d, qr, o, tp);
        break;
      case 2:
        qkey_group_avx2<Bits, 2>(c, step, d, qr, o, tp);
        break;
      case 1:
        qkey_group_avx2<Bits, 1>(c, step, d, qr, o, tp);
        break;
      default:
        break;
    }
  }
}

OASISKV_TARGET_AVX2 inline float qkey_hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// One row's epilogue: `v` (the row's raw dot products, tp of them) becomes the dequantized dot
// products (-inf for absent tokens, +inf for non-finite keys); returns their max, or for
// `scale` > 0 the scaled log-sum-exp (see quantized_key_summary::score_log_mass).
OASISKV_TARGET_AVX2 inline float qkey_reduce_avx2(float* v, const float* sc, std::uint32_t tp,
                                                  float scale) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 pinf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256 zero = _mm256_setzero_ps();
  __m256 m = ninf;
  for (std::uint32_t t = 0; t < tp; t += 8) {
    const __m256 s = _mm256_loadu_ps(sc + t);
    __m256 x = _mm256_mul_ps(_mm256_loadu_ps(v + t), s);
    x = _mm256_blendv_ps(x, pinf, _mm256_cmp_ps(s, pinf, _CMP_EQ_OQ));
    x = _mm256_blendv_ps(x, ninf, _mm256_cmp_ps(s, zero, _CMP_LT_OQ));
    _mm256_storeu_ps(v + t, x);
    m = _mm256_max_ps(m, x);
  }
  const float mx = qkey_hmax8(m);
  if (scale == 0.0f || !std::isfinite(mx)) {
    return mx;
  }
  const __m256 sv = _mm256_set1_ps(scale), mv = _mm256_set1_ps(mx);
  __m256 sum = zero;
  for (std::uint32_t t = 0; t < tp; t += 8) {
    const __m256 x = _mm256_loadu_ps(v + t);
    const __m256 e = exp8_avx2(_mm256_mul_ps(sv, _mm256_sub_ps(x, mv)));
    sum = _mm256_add_ps(sum, _mm256_and_ps(e, _mm256_cmp_ps(x, ninf, _CMP_GT_OQ)));
  }
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
  return mx + std::log(_mm_cvtss_f32(h)) / scale;
}

}  // namespace oasiskv::cpu::detail

#include "oasiskv/cpu/kernel_end.hpp"
#endif  // OASISKV_X86_KERNELS
