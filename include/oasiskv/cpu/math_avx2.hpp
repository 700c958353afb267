// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The AVX2 + FMA + F16C paths of the shared SIMD math (dispatched by `math.hpp`): f32 /
//! f16 / bf16 loads, horizontal sums, entry dot products, the Cephes `exp` polynomial and the
//! softmax helpers built on it. Compiled with `OASISKV_TARGET_AVX2`, chosen at run time.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/cpu/isa.hpp"

#if OASISKV_X86_KERNELS

#include "oasiskv/cpu/kernel_begin.hpp"

namespace oasiskv::cpu::detail {

OASISKV_TARGET_AVX2 inline float hsum8(__m256 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
OASISKV_TARGET_AVX2 inline __m256 load8(const float* p) {
  return _mm256_loadu_ps(p);
}
OASISKV_TARGET_AVX2 inline __m256 load8(const f16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
OASISKV_TARGET_AVX2 inline __m256 load8(const bf16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
template <int R, class S>
OASISKV_TARGET_AVX2 inline void dot_tile_avx2(const S* v, const float* rows, std::uint32_t len,
                                              float* out) {
  __m256 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
  }
  for (std::uint32_t x = 0; x < len; x += 8) {
    const __m256 e = load8(v + x);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      acc[r] =
          _mm256_fmadd_ps(_mm256_loadu_ps(rows + static_cast<std::size_t>(r) * len + x), e, acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    out[r] = hsum8(acc[r]);
  }
}

template <class S>
OASISKV_TARGET_AVX2 void dot_entries_avx2(const S* base, std::size_t entry_stride,
                                          std::span<const std::uint32_t> ids, const float* rows,
                                          std::uint32_t n, std::uint32_t len, float* out) {
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const S* v = base + std::size_t{ids[i]} * entry_stride;
    float* o = out + i * n;
    std::uint32_t r = 0;
    for (; r + 8 <= n; r += 8) {
      dot_tile_avx2<8>(v, rows + std::size_t{r} * len, len, o + r);
    }
    if (n - r >= 4) {
      dot_tile_avx2<4>(v, rows + std::size_t{r} * len, len, o + r);
      r += 4;
    }
    if (n - r >= 2) {
      dot_tile_avx2<2>(v, rows + std::size_t{r} * len, len, o + r);
      r += 2;
    }
    if (n - r >= 1) {
      dot_tile_avx2<1>(v, rows + std::size_t{r} * len, len, o + r);
    }
  }
}

// exp of 8 floats: Cephes' single-precision polynomial (range reduction by ln 2 in two parts,
// degree-5 polynomial, the exponent added to the bits), about 2 ulp on [-87.3, 88.7]; inputs
// below are clamped (the result is then tiny, not 0: callers mask what must be 0).
OASISKV_TARGET_AVX2 inline __m256 exp8_avx2(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365478515625f));
  const __m256 fx = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// exp8_avx2, with 0 where the argument is below the clamp (-87.34: the exact result is below
// FLT_MIN), so that sums over far-below-maximum blocks (a two-stage summary's -inf) add exact
// zeros, not subnormals (a microcode assist each).
OASISKV_TARGET_AVX2 inline __m256 exp8_normal(__m256 x) {
  const __m256 normal = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3365478515625f), _CMP_GE_OQ);
  return _mm256_and_ps(normal, exp8_avx2(x));
}

// out[i] = exp(scale * (x[i] - m)); returns the sum of the out[i]. Two accumulators: the adds of
// consecutive vectors do not wait on each other.
OASISKV_TARGET_AVX2 inline float exp_sum_avx2(const float* x, float m, std::size_t count,
                                              float scale, float* out) {
  const __m256 s = _mm256_set1_ps(scale), mv = _mm256_set1_ps(m);
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  std::size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m256 e0 = exp8_normal(_mm256_mul_ps(s, _mm256_sub_ps(_mm256_loadu_ps(x + i), mv)));
    const __m256 e1 = exp8_normal(_mm256_mul_ps(s, _mm256_sub_ps(_mm256_loadu_ps(x + i + 8), mv)));
    _mm256_storeu_ps(out + i, e0);
    _mm256_storeu_ps(out + i + 8, e1);
    a0 = _mm256_add_ps(a0, e0);
    a1 = _mm256_add_ps(a1, e1);
  }
  for (; i + 8 <= count; i += 8) {
    const __m256 e0 = exp8_normal(_mm256_mul_ps(s, _mm256_sub_ps(_mm256_loadu_ps(x + i), mv)));
    _mm256_storeu_ps(out + i, e0);
    a0 = _mm256_add_ps(a0, e0);
  }
  float sum = hsum8(_mm256_add_ps(a0, a1));
  for (; i < count; ++i) {
    out[i] = std::exp(scale * (x[i] - m));
    sum += out[i];
  }
  return sum;
}

// out[i] = x[i] clamped to [-FLT_MAX, FLT_MAX] (NaN to FLT_MAX); returns the largest out[i].
OASISKV_TARGET_AVX2 inline float clamp_finite_max_avx2(const float* x, std::size_t count,
                                                       float* out) {
  constexpr float lim = std::numeric_limits<float>::max();
  const __m256 hi = _mm256_set1_ps(lim), lo = _mm256_set1_ps(-lim);
  __m256 m0 = lo, m1 = lo;
  std::size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    // minps returns its second operand when either is NaN: NaN and +inf become lim.
    const __m256 v0 = _mm256_max_ps(_mm256_min_ps(_mm256_loadu_ps(x + i), hi), lo);
    const __m256 v1 = _mm256_max_ps(_mm256_min_ps(_mm256_loadu_ps(x + i + 8), hi), lo);
    _mm256_storeu_ps(out + i, v0);
    _mm256_storeu_ps(out + i + 8, v1);
    m0 = _mm256_max_ps(m0, v0);
    m1 = _mm256_max_ps(m1, v1);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(m0, m1));
  float m = -lim;
  for (const float v : lanes) {
    m = v > m ? v : m;
  }
  for (; i < count; ++i) {
    const float v = x[i] <= lim ? (x[i] >= -lim ? x[i] : -lim) : lim;
    out[i] = v;
    m = v > m ? v : m;
  }
  return m;
}

// acc[i] += k * x[i].
OASISKV_TARGET_AVX2 inline void add_scaled_avx2(float* acc, const float* x, float k,
                                                std::size_t count) {
  const __m256 kv = _mm256_set1_ps(k);
  std::size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    _mm256_storeu_ps(acc + i,
                     _mm256_fmadd_ps(kv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(acc + i)));
  }
  for (; i < count; ++i) {
    acc[i] += k * x[i];
  }
}

}  // namespace oasiskv::cpu::detail

#include "oasiskv/cpu/kernel_end.hpp"
#endif  // OASISKV_X86_KERNELS
