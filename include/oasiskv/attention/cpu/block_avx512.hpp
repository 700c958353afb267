//! @file
//! @brief The AVX-512 block function of the CPU decode kernel, for head dims 64 and 128.
//!
//! Decode attention reads every selected K and V byte once and does only `rows` FMAs per element
//! (`rows` = GQA group x query tokens, often 3-4), so it is memory-bound only if the inner loops
//! stay tight. Per block: (1) scores of 4 query rows x 4 keys at a time, each key row converted
//! to f32 once and used by every query row, 16 accumulators in registers and a shuffle tree
//! that turns them into 4x4 dot products; (2) one online-softmax rescale per row per block, with
//! a polynomial exp2; (3) values accumulated into up to 4 rows x 64 floats of registers, each
//! value row converted once. The next block is prefetched while this one is computed.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "oasiskv/attention/cpu/isa.hpp"
#include "oasiskv/attention/cpu/row_state.hpp"
#include "oasiskv/core/dtype.hpp"

#if OASISKV_X86_KERNELS

// gcc 12 before 12.3 (PR 105593) flags the `__m512 __Y = __Y;` inside its own
// _mm512_undefined_* helpers as maybe-uninitialized once they are inlined here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace oasiskv::cpu::impl::avx512 {

// 16 elements of T at p, widened to f32.
OASISKV_TARGET_AVX512 inline __m512 load16(const float* p) {
  return _mm512_loadu_ps(p);
}
OASISKV_TARGET_AVX512 inline __m512 load16(const f16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
OASISKV_TARGET_AVX512 inline __m512 load16(const bf16* p) {
  // bf16 is the upper half of an f32: widening is a zero-extend and a shift.
  // The zero-masked forms: gcc 12's unmasked ones start from _mm512_undefined_epi32(), which
  // -Wmaybe-uninitialized flags once inlined.
  const __mmask16 all = 0xffff;
  const __m512i u =
      _mm512_maskz_cvtepu16_epi32(all, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(all, u, 16));
}

// Touches every cache line of [p, p + bytes) so it is in L1 by the time the next block starts.
OASISKV_TARGET_AVX512 inline void prefetch_bytes(const void* p, std::size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (std::size_t off = 0; off < bytes; off += 64) {
    _mm_prefetch(c + off, _MM_HINT_T0);
  }
}

// 2^x for x <= 0: x = n + f with |f| <= 1/2, a degree-7 Taylor polynomial of 2^f (relative error
// below 1e-8, under f32 rounding), then scalef by 2^n (which also flushes very negative x to 0).
OASISKV_TARGET_AVX512 inline __m512 exp2(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.525273380405984e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Horizontal sums of 4 vectors: lane i of the result is the sum of a[i]. Two rounds of in-lane
// unpack+add (3 shuffles and 3 adds for 4 vectors), then a fold of the four 128-bit lanes.
OASISKV_TARGET_AVX512 inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 x01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 x23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(x01), _mm512_castps_pd(x23));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(x01), _mm512_castps_pd(x23));
  const __m512 y = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(y), _mm512_extractf32x8_ps(y, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Scores of RT query rows (q, rows D floats apart) against keys [0, n) of k, into s (rows
// s_stride apart). When next_k is set, prefetches the same rows of the next block as it goes.
template <class T, unsigned D, unsigned RT>
OASISKV_TARGET_AVX512 void scores_tile(const float* q, const T* k, std::uint32_t n, float* s,
                                       std::uint32_t s_stride, const T* next_k) {
  constexpr unsigned nc = D / 16;
  constexpr std::size_t row_bytes = D * sizeof(T);
  std::uint32_t t = 0;
  for (; t + 4 <= n; t += 4) {
    if (next_k != nullptr) {
      prefetch_bytes(next_k + std::size_t{t} * D, 4 * row_bytes);
    }
    __m512 a[RT][4];
#pragma GCC unroll 16
    for (unsigned r = 0; r < RT; ++r) {
#pragma GCC unroll 4
      for (unsigned i = 0; i < 4; ++i) {
        a[r][i] = _mm512_setzero_ps();
      }
    }
#pragma GCC unroll 8
    for (unsigned c = 0; c < nc; ++c) {
      __m512 kv[4];
#pragma GCC unroll 4
      for (unsigned i = 0; i < 4; ++i) {
        kv[i] = load16(k + (std::size_t{t} + i) * D + c * 16);
      }
#pragma GCC unroll 16
      for (unsigned r = 0; r < RT; ++r) {
        const __m512 qv = _mm512_loadu_ps(q + r * D + c * 16);
#pragma GCC unroll 4
        for (unsigned i = 0; i < 4; ++i) {
          a[r][i] = _mm512_fmadd_ps(qv, kv[i], a[r][i]);
        }
      }
    }
#pragma GCC unroll 16
    for (unsigned r = 0; r < RT; ++r) {
      _mm_storeu_ps(s + std::size_t{r} * s_stride + t, reduce4(a[r][0], a[r][1], a[r][2], a[r][3]));
    }
  }
  for (; t < n; ++t) {
    if (next_k != nullptr) {
      prefetch_bytes(next_k + std::size_t{t} * D, row_bytes);
    }
    __m512 a[RT];
#pragma GCC unroll 16
    for (unsigned r = 0; r < RT; ++r) {
      a[r] = _mm512_setzero_ps();
    }
#pragma GCC unroll 8
    for (unsigned c = 0; c < nc; ++c) {
      const __m512 kv = load16(k + std::size_t{t} * D + c * 16);
#pragma GCC unroll 16
      for (unsigned r = 0; r < RT; ++r) {
        a[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * D + c * 16), kv, a[r]);
      }
    }
#pragma GCC unroll 16
    for (unsigned r = 0; r < RT; ++r) {
      s[std::size_t{r} * s_stride + t] = _mm512_reduce_add_ps(a[r]);
    }
  }
}

// acc[r] = alpha[r] * acc[r] + sum over t < n of p[r][t] * v[t], for RT rows. Up to 4 chunks of 16
// floats per row stay in registers while the tokens stream by, so each value row is converted
// once per chunk group and used by all RT rows.
template <class T, unsigned D, unsigned RT>
OASISKV_TARGET_AVX512 void values_tile(float* acc, const float* alpha, const float* p,
                                       std::uint32_t s_stride, const T* v, std::uint32_t n,
                                       const T* next_v) {
  constexpr unsigned nc = D / 16;
  constexpr unsigned w = nc < 4 ? nc : 4;
  static_assert(nc % w == 0);
  for (unsigned c0 = 0; c0 < nc; c0 += w) {
    __m512 a[RT][w];
#pragma GCC unroll 16
    for (unsigned r = 0; r < RT; ++r) {
      const __m512 al = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 4
      for (unsigned i = 0; i < w; ++i) {
        a[r][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + (c0 + i) * 16), al);
      }
    }
    const bool prefetch = next_v != nullptr && c0 == 0;
    for (std::uint32_t t = 0; t < n; ++t) {
      if (prefetch) {
        prefetch_bytes(next_v + std::size_t{t} * D, D * sizeof(T));
      }
      __m512 vv[w];
#pragma GCC unroll 4
      for (unsigned i = 0; i < w; ++i) {
        vv[i] = load16(v + std::size_t{t} * D + (c0 + i) * 16);
      }
#pragma GCC unroll 16
      for (unsigned r = 0; r < RT; ++r) {
        const __m512 pr = _mm512_set1_ps(p[std::size_t{r} * s_stride + t]);
#pragma GCC unroll 4
        for (unsigned i = 0; i < w; ++i) {
          a[r][i] = _mm512_fmadd_ps(pr, vv[i], a[r][i]);
        }
      }
    }
#pragma GCC unroll 16
    for (unsigned r = 0; r < RT; ++r) {
#pragma GCC unroll 4
      for (unsigned i = 0; i < w; ++i) {
        _mm512_storeu_ps(acc + r * D + (c0 + i) * 16, a[r][i]);
      }
    }
  }
}

