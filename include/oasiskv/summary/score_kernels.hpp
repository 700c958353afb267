// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The inner loop every summary scores with: one stored vector per entry against a few
//! query rows, in f32, for entries stored as f32, f16 or bf16. AVX-512 and AVX2 paths are
//! compiled with function-level target attributes and chosen at run time, so a consumer builds
//! with no `-march` flag; a scalar path serves every other machine.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>
#include <type_traits>

#include "oasiskv/config.hpp"
#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/isa.hpp"

namespace oasiskv::detail {

//! @brief Widens a stored summary element.
OASISKV_ALWAYS_INLINE float widen(float v) noexcept {
  return v;
}
OASISKV_ALWAYS_INLINE float widen(f16 v) noexcept {
  return v.to_float();
}
OASISKV_ALWAYS_INLINE float widen(bf16 v) noexcept {
  return v.to_float();
}

// f16 and bf16 are both sign-magnitude, so the neighbouring value is one step of the bits.
template <class S>
constexpr S next_toward_pos_inf(S r) noexcept {
  if (r.bits == 0x0000u || r.bits == 0x8000u) {
    return S{0x0001u};
  }
  return S{static_cast<std::uint16_t>((r.bits & 0x8000u) ? r.bits - 1u : r.bits + 1u)};
}
template <class S>
constexpr S next_toward_neg_inf(S r) noexcept {
  if (r.bits == 0x0000u || r.bits == 0x8000u) {
    return S{0x8001u};
  }
  return S{static_cast<std::uint16_t>((r.bits & 0x8000u) ? r.bits + 1u : r.bits - 1u)};
}

//! @brief The least `S` not below `x`: a stored maximum must never shrink, or the bound breaks.
template <class S>
constexpr S round_up(float x) noexcept {
  if constexpr (std::is_same_v<S, float>) {
    return x;
  } else {
    const S r = S::from_float(x);
    return r.to_float() < x ? next_toward_pos_inf(r) : r;
  }
}
//! @brief The greatest `S` not above `x`.
template <class S>
constexpr S round_down(float x) noexcept {
  if constexpr (std::is_same_v<S, float>) {
    return x;
  } else {
    const S r = S::from_float(x);
    return r.to_float() > x ? next_toward_neg_inf(r) : r;
  }
}

template <class S>
void dot_entries_scalar(const S* base, std::size_t entry_stride, std::span<const std::uint32_t> ids,
                        const float* rows, std::uint32_t n, std::uint32_t len, float* out) {
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const S* v = base + std::size_t{ids[i]} * entry_stride;
    for (std::uint32_t r = 0; r < n; ++r) {
      const float* q = rows + std::size_t{r} * len;
      float acc[8] = {};  // eight partial sums: vectorisable without -ffast-math
      for (std::uint32_t x = 0; x < len; x += 8) {
        for (std::uint32_t k = 0; k < 8; ++k) {
          acc[k] += q[x + k] * widen(v[x + k]);
        }
      }
      out[i * n + r] =
          ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    }
  }
}

#if OASISKV_X86_KERNELS

// gcc 12's unmasked AVX-512 conversions start from _mm512_undefined_*(), which -Wuninitialized
// reports once inlined; the zero-masked forms used below avoid them, this keeps stragglers quiet.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

