// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The AVX2 + FMA + F16C block function of the CPU decode kernel: every head dim (a
//! multiple of 8) on pre-AVX-512 x86, and the generic head dims everywhere.
//!
//! The same three steps as the AVX-512 path (see block_avx512.hpp), on 8-float registers. With
//! 16 registers the score tile is 2 query rows x 4 keys (8 accumulators) and the value tile is
//! 4 rows x 16 floats.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "oasiskv/attention/cpu/row_state.hpp"
#include "oasiskv/core/dtype.hpp"
#include "oasiskv/cpu/isa.hpp"

#if OASISKV_X86_KERNELS

#include "oasiskv/cpu/kernel_begin.hpp"

namespace oasiskv::cpu::detail::avx2 {

OASISKV_TARGET_AVX2 inline __m256 load8(const float* p) {
  return _mm256_loadu_ps(p);
}
OASISKV_TARGET_AVX2 inline __m256 load8(const f16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
OASISKV_TARGET_AVX2 inline __m256 load8(const bf16* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}

OASISKV_TARGET_AVX2 inline void prefetch_bytes(const void* p, std::size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (std::size_t off = 0; off < bytes; off += 64) {
    _mm_prefetch(c + off, _MM_HINT_T0);
  }
}

// 2^x for x <= 0 (see the AVX-512 version); 2^n is built in the exponent field, so x is clamped
// at -126 (2^-126 instead of 0 for weights that small: far below f32 resolution of the sum).
OASISKV_TARGET_AVX2 inline __m256 exp2(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.525273380405984e-05f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381606e-04f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618129107628477e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550410866482158e-02f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402265069591007e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931471805599453e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

OASISKV_TARGET_AVX2 inline float hsum(__m256 a) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

OASISKV_TARGET_AVX2 inline float hmax(__m256 a) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// Lane i of the result is the horizontal sum of a[i] (in-lane unpack tree, then the two halves).
OASISKV_TARGET_AVX2 inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 x01 = _mm256_add_ps(_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
  const __m256 x23 = _mm256_add_ps(_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
  const __m256d lo = _mm256_unpacklo_pd(_mm256_castps_pd(x01), _mm256_castps_pd(x23));
  const __m256d hi = _mm256_unpackhi_pd(_mm256_castps_pd(x01), _mm256_castps_pd(x23));
  const __m256 y = _mm256_add_ps(_mm256_castpd_ps(lo), _mm256_castpd_ps(hi));
  return _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
}

// Scores of RT (<= 2) rows against keys [0, n); see block_avx512.hpp.
template <class T, unsigned D, unsigned RT>
OASISKV_TARGET_AVX2 void scores_tile(const float* q, std::uint32_t d, const T* k, std::uint32_t n,
                                     float* s, std::uint32_t s_stride, const T* next_k) {
  const std::uint32_t nc = (D != 0 ? D : d) / 8;
  const std::size_t row = D != 0 ? D : d;
  std::uint32_t t = 0;
  for (; t + 4 <= n; t += 4) {
    if (next_k != nullptr) {
      prefetch_bytes(next_k + t * row, 4 * row * sizeof(T));
    }
    __m256 a[RT][4];
#pragma GCC unroll 4
    for (unsigned r = 0; r < RT; ++r) {
#pragma GCC unroll 4
      for (unsigned i = 0; i < 4; ++i) {
        a[r][i] = _mm256_setzero_ps();
      }
    }
#pragma GCC unroll 16
    for (std::uint32_t c = 0; c < nc; ++c) {
      __m256 kv[4];
#pragma GCC unroll 4
      for (unsigned i = 0; i < 4; ++i) {
        kv[i] = load8(k + (t + i) * row + c * 8);
      }
#pragma GCC unroll 4
      for (unsigned r = 0; r < RT; ++r) {
        const __m256 qv = _mm256_loadu_ps(q + r * row + c * 8);
#pragma GCC unroll 4
        for (unsigned i = 0; i < 4; ++i) {
          a[r][i] = _mm256_fmadd_ps(qv, kv[i], a[r][i]);
        }
      }
    }
#pragma GCC unroll 4
    for (unsigned r = 0; r < RT; ++r) {
      _mm_storeu_ps(s + r * s_stride + t, reduce4(a[r][0], a[r][1], a[r][2], a[r][3]));
    }
  }
  for (; t < n; ++t) {
    __m256 a[RT];
#pragma GCC unroll 4
    for (unsigned r = 0; r < RT; ++r) {
      a[r] = _mm256_setzero_ps();
    }
    for (std::uint32_t c = 0; c < nc; ++c) {
      const __m256 kv = load8(k + t * row + c * 8);
#pragma GCC unroll 4
      for (unsigned r = 0; r < RT; ++r) {
        a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * row + c * 8), kv, a[r]);
      }
    }
#pragma GCC unroll 4
    for (unsigned r = 0; r < RT; ++r) {
      s[r * s_stride + t] = hsum(a[r]);
    }
  }
}

// acc[r] = alpha[r] * acc[r] + sum_t p[r][t] * v[t] for RT (<= 4) rows, W (1 or 2) chunks of 8
// floats at a time starting at chunk c0.
template <class T, unsigned RT, unsigned W>
OASISKV_TARGET_AVX2 void values_chunks(float* acc, const float* alpha, const float* p,
                                       std::uint32_t s_stride, const T* v, std::size_t row,
                                       std::uint32_t n, std::uint32_t c0) {
  __m256 a[RT][W];
#pragma GCC unroll 4
  for (unsigned r = 0; r < RT; ++r) {
    const __m256 al = _mm256_set1_ps(alpha[r]);
#pragma GCC unroll 2
    for (unsigned i = 0; i < W; ++i) {
      a[r][i] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * row + (c0 + i) * 8), al);
    }
  }
  for (std::uint32_t t = 0; t < n; ++t) {
    __m256 vv[W];
#pragma GCC unroll 2
    for (unsigned i = 0; i < W; ++i) {
      vv[i] = load8(v + t * row + (c0 + i) * 8);
    }
#pragma GCC unroll 4
    for (unsigned r = 0; r < RT; ++r) {
      const __m256 pr = _mm256_set1_ps(p[r * s_stride + t]);
#pragma GCC unroll 2
      for (unsigned i = 0; i < W; ++i) {
        a[r][i] = _mm256_fmadd_ps(pr, vv[i], a[r][i]);
      }
    }
  }
#pragma GCC unroll 4
  for (unsigned r = 0; r < RT; ++r) {
#pragma GCC unroll 2
    for (unsigned i = 0; i < W; ++i) {
      _mm256_storeu_ps(acc + r * row + (c0 + i) * 8, a[r][i]);
    }
  }
}

