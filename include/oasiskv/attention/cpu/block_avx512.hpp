// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The AVX-512 path of the CPU decode kernel, for head dims 64 and 128: a `range_fn` that
//! walks a task's blocks itself.
//!
//! Decode attention reads every selected K and V byte once and does only `rows` FMAs per element
//! (`rows` = GQA group x query tokens, often 3-4), so it is memory-bound only if the fixed costs
//! around those FMAs stay small; at head dim 64 they used to match the FMAs. Per block, KV head
//! and 16 keys, for a tile of up to 4 rows: (1) the scores of all rows, each key chunk widened
//! to f32 once and used by every row, accumulated per (row, key) and reduced by a shuffle tree
//! straight into one register of 16 scores per row; (2) one online-softmax step for the tile:
//! the running max is raised only when a score exceeds it by `rescale_slack` (rare after the
//! first block), so the usual step is a compare, a polynomial exp2 and a vector add to per-lane
//! sums; (3) values accumulated into up to 4 rows x 64 floats of registers, each value row
//! widened once. The next head's (or next block's) K and V are prefetched while this one is
//! computed.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "oasiskv/attention/cpu/range.hpp"
#include "oasiskv/attention/cpu/row_state.hpp"
#include "oasiskv/core/dtype.hpp"
#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/cpu/math_avx512.hpp"

#if OASISKV_X86_KERNELS

#include "oasiskv/cpu/kernel_begin.hpp"

namespace oasiskv::cpu::detail::avx512 {

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

// Chunk c (16 floats) of a row of T in the lane order the kernel keeps q and acc in. For f32 and
// f16 that is elements [16c, 16c + 16). For bf16 one unpack with zeros widens 16 elements in one
// instruction (a zero-extend and a shift take two), but interleaved: chunk 2b + h holds element
// 32b + 8j + 4h + e in lane 4j + e (see bf16_dim); `range` permutes q into that order on entry
// and acc back on exit, and a dot product or a per-lane accumulation does not care.
template <class T>
OASISKV_TARGET_AVX512 inline __m512 load_chunk(const T* row, unsigned c) {
  if constexpr (std::is_same_v<T, bf16>) {
    const __m512i x = _mm512_loadu_si512(row + (c / 2) * 32);
    return _mm512_castsi512_ps(c % 2 == 0 ? _mm512_unpacklo_epi16(_mm512_setzero_si512(), x)
                                          : _mm512_unpackhi_epi16(_mm512_setzero_si512(), x));
  } else {
    return load16(row + c * 16);
  }
}

// The element of a row that lane `lane` of bf16 chunk c holds.
constexpr std::uint32_t bf16_dim(std::uint32_t c, std::uint32_t lane) noexcept {
  return 32 * (c / 2) + 8 * (lane / 4) + 4 * (c % 2) + lane % 4;
}

// Rows of D floats between natural order and bf16 chunk order (to_chunks: natural -> chunks).
template <unsigned D>
inline void permute_bf16_rows(float* x, std::uint32_t rows, bool to_chunks) noexcept {
  float tmp[D];
  for (std::uint32_t r = 0; r < rows; ++r) {
    float* row = x + std::size_t{r} * D;
    std::copy_n(row, D, tmp);
    for (std::uint32_t i = 0; i < D; ++i) {
      const std::uint32_t dim = bf16_dim(i / 16, i % 16);
      if (to_chunks) {
        row[i] = tmp[dim];
      } else {
        row[dim] = tmp[i];
      }
    }
  }
}

// Touches every cache line of [p, p + bytes) so it is in L1 by the time the next block starts.
OASISKV_TARGET_AVX512 inline void prefetch_bytes(const void* p, std::size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (std::size_t off = 0; off < bytes; off += 64) {
    _mm_prefetch(c + off, _MM_HINT_T0);
  }
}

// 2^x for x <= 0 (math_avx512.hpp).
OASISKV_TARGET_AVX512 inline __m512 exp2(__m512 x) {
  return exp2_16_nonpositive(x);
}

// In-lane partial sums of 4 vectors: 128-bit lane j of the result holds, in element i, the sum of
// a[i]'s elements in lane j (two rounds of unpack+add: 6 shuffles, 3 adds).
OASISKV_TARGET_AVX512 inline __m512 sum4_in_lanes(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 x01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 x23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(x01), _mm512_castps_pd(x23));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(x01), _mm512_castps_pd(x23));
  return _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
}

// Folds pairs of 128-bit lanes: [x.L0 + x.L1, x.L2 + x.L3, y.L0 + y.L1, y.L2 + y.L3].
OASISKV_TARGET_AVX512 inline __m512 fold_lanes(__m512 x, __m512 y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xdd));
}