OASISKV_TARGET_AVX2 inline float hsum8(__m256 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
OASISKV_TARGET_AVX512 inline __m512 load16(const float* p) {
  return _mm512_loadu_ps(p);
}
OASISKV_TARGET_AVX512 inline __m512 load16(const f16* p) {
  return _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
OASISKV_TARGET_AVX512 inline __m512 load16(const bf16* p) {
  const __m512i w =
      _mm512_maskz_cvtepu16_epi32(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, w, 16));
}
// The 8-element tail of a row whose length is 8 mod 16; the upper lanes are zero.
OASISKV_TARGET_AVX512 inline __m512 load8_zext(const float* p) {
  return _mm512_maskz_loadu_ps(0x00ff, p);
}
OASISKV_TARGET_AVX512 inline __m512 load8_zext(const f16* p) {
  return _mm512_maskz_cvtph_ps(
      0xffff, _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
OASISKV_TARGET_AVX512 inline __m512 load8_zext(const bf16* p) {
  const __m512i w = _mm512_maskz_cvtepu16_epi32(
      0xffff, _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, w, 16));
}

// Writes the horizontal sums of R accumulators to out[0..R): for 4 and 8 rows a transposing
// add tree, which costs about a third of R separate reductions.
template <int R>
OASISKV_TARGET_AVX512 inline void reduce_store(const __m512* acc, float* out) {
  __m256 y[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    y[r] = _mm256_add_ps(
        _mm512_castps512_ps256(acc[r]),
        _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xff, _mm512_castps_pd(acc[r]), 1)));
  }
  if constexpr (R == 8) {
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(y[0], y[1]), _mm256_hadd_ps(y[2], y[3]));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(y[4], y[5]), _mm256_hadd_ps(y[6], y[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20),
                                        _mm256_permute2f128_ps(h0, h1, 0x31)));
  } else if constexpr (R == 4) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(y[0], y[1]), _mm256_hadd_ps(y[2], y[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  } else {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      out[r] = hsum8(y[r]);
    }
  }
}

// R query rows against one entry. Fewer than 8 rows keep two accumulators per row, so at
// least 8 independent FMA chains hide the FMA latency.
template <int R, class S>
OASISKV_TARGET_AVX512 inline void dot_tile_avx512(const S* v, const float* rows, std::uint32_t len,
                                                  float* out) {
  constexpr int split = R >= 8 ? 1 : 2;
  __m512 acc[split][R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc[0][r] = _mm512_setzero_ps();
    acc[split - 1][r] = _mm512_setzero_ps();
  }
  std::uint32_t x = 0;
  for (; x + 16 * split <= len; x += 16 * split) {
#pragma GCC unroll 2
    for (int k = 0; k < split; ++k) {
      const __m512 e = load16(v + x + 16 * k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        acc[k][r] = _mm512_fmadd_ps(
            _mm512_loadu_ps(rows + static_cast<std::size_t>(r) * len + x + 16 * k), e, acc[k][r]);
      }
    }
  }
  for (; x + 16 <= len; x += 16) {
    const __m512 e = load16(v + x);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      acc[0][r] = _mm512_fmadd_ps(_mm512_loadu_ps(rows + static_cast<std::size_t>(r) * len + x), e,
                                  acc[0][r]);
    }
  }
  if (x < len) {
    const __m512 e = load8_zext(v + x);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      acc[0][r] =
          _mm512_fmadd_ps(load8_zext(rows + static_cast<std::size_t>(r) * len + x), e, acc[0][r]);
    }
  }
  if constexpr (split == 2) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      acc[0][r] = _mm512_add_ps(acc[0][r], acc[1][r]);
    }
  }
  reduce_store<R>(acc[0], out);
}

template <class S>
OASISKV_TARGET_AVX512 void dot_entries_avx512(const S* base, std::size_t entry_stride,
                                              std::span<const std::uint32_t> ids, const float* rows,
                                              std::uint32_t n, std::uint32_t len, float* out) {
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const S* v = base + std::size_t{ids[i]} * entry_stride;
    if (i + 1 < ids.size()) {
      _mm_prefetch(reinterpret_cast<const char*>(base + std::size_t{ids[i + 1]} * entry_stride),
                   _MM_HINT_T0);
    }
    float* o = out + i * n;
    std::uint32_t r = 0;
    for (; r + 8 <= n; r += 8) {
      dot_tile_avx512<8>(v, rows + std::size_t{r} * len, len, o + r);
    }
    // The rest in one tile: GQA groups of 3 (SmolLM2) or 6 rows stay one pass over the entry.
    const float* rest = rows + std::size_t{r} * len;
    switch (n - r) {
      case 7:
        dot_tile_avx512<7>(v, rest, len, o + r);
        break;
      case 6:
        dot_tile_avx512<6>(v, rest, len, o + r);
        break;
      case 5:
        dot_tile_avx512<5>(v, rest, len, o + r);
        break;
      case 4:
        dot_tile_avx512<4>(v, rest, len, o + r);
        break;
      case 3:
        dot_tile_avx512<3>(v, rest, len, o + r);
        break;
      case 2:
        dot_tile_avx512<2>(v, rest, len, o + r);
        break;
      case 1:
        dot_tile_avx512<1>(v, rest, len, o + r);
        break;
      default:
        break;
    }
  }
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

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

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