template <class T, unsigned D, unsigned RT>
OASISKV_TARGET_AVX2 void values_tile(float* acc, const float* alpha, const float* p,
                                     std::uint32_t s_stride, const T* v, std::uint32_t d,
                                     std::uint32_t n, const T* next_v) {
  const std::size_t row = D != 0 ? D : d;
  const std::uint32_t nc = static_cast<std::uint32_t>(row / 8);
  if (next_v != nullptr) {
    prefetch_bytes(next_v, n * row * sizeof(T));
  }
  std::uint32_t c = 0;
  for (; c + 2 <= nc; c += 2) {
    values_chunks<T, RT, 2>(acc, alpha, p, s_stride, v, row, n, c);
  }
  if (c < nc) {
    values_chunks<T, RT, 1>(acc, alpha, p, s_stride, v, row, n, c);
  }
}

OASISKV_TARGET_AVX2 inline void softmax_row(float* s, std::uint32_t vis, std::uint32_t vmax,
                                            float& m, float& l, float& alpha) {
  if (vis == 0) {
    alpha = 1.0f;
    for (std::uint32_t t = 0; t < vmax; t += 8) {
      _mm256_storeu_ps(s + t, _mm256_setzero_ps());
    }
    return;
  }
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  __m256 mx = ninf;
  for (std::uint32_t t = 0; t < vis; t += 8) {
    const __m256 keep =
        _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(vis - t)), iota));
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + t), keep));
  }
  const float mblk = hmax(mx);
  const float m_new = m > mblk ? m : mblk;
  alpha = std::exp2(m - m_new);
  const __m256 mv = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (std::uint32_t t = 0; t < vmax; t += 8) {
    const int left = t >= vis ? 0 : static_cast<int>(vis - t);
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(left), iota));
    const __m256 e = _mm256_and_ps(exp2(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv)), keep);
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  l = l * alpha + hsum(sum);
  m = m_new;
}

template <class T, unsigned D, unsigned RT>
OASISKV_TARGET_AVX2 void tile(const row_state& st, const block_span& b, std::uint32_t r0,
                              bool first) {
  const std::uint32_t d = D != 0 ? D : st.head_dim;
  const T* k = static_cast<const T*>(b.k);
  const T* next_k = first ? static_cast<const T*>(b.next_k) : nullptr;
  const T* next_v = first ? static_cast<const T*>(b.next_v) : nullptr;
  std::uint32_t r = r0;
  for (; r + 2 <= r0 + RT; r += 2) {
    scores_tile<T, D, 2>(st.q + std::size_t{r} * d, d, k, b.vmax,
                         st.s + std::size_t{r} * st.s_stride, st.s_stride,
                         r == r0 ? next_k : nullptr);
  }
  if (r < r0 + RT) {
    scores_tile<T, D, 1>(st.q + std::size_t{r} * d, d, k, b.vmax,
                         st.s + std::size_t{r} * st.s_stride, st.s_stride,
                         r == r0 ? next_k : nullptr);
  }
  for (r = r0; r < r0 + RT; ++r) {
    softmax_row(st.s + std::size_t{r} * st.s_stride, st.vis[r], b.vmax, st.m[r], st.l[r],
                st.alpha[r]);
  }
  values_tile<T, D, RT>(st.acc + std::size_t{r0} * d, st.alpha + r0,
                        st.s + std::size_t{r0} * st.s_stride, st.s_stride,
                        static_cast<const T*>(b.v), d, b.vmax, next_v);
}

//! @brief `block_fn` for element type T and head dim D (64, 128, or 0 for any multiple of 8).
template <class T, unsigned D>
OASISKV_TARGET_AVX2 void block(const row_state& st, const block_span& b) {
  std::uint32_t r0 = 0;
  for (; r0 + 4 <= st.rows; r0 += 4) {
    tile<T, D, 4>(st, b, r0, r0 == 0);
  }
  switch (st.rows - r0) {
    case 1:
      tile<T, D, 1>(st, b, r0, r0 == 0);
      break;
    case 2:
      tile<T, D, 2>(st, b, r0, r0 == 0);
      break;
    case 3:
      tile<T, D, 3>(st, b, r0, r0 == 0);
      break;
    default:
      break;
  }
}

}  // namespace oasiskv::cpu::detail::avx2

#include "oasiskv/cpu/kernel_end.hpp"
#endif  // OASISKV_X86_KERNELS