// One row's online-softmax step over the block's scores: s[0, vis) become probabilities
// relative to the new running max, s[vis, vmax) become 0.
OASISKV_TARGET_AVX512 inline void softmax_row(float* s, std::uint32_t vis, std::uint32_t vmax,
                                              float& m, float& l, float& alpha) {
  if (vis == 0) {
    alpha = 1.0f;
    for (std::uint32_t t = 0; t < vmax; t += 16) {
      _mm512_storeu_ps(s + t, _mm512_setzero_ps());
    }
    return;
  }
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (std::uint32_t t = 0; t < vis; t += 16) {
    const __mmask16 k = vis - t >= 16 ? __mmask16(0xffff) : __mmask16((1u << (vis - t)) - 1);
    mx = _mm512_mask_max_ps(mx, k, mx, _mm512_loadu_ps(s + t));
  }
  const float mblk = _mm512_reduce_max_ps(mx);
  const float m_new = m > mblk ? m : mblk;
  alpha = std::exp2(m - m_new);  // 0 on the first block seen (m = -inf)
  const __m512 mv = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (std::uint32_t t = 0; t < vmax; t += 16) {
    const __mmask16 k =
        t >= vis ? __mmask16(0)
                 : (vis - t >= 16 ? __mmask16(0xffff) : __mmask16((1u << (vis - t)) - 1));
    const __m512 e = _mm512_maskz_mov_ps(k, exp2(_mm512_sub_ps(_mm512_loadu_ps(s + t), mv)));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  l = l * alpha + _mm512_reduce_add_ps(sum);
  m = m_new;
}

template <class T, unsigned D, unsigned RT>
OASISKV_TARGET_AVX512 void tile(const row_state& st, const block_span& b, std::uint32_t r0,
                                bool first) {
  const T* next_k = first ? static_cast<const T*>(b.next_k) : nullptr;
  const T* next_v = first ? static_cast<const T*>(b.next_v) : nullptr;
  scores_tile<T, D, RT>(st.q + std::size_t{r0} * D, static_cast<const T*>(b.k), b.vmax,
                        st.s + std::size_t{r0} * st.s_stride, st.s_stride, next_k);
  for (std::uint32_t r = r0; r < r0 + RT; ++r) {
    softmax_row(st.s + std::size_t{r} * st.s_stride, st.vis[r], b.vmax, st.m[r], st.l[r],
                st.alpha[r]);
  }
  values_tile<T, D, RT>(st.acc + std::size_t{r0} * D, st.alpha + r0,
                        st.s + std::size_t{r0} * st.s_stride, st.s_stride,
                        static_cast<const T*>(b.v), b.vmax, next_v);
}

//! @brief `block_fn` for element type T and head dim D (64 or 128). Rows go in tiles of 4 (the
//! most whose score accumulators fit in 32 registers); the first tile prefetches the next block.
template <class T, unsigned D>
OASISKV_TARGET_AVX512 void block(const row_state& st, const block_span& b) {
  static_assert(D % 64 == 0, "the AVX-512 path unrolls whole 64-float groups");
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

}  // namespace oasiskv::cpu::impl::avx512

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#endif  // OASISKV_X86_KERNELS