// out[i] = exp(scale * (x[i] - m)); returns the sum of the out[i]. Two accumulators: the adds of
// consecutive vectors do not wait on each other.
OASISKV_TARGET_AVX2 inline float exp_sum_avx2(const float* x, float m, std::size_t count,
                                              float scale, float* out) {
  const __m256 s = _mm256_set1_ps(scale), mv = _mm256_set1_ps(m);
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  std::size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m256 e0 = exp8_avx2(_mm256_mul_ps(s, _mm256_sub_ps(_mm256_loadu_ps(x + i), mv)));
    const __m256 e1 = exp8_avx2(_mm256_mul_ps(s, _mm256_sub_ps(_mm256_loadu_ps(x + i + 8), mv)));
    _mm256_storeu_ps(out + i, e0);
    _mm256_storeu_ps(out + i + 8, e1);
    a0 = _mm256_add_ps(a0, e0);
    a1 = _mm256_add_ps(a1, e1);
  }
  for (; i + 8 <= count; i += 8) {
    const __m256 e0 = exp8_avx2(_mm256_mul_ps(s, _mm256_sub_ps(_mm256_loadu_ps(x + i), mv)));
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

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push  // gcc 12's intrinsic headers trip these under -O2
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

// exp8_avx2 on 16 floats.
OASISKV_TARGET_AVX512 inline __m512 exp16_avx512(__m512 x) {
  x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3365478515625f));
  const __m512 fx = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, z, x), _mm512_set1_ps(1.0f));
  const __m512i e =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(0x7f)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

OASISKV_TARGET_AVX512 inline __mmask16 tail16(std::size_t i, std::size_t count) {
  return count - i >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (count - i)) - 1u);
}

// exp_sum_avx2 16 at a time; the tail is masked (the polynomial too, not std::exp).
OASISKV_TARGET_AVX512 inline float exp_sum_avx512(const float* x, float m, std::size_t count,
                                                  float scale, float* out) {
  const __m512 s = _mm512_set1_ps(scale), mv = _mm512_set1_ps(m);
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  std::size_t i = 0;
  for (; i + 32 <= count; i += 32) {
    const __m512 e0 = exp16_avx512(_mm512_mul_ps(s, _mm512_sub_ps(_mm512_loadu_ps(x + i), mv)));
    const __m512 e1 =
        exp16_avx512(_mm512_mul_ps(s, _mm512_sub_ps(_mm512_loadu_ps(x + i + 16), mv)));
    _mm512_storeu_ps(out + i, e0);
    _mm512_storeu_ps(out + i + 16, e1);
    a0 = _mm512_add_ps(a0, e0);
    a1 = _mm512_add_ps(a1, e1);
  }
  for (; i < count; i += 16) {
    const __mmask16 k = tail16(i, count);
    const __m512 e =
        exp16_avx512(_mm512_mul_ps(s, _mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), mv)));
    _mm512_mask_storeu_ps(out + i, k, e);
    a0 = _mm512_mask_add_ps(a0, k, a0, e);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