// The first c lanes (c <= 16 lanes set, c >= 16 all).
OASISKV_TARGET_AVX512 inline __mmask16 first_lanes(std::uint32_t c) {
  return c >= 16 ? __mmask16(0xffff) : __mmask16((1u << c) - 1u);
}

// Partial dot products of R query rows (rows D floats apart) with keys [0, nk) (nk <= 4) of k:
// y[r] = sum4_in_lanes of the 4 per-key accumulators (keys past nk contribute 0). Each key chunk
// is widened once and used by all R rows. Prefetches the same rows of pk when it is set.
template <class T, unsigned D, unsigned R, bool Full>
[[gnu::always_inline]] OASISKV_TARGET_AVX512 inline void key_group(const float* q, const T* k,
                                                                   std::uint32_t nk, __m512 (&y)[R],
                                                                   const T* pk) {
  constexpr unsigned nc = D / 16;
  if (pk != nullptr) {
    prefetch_bytes(pk, (Full ? 4 : nk) * D * sizeof(T));
  }
  // Chunk 0 initialises the accumulators with a plain multiply (an FMA onto zero would make the
  // compiler copy q for every key), the other chunks accumulate.
  __m512 a[R][4];
#pragma GCC unroll 8
  for (unsigned c = 0; c < nc; ++c) {
    __m512 kv[4];
#pragma GCC unroll 4
    for (unsigned i = 0; i < 4; ++i) {
      kv[i] = Full || i < nk ? load_chunk(k + std::size_t{i} * D, c) : _mm512_setzero_ps();
    }
#pragma GCC unroll 4
    for (unsigned r = 0; r < R; ++r) {
      const __m512 qv = _mm512_loadu_ps(q + r * D + c * 16);
#pragma GCC unroll 4
      for (unsigned i = 0; i < 4; ++i) {
        if (c == 0) {
          a[r][i] = Full || i < nk ? _mm512_mul_ps(qv, kv[i]) : _mm512_setzero_ps();
        } else if (Full || i < nk) {
          a[r][i] = _mm512_fmadd_ps(qv, kv[i], a[r][i]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (unsigned r = 0; r < R; ++r) {
    y[r] = sum4_in_lanes(a[r][0], a[r][1], a[r][2], a[r][3]);
  }
}

// key_group over keys [4 gi, 4 gi + 4) of the first n (zeros where the group is empty).
template <class T, unsigned D, unsigned R, bool Full>
[[gnu::always_inline]] OASISKV_TARGET_AVX512 inline void key_group4(const float* q, const T* k,
                                                                    std::uint32_t n, unsigned gi,
                                                                    __m512 (&y)[R], const T* pk) {
  const std::uint32_t nk = Full ? 4u : (n > 4 * gi ? std::min(4u, n - 4 * gi) : 0u);
  if (!Full && nk == 0) {
#pragma GCC unroll 4
    for (unsigned r = 0; r < R; ++r) {
      y[r] = _mm512_setzero_ps();
    }
    return;
  }
  key_group<T, D, R, Full>(q, k + std::size_t{4 * gi} * D, nk, y,
                           pk != nullptr ? pk + std::size_t{4 * gi} * D : nullptr);
}

// Scores of R rows against keys [0, n) (n <= 16) of k: s[r] lane t = q_r . k_t for t < n (lanes
// past n hold 0). Four groups of 4 keys, then two rounds of 128-bit lane folds, so the 16 scores
// of a row take 45 shuffle/add operations in all (a per-4-key reduction to memory takes 52 and a
// store).
template <class T, unsigned D, unsigned R, bool Full>
OASISKV_TARGET_AVX512 inline void scores16(const float* q, const T* k, std::uint32_t n,
                                           __m512 (&s)[R], const T* pk) {
  __m512 y0[R], y1[R], lo[R];
  key_group4<T, D, R, Full>(q, k, n, 0, y0, pk);
  key_group4<T, D, R, Full>(q, k, n, 1, y1, pk);
#pragma GCC unroll 4
  for (unsigned r = 0; r < R; ++r) {
    lo[r] = fold_lanes(y0[r], y1[r]);
  }
  key_group4<T, D, R, Full>(q, k, n, 2, y0, pk);
  key_group4<T, D, R, Full>(q, k, n, 3, y1, pk);
#pragma GCC unroll 4
  for (unsigned r = 0; r < R; ++r) {
    s[r] = fold_lanes(lo[r], fold_lanes(y0[r], y1[r]));
  }
}

// Online-softmax rescale threshold, in log2 units: a row's running max m is raised only when a
// score exceeds m + rescale_slack, so most blocks skip the horizontal max and the rescale of
// acc; weights are then at most 2^rescale_slack, far inside f32 range, and the result is the
// same up to rounding (out = acc / l and lse = m + log2(l) hold for any reference m).
inline constexpr float rescale_slack = 8.0f;

// The rare path of a tile's softmax step: raises m of the rows whose block max exceeds it and
// rescales their acc and lane sums. s holds the tile's masked scores (-inf where not visible).
template <unsigned D, unsigned R>
[[gnu::noinline]] OASISKV_TARGET_AVX512 void raise_max(const row_state& st, std::uint32_t r0,
                                                       const __m512* s) {
  for (unsigned r = 0; r < R; ++r) {
    const std::uint32_t row = r0 + r;
    const float mb = _mm512_reduce_max_ps(s[r]);
    const float m = st.m[row];
    if (!(mb > m)) {
      continue;
    }
    st.m[row] = mb;
    if (m == -INFINITY) {  // nothing accumulated yet: acc and l are 0
      continue;
    }
    const __m512 alpha = _mm512_set1_ps(std::exp2(m - mb));
    float* acc = st.acc + std::size_t{row} * D;
#pragma GCC unroll 8
    for (unsigned c = 0; c < D / 16; ++c) {
      _mm512_storeu_ps(acc + c * 16, _mm512_mul_ps(_mm512_loadu_ps(acc + c * 16), alpha));
    }
    float* lv = st.lv + std::size_t{row} * 16;
    _mm512_storeu_ps(lv, _mm512_mul_ps(_mm512_loadu_ps(lv), alpha));
  }
}

// One step of R rows (r0 ..) over keys [0, n) of one head's block (k, v point at key 0): scores,
// the online-softmax step of all R rows together, and the value accumulation. mk[r] masks the
// keys row r sees. pk, pv (or null): the same keys of the next head or block, to prefetch.
template <class T, unsigned D, unsigned R, bool Full>
OASISKV_TARGET_AVX512 void tile(const row_state& st, std::uint32_t r0, const T* k, const T* v,
                                std::uint32_t n, const __mmask16* mk, const T* pk, const T* pv) {
  __m512 s[R];
  scores16<T, D, R, Full>(st.q + std::size_t{r0} * D, k, n, s, pk);

  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  __mmask16 grow = 0;
#pragma GCC unroll 4
  for (unsigned r = 0; r < R; ++r) {
    s[r] = _mm512_mask_mov_ps(ninf, mk[r], s[r]);
    grow |= _mm512_cmp_ps_mask(s[r], _mm512_set1_ps(st.m[r0 + r] + rescale_slack), _CMP_GT_OQ);
  }
  if (grow != 0) [[unlikely]] {
    raise_max<D, R>(st, r0, s);
  }
  float* p = st.s + std::size_t{r0} * 16;  // this path keeps probabilities 16 floats per row
#pragma GCC unroll 4
  for (unsigned r = 0; r < R; ++r) {
    const std::uint32_t row = r0 + r;
    const __m512 e =
        _mm512_maskz_mov_ps(mk[r], exp2(_mm512_sub_ps(s[r], _mm512_set1_ps(st.m[row]))));
    float* lv = st.lv + std::size_t{row} * 16;
    _mm512_storeu_ps(lv, _mm512_add_ps(_mm512_loadu_ps(lv), e));
    _mm512_storeu_ps(p + r * 16, e);
  }

  constexpr unsigned nc = D / 16;
  constexpr unsigned w = nc < 4 ? nc : 4;
  static_assert(nc % w == 0);
  const std::uint32_t nt = Full ? 16u : n;
  float* acc = st.acc + std::size_t{r0} * D;
#pragma GCC unroll 2
  for (unsigned c0 = 0; c0 < nc; c0 += w) {
    __m512 a[R][w];
#pragma GCC unroll 4
    for (unsigned r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (unsigned i = 0; i < w; ++i) {
        a[r][i] = _mm512_loadu_ps(acc + r * D + (c0 + i) * 16);
      }
    }
    const T* pvc = c0 == 0 ? pv : nullptr;
#pragma GCC unroll 2
    for (std::uint32_t t = 0; t < nt; ++t) {
      if (pvc != nullptr) {
        prefetch_bytes(pvc + std::size_t{t} * D, D * sizeof(T));
      }
      __m512 vv[w];
#pragma GCC unroll 4
      for (unsigned i = 0; i < w; ++i) {
        vv[i] = load_chunk(v + std::size_t{t} * D, c0 + i);
      }
#pragma GCC unroll 4
      for (unsigned r = 0; r < R; ++r) {
        const __m512 pr = _mm512_set1_ps(p[r * 16 + t]);
#pragma GCC unroll 4
        for (unsigned i = 0; i < w; ++i) {
          a[r][i] = _mm512_fmadd_ps(pr, vv[i], a[r][i]);
        }
      }
    }
#pragma GCC unroll 4
    for (unsigned r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (unsigned i = 0; i < w; ++i) {
        _mm512_storeu_ps(acc + r * D + (c0 + i) * 16, a[r][i]);
      }
    }
  }
}

template <class T, unsigned D, unsigned R>
OASISKV_TARGET_AVX512 inline void tile_any(const row_state& st, std::uint32_t r0, const T* k,
                                           const T* v, std::uint32_t n, const __mmask16* mk,
                                           const T* pk, const T* pv) {
  if (n == 16) {
    tile<T, D, R, true>(st, r0, k, v, n, mk, pk, pv);
  } else {
    tile<T, D, R, false>(st, r0, k, v, n, mk, pk, pv);
  }
}

//! @brief `range_fn` for element type T and head dim D (64 or 128). Per block, per KV head, per
//! 16 keys: the rows go in tiles of up to 4 (4 rows x 4 keys of score accumulators fill the
//! registers), each tile computing its 16 scores per row into one register, one softmax step for
//! all its rows, and the value accumulation; the first tile prefetches the next head's (or next
//! block's) same keys and values. Running sums l are kept per lane (`row_state::lv`) and summed
//! once at the end of the range.
template <class T, unsigned D>
OASISKV_TARGET_AVX512 void range(const item_span& a) {
  static_assert(D % 64 == 0, "the AVX-512 path unrolls whole 64-float groups");
  const kv_layout& l = a.pool.layout;
  const std::uint32_t g = a.group;
  const std::uint32_t rows = a.q_len * g;
  if constexpr (std::is_same_v<T, bf16>) {
    for (std::uint32_t hi = 0; hi < a.heads; ++hi) {
      permute_bf16_rows<D>(a.states[hi].q, rows, true);
    }
  }
  std::uint32_t qvis[16];  // q_len <= 16 (validated)
  for (std::uint32_t i = a.begin; i < a.end; ++i) {
    const block_ref ref = a.refs[i];
    const std::uint32_t fill = block_fill(l, ref.index, a.len);
    const std::uint32_t vmax =
        block_visibility(l.tokens_per_block, ref.index, fill, a.len, a.q_len, qvis);
    if (vmax == 0) {
      continue;
    }
    for (std::uint32_t hi = 0; hi < a.heads; ++hi) {
      const std::uint32_t h = a.head + hi;
      const row_state& st = a.states[hi];
      const T* k = a.pool.keys<T>(ref.slot, h);
      const T* v = a.pool.values<T>(ref.slot, h);
      const T* pk = nullptr;
      const T* pv = nullptr;
      if (hi + 1 < a.heads) {
        pk = a.pool.keys<T>(ref.slot, h + 1);
        pv = a.pool.values<T>(ref.slot, h + 1);
      } else if (i + 1 < a.end) {
        pk = a.pool.keys<T>(a.refs[i + 1].slot, a.head);
        pv = a.pool.values<T>(a.refs[i + 1].slot, a.head);
      }
      for (std::uint32_t kt = 0; kt < vmax; kt += 16) {
        const std::uint32_t n = std::min(16u, vmax - kt);
        const std::size_t off = std::size_t{kt} * D;
        for (std::uint32_t r0 = 0; r0 < rows; r0 += 4) {
          const std::uint32_t nr = std::min(4u, rows - r0);
          __mmask16 mk[4];
          for (std::uint32_t r = 0; r < nr; ++r) {
            const std::uint32_t c = qvis[(r0 + r) / g];
            mk[r] = first_lanes(c > kt ? c - kt : 0u);
          }
          const T* tk = r0 == 0 && pk != nullptr ? pk + off : nullptr;
          const T* tv = r0 == 0 && pv != nullptr ? pv + off : nullptr;
          switch (nr) {
            case 4:
              tile_any<T, D, 4>(st, r0, k + off, v + off, n, mk, tk, tv);
              break;
            case 3:
              tile_any<T, D, 3>(st, r0, k + off, v + off, n, mk, tk, tv);
              break;
            case 2:
              tile_any<T, D, 2>(st, r0, k + off, v + off, n, mk, tk, tv);
              break;
            default:
              tile_any<T, D, 1>(st, r0, k + off, v + off, n, mk, tk, tv);
              break;
          }
        }
      }
    }
  }
  for (std::uint32_t hi = 0; hi < a.heads; ++hi) {
    const row_state& st = a.states[hi];
    for (std::uint32_t r = 0; r < rows; ++r) {
      st.l[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(st.lv + std::size_t{r} * 16));
    }
    if constexpr (std::is_same_v<T, bf16>) {
      permute_bf16_rows<D>(st.acc, rows, false);
    }
  }
}

}  // namespace oasiskv::cpu::detail::avx512

#include "oasiskv/cpu/kernel_end.hpp"

#endif  // OASISKV_X86_KERNELS