// clamp_finite_max_avx2 16 at a time, with a masked tail.
OASISKV_TARGET_AVX512 inline float clamp_finite_max_avx512(const float* x, std::size_t count,
                                                           float* out) {
  constexpr float lim = std::numeric_limits<float>::max();
  const __m512 hi = _mm512_set1_ps(lim), lo = _mm512_set1_ps(-lim);
  __m512 m0 = lo, m1 = lo;
  std::size_t i = 0;
  for (; i + 32 <= count; i += 32) {
    // minps returns its second operand when either is NaN: NaN and +inf become lim.
    const __m512 v0 = _mm512_max_ps(_mm512_min_ps(_mm512_loadu_ps(x + i), hi), lo);
    const __m512 v1 = _mm512_max_ps(_mm512_min_ps(_mm512_loadu_ps(x + i + 16), hi), lo);
    _mm512_storeu_ps(out + i, v0);
    _mm512_storeu_ps(out + i + 16, v1);
    m0 = _mm512_max_ps(m0, v0);
    m1 = _mm512_max_ps(m1, v1);
  }
  for (; i < count; i += 16) {
    const __mmask16 k = tail16(i, count);
    const __m512 v = _mm512_max_ps(_mm512_min_ps(_mm512_maskz_loadu_ps(k, x + i), hi), lo);
    _mm512_mask_storeu_ps(out + i, k, v);
    m0 = _mm512_mask_max_ps(m0, k, m0, v);
  }
  return _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
}

// acc[i] += k * x[i], 16 at a time, with a masked tail.
OASISKV_TARGET_AVX512 inline void add_scaled_avx512(float* acc, const float* x, float k,
                                                    std::size_t count) {
  const __m512 kv = _mm512_set1_ps(k);
  for (std::size_t i = 0; i < count; i += 16) {
    const __mmask16 t = tail16(i, count);
    _mm512_mask_storeu_ps(
        acc + i, t,
        _mm512_fmadd_ps(kv, _mm512_maskz_loadu_ps(t, x + i), _mm512_maskz_loadu_ps(t, acc + i)));
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // OASISKV_X86_KERNELS

//! @brief `out[i] = exp(scale * (x[i] - m))` for `i < count` (`x` finite; `out` may be `x`);
//! returns the sum of the `out[i]`. The AVX-512 and AVX2 paths' polynomial is within about 2 ulp
//! of `std::exp` and returns ~1e-38, not 0, below -87.3; the scalar path is `std::exp`.
inline float exp_sum(const float* x, float m, std::size_t count, float scale, float* out) {
#if OASISKV_X86_KERNELS
  static const bool avx512 = isa_supported(cpu_isa::avx512);
  if (avx512) {
    return exp_sum_avx512(x, m, count, scale, out);
  }
  static const bool avx2 = isa_supported(cpu_isa::avx2);
  if (avx2) {
    return exp_sum_avx2(x, m, count, scale, out);
  }
#endif
  float sum = 0.0f;
  for (std::size_t i = 0; i < count; ++i) {
    out[i] = std::exp(scale * (x[i] - m));
    sum += out[i];
  }
  return sum;
}

//! @brief `out[i]` = `x[i]` clamped to the finite floats (`+inf` and NaN to the largest, `-inf`
//! to the lowest) for `i < count` (`out` may be `x`); returns the largest `out[i]`, or the lowest
//! finite float when `count` is 0.
inline float clamp_finite_max(const float* x, std::size_t count, float* out) {
#if OASISKV_X86_KERNELS
  static const bool avx512 = isa_supported(cpu_isa::avx512);
  if (avx512) {
    return clamp_finite_max_avx512(x, count, out);
  }
  static const bool avx2 = isa_supported(cpu_isa::avx2);
  if (avx2) {
    return clamp_finite_max_avx2(x, count, out);
  }
#endif
  constexpr float lim = std::numeric_limits<float>::max();
  float m = -lim;
  for (std::size_t i = 0; i < count; ++i) {
    const float v = x[i] <= lim ? (x[i] >= -lim ? x[i] : -lim) : lim;
    out[i] = v;
    m = v > m ? v : m;
  }
  return m;
}

//! @brief `acc[i] += k * x[i]` for `i < count`.
inline void add_scaled(float* acc, const float* x, float k, std::size_t count) {
#if OASISKV_X86_KERNELS
  static const bool avx512 = isa_supported(cpu_isa::avx512);
  if (avx512) {
    add_scaled_avx512(acc, x, k, count);
    return;
  }
  static const bool avx2 = isa_supported(cpu_isa::avx2);
  if (avx2) {
    add_scaled_avx2(acc, x, k, count);
    return;
  }
#endif
  for (std::size_t i = 0; i < count; ++i) {
    acc[i] += k * x[i];
  }
}

//! @brief `out[i * n + r] = dot(rows[r], base[ids[i] * entry_stride .. + len])` for every entry
//! id and query row. `rows` is `[n][len]`; `len` is a multiple of 8. `isa` is already resolved.
template <class S>
void dot_entries(cpu_isa isa, const S* base, std::size_t entry_stride,
                 std::span<const std::uint32_t> ids, const float* rows, std::uint32_t n,
                 std::uint32_t len, float* out) {
#if OASISKV_X86_KERNELS
  if (isa == cpu_isa::avx512) {
    dot_entries_avx512(base, entry_stride, ids, rows, n, len, out);
    return;
  }
  if (isa == cpu_isa::avx2) {
    dot_entries_avx2(base, entry_stride, ids, rows, n, len, out);
    return;
  }
#endif
  (void)isa;
  dot_entries_scalar(base, entry_stride, ids, rows, n, len, out);
}

//! @brief Of a list of entry ids: the largest id, and how many ids are their predecessor plus one.
struct entry_id_stats {
  std::uint32_t top = 0;
  std::uint32_t steps = 0;
};

#if OASISKV_X86_KERNELS
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push  // gcc 12's intrinsic headers trip these under -O2
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
// One pass, 16 ids at a time (each beside its predecessor, loaded one id back).
OASISKV_TARGET_AVX512 inline entry_id_stats entry_id_stats_avx512(
    std::span<const std::uint32_t> ids) {
  const std::uint32_t* p = ids.data();
  const std::size_t n = ids.size();
  __m512i top = _mm512_setzero_si512();
  std::uint32_t steps = 0;
  const __m512i one = _mm512_set1_epi32(1);
  std::size_t i = 1;  // ids[i - 1] exists
  for (; i + 16 <= n; i += 16) {
    const __m512i v = _mm512_loadu_si512(p + i);
    const __m512i prev = _mm512_loadu_si512(p + i - 1);
    top = _mm512_max_epu32(top, v);
    steps += static_cast<std::uint32_t>(
        __builtin_popcount(_mm512_cmpeq_epi32_mask(v, _mm512_add_epi32(prev, one))));
  }
  std::uint32_t t = std::max(_mm512_reduce_max_epu32(top), p[0]);
  for (; i < n; ++i) {
    t = p[i] > t ? p[i] : t;
    steps += p[i] == p[i - 1] + 1 ? 1u : 0u;
  }
  return {t, steps};
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

// Two branch-free passes (a max and a count) that the compiler vectorises.
inline entry_id_stats entry_id_stats_scalar(std::span<const std::uint32_t> ids) {
  std::uint32_t top = 0, steps = 0;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    top = ids[i] > top ? ids[i] : top;
  }
  for (std::size_t i = 1; i < ids.size(); ++i) {
    steps += ids[i] == ids[i - 1] + 1 ? 1u : 0u;
  }
  return {top, steps};
}

//! @brief `entry_id_stats` of `ids` (not empty).
inline entry_id_stats entry_id_stats_of(std::span<const std::uint32_t> ids) {
#if OASISKV_X86_KERNELS
  static const bool avx512 = isa_supported(cpu_isa::avx512);
  if (avx512) {
    return entry_id_stats_avx512(ids);
  }
#endif
  return entry_id_stats_scalar(ids);
}

}  // namespace oasiskv::detail
