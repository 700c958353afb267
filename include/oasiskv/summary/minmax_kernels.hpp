//! @file
//! @brief The scoring kernels of `minmax_summary`. Entries are stored in tiles of 16,
//! interleaved per dimension, so that one vector holds one dimension's bound for 16 entries:
//! scoring is then one broadcast multiply-add per (query row, dimension, 16 entries) with no
//! horizontal reduction, and the f16 conversions are shared by every row.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <vector>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/summary/score_kernels.hpp"

namespace oasiskv {
namespace detail {

//! @brief Entries per tile: one AVX-512 vector of f32 lanes.
inline constexpr std::uint32_t minmax_tile_lanes = 16;

//! @brief Where a tiled scoring kernel writes the score of entry `i` (of the call's entry list)
//! for query row `r`: `out[i * block_stride + r * row_stride]`. Entry-major (`score`'s
//! `[entries][rows]`) or row-major (`score_rows`' `[rows][entries]`, what the aggregations read:
//! no transpose between the kernel and the softmax).
struct score_sink {
  float* out = nullptr;
  std::size_t block_stride = 0;
  std::size_t row_stride = 0;

  static score_sink entry_major(float* out, std::uint32_t rows) noexcept { return {out, rows, 1}; }
  static score_sink row_major(float* out, std::size_t entries) noexcept {
    return {out, 1, entries};
  }
  float& at(std::size_t i, std::uint32_t r) const noexcept {
    return out[i * block_stride + r * row_stride];
  }
  //! @brief Entries `i0 + k` (k < count) of rows `r0 + r` (r < rows) from a tile's results
  //! `res[r * lanes + lane0 + k]`.
  void put(const float* res, std::uint32_t lanes, std::uint32_t lane0, std::uint32_t count,
           std::uint32_t r0, std::uint32_t rows, std::size_t i0) const noexcept {
    if (block_stride == 1) {
      for (std::uint32_t r = 0; r < rows; ++r) {
        std::memcpy(out + (r0 + r) * row_stride + i0, res + std::size_t{r} * lanes + lane0,
                    count * sizeof(float));
      }
      return;
    }
    for (std::uint32_t k = 0; k < count; ++k) {
      float* o = out + (i0 + k) * block_stride + r0 * row_stride;
      for (std::uint32_t r = 0; r < rows; ++r) {
        o[r * row_stride] = res[std::size_t{r} * lanes + lane0 + k];
      }
    }
  }
};

//! @brief Where (dimension `x`, bound `which`: 0 = max, 1 = min, lane `j`) lives in a tile of
//! `2 * head_dim * 16` elements. bf16 tiles pair each lane's max and min in one 32-bit word,
//! `[x][lane][max, min]`, split into two f32 vectors by two integer ops (cheaper than
//! widening two f16 vectors); f16 and f32 tiles hold one vector per bound, `[x][max, min][lane]`.
template <class S>
constexpr std::size_t minmax_tile_at(std::uint32_t x, std::uint32_t which,
                                     std::uint32_t lane) noexcept {
  if constexpr (std::is_same_v<S, bf16>) {
    return (std::size_t{x} * minmax_tile_lanes + lane) * 2 + which;
  } else {
    return (std::size_t{x} * 2 + which) * minmax_tile_lanes + lane;
  }
}

// Lanes [lane0, lane0 + count) of one tile against every row of `split` ([n][q+ (d)][q- (d)]);
// writes entries i0 + k of `out`.
template <class S>
void minmax_lanes_scalar(const S* tile, const float* bias, std::uint32_t d, std::uint32_t lane0,
                         std::uint32_t count, const float* split, std::uint32_t n,
                         const score_sink& out, std::size_t i0) {
  for (std::uint32_t k = 0; k < count; ++k) {
    const std::uint32_t j = lane0 + k;
    for (std::uint32_t r = 0; r < n; ++r) {
      const float* qp = split + std::size_t{r} * 2 * d;
      const float* qn = qp + d;
      float acc[8] = {};
      for (std::uint32_t x = 0; x < d; x += 8) {
        for (std::uint32_t e = 0; e < 8; ++e) {
          acc[e] += qp[x + e] * widen(tile[minmax_tile_at<S>(x + e, 0, j)]);
          acc[e] += qn[x + e] * widen(tile[minmax_tile_at<S>(x + e, 1, j)]);
        }
      }
      out.at(i0 + k, r) =
          (((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))) +
          bias[j];
    }
  }
}

#if OASISKV_SCORE_X86

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

// Dimension x's maximum and minimum of the tile's 16 entries, widened to f32.
OASISKV_SCORE_TARGET_AVX512 inline void load_bounds16(const float* t, std::uint32_t x, __m512& mx,
                                                      __m512& mn) {
  mx = _mm512_loadu_ps(t + std::size_t{x} * 32);
  mn = _mm512_loadu_ps(t + std::size_t{x} * 32 + 16);
}
OASISKV_SCORE_TARGET_AVX512 inline void load_bounds16(const f16* t, std::uint32_t x, __m512& mx,
                                                      __m512& mn) {
  mx = load16(t + std::size_t{x} * 32);
  mn = load16(t + std::size_t{x} * 32 + 16);
}
OASISKV_SCORE_TARGET_AVX512 inline void load_bounds16(const bf16* t, std::uint32_t x, __m512& mx,
                                                      __m512& mn) {
  const __m512i w = _mm512_loadu_si512(t + std::size_t{x} * 32);
  mx = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, w, 16));
  mn = _mm512_castsi512_ps(
      _mm512_maskz_and_epi32(0xffff, w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// R rows against the 16 entries of a tile: res[r * 16 + lane]. Separate accumulators for the
// max and min halves give 2R independent FMA chains.
template <int R, class S>
OASISKV_SCORE_TARGET_AVX512 inline void minmax_tile_avx512(const S* tile, const float* bias,
                                                           std::uint32_t d, const float* split,
                                                           float* res) {
  __m512 am[R], an[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    am[r] = _mm512_setzero_ps();
    an[r] = _mm512_setzero_ps();
  }
  for (std::uint32_t x = 0; x < d; ++x) {
    // A dimension of a tile is 64 bytes (f16/bf16) or 128 (f32); run 8 dimensions ahead, into
    // the next tile at the end: in a decode loop the summaries are evicted from L2 between calls.
    _mm_prefetch(reinterpret_cast<const char*>(tile + std::size_t{x + 8} * 32), _MM_HINT_T0);
    __m512 mx, mn;
    load_bounds16(tile, x, mx, mn);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float* qp = split + std::size_t{2} * d * static_cast<std::size_t>(r);
      am[r] = _mm512_fmadd_ps(_mm512_set1_ps(qp[x]), mx, am[r]);
      an[r] = _mm512_fmadd_ps(_mm512_set1_ps(qp[d + x]), mn, an[r]);
    }
  }
  const __m512 bv = _mm512_loadu_ps(bias);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(res + 16 * r, _mm512_add_ps(_mm512_add_ps(am[r], an[r]), bv));
  }
}

// The rows of one run of `count` consecutive lanes of a tile, 8 rows at a time.
template <class S>
OASISKV_SCORE_TARGET_AVX512 void minmax_run_avx512(const S* tile, const float* bias,
                                                   std::uint32_t d, std::uint32_t lane0,
                                                   std::uint32_t count, const float* split,
                                                   std::uint32_t n, const score_sink& out,
                                                   std::size_t i0) {
  alignas(64) float res[8 * 16];
  for (std::uint32_t r0 = 0; r0 < n; r0 += 8) {
    const std::uint32_t rows = n - r0 < 8 ? n - r0 : 8;
    const float* s = split + std::size_t{r0} * 2 * d;
    switch (rows) {
      case 8:
        minmax_tile_avx512<8>(tile, bias, d, s, res);
        break;
      case 7:
        minmax_tile_avx512<7>(tile, bias, d, s, res);
        break;
      case 6:
        minmax_tile_avx512<6>(tile, bias, d, s, res);
        break;
      case 5:
        minmax_tile_avx512<5>(tile, bias, d, s, res);
        break;
      case 4:
        minmax_tile_avx512<4>(tile, bias, d, s, res);
        break;
      case 3:
        minmax_tile_avx512<3>(tile, bias, d, s, res);
        break;
      case 2:
        minmax_tile_avx512<2>(tile, bias, d, s, res);
        break;
      default:
        minmax_tile_avx512<1>(tile, bias, d, s, res);
        break;
    }
    out.put(res, 16, lane0, count, r0, rows, i0);
  }
}

OASISKV_SCORE_TARGET_AVX2 inline void load_bounds8(const float* t, std::uint32_t x,
                                                   std::uint32_t half, __m256& mx, __m256& mn) {
  mx = _mm256_loadu_ps(t + std::size_t{x} * 32 + half * 8);
  mn = _mm256_loadu_ps(t + std::size_t{x} * 32 + 16 + half * 8);
}
OASISKV_SCORE_TARGET_AVX2 inline void load_bounds8(const f16* t, std::uint32_t x,
                                                   std::uint32_t half, __m256& mx, __m256& mn) {
  mx = load8(t + std::size_t{x} * 32 + half * 8);
  mn = load8(t + std::size_t{x} * 32 + 16 + half * 8);
}
OASISKV_SCORE_TARGET_AVX2 inline void load_bounds8(const bf16* t, std::uint32_t x,
                                                   std::uint32_t half, __m256& mx, __m256& mn) {
  const __m256i w =
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + std::size_t{x} * 32 + half * 16));
  mx = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  mn = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// R <= 4 rows against lanes [8 * half, 8 * half + 8) of a tile: res[r * 8 + lane - 8 * half].
template <int R, class S>
OASISKV_SCORE_TARGET_AVX2 inline void minmax_half_avx2(const S* tile, const float* bias,
                                                       std::uint32_t d, std::uint32_t half,
                                                       const float* split, float* res) {
  __m256 am[R], an[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    am[r] = _mm256_setzero_ps();
    an[r] = _mm256_setzero_ps();
  }
  for (std::uint32_t x = 0; x < d; ++x) {
    __m256 mx, mn;
    load_bounds8(tile, x, half, mx, mn);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float* qp = split + std::size_t{2} * d * static_cast<std::size_t>(r);
      am[r] = _mm256_fmadd_ps(_mm256_set1_ps(qp[x]), mx, am[r]);
      an[r] = _mm256_fmadd_ps(_mm256_set1_ps(qp[d + x]), mn, an[r]);
    }
  }
  const __m256 bv = _mm256_loadu_ps(bias + half * 8);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(res + 8 * r, _mm256_add_ps(_mm256_add_ps(am[r], an[r]), bv));
  }
}

template <class S>
OASISKV_SCORE_TARGET_AVX2 void minmax_run_avx2(const S* tile, const float* bias, std::uint32_t d,
                                               std::uint32_t lane0, std::uint32_t count,
                                               const float* split, std::uint32_t n,
                                               const score_sink& out, std::size_t i0) {
  alignas(32) float res[4 * 8];
  for (std::uint32_t half = lane0 / 8; half * 8 < lane0 + count; ++half) {
    const std::uint32_t lo = lane0 > half * 8 ? lane0 : half * 8;
    const std::uint32_t hi = lane0 + count < half * 8 + 8 ? lane0 + count : half * 8 + 8;
    for (std::uint32_t r0 = 0; r0 < n; r0 += 4) {
      const std::uint32_t rows = n - r0 < 4 ? n - r0 : 4;
      const float* s = split + std::size_t{r0} * 2 * d;
      switch (rows) {
        case 4:
          minmax_half_avx2<4>(tile, bias, d, half, s, res);
          break;
        case 3:
          minmax_half_avx2<3>(tile, bias, d, half, s, res);
          break;
        case 2:
          minmax_half_avx2<2>(tile, bias, d, half, s, res);
          break;
        default:
          minmax_half_avx2<1>(tile, bias, d, half, s, res);
          break;
      }
      out.put(res, 8, lo - half * 8, hi - lo, r0, rows, i0 + (lo - lane0));
    }
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // OASISKV_SCORE_X86

//! @brief Checks every id against `capacity` (`errc::out_of_range` naming `who`); returns
//! whether they are consecutive ascending, so that runs need no scanning.
inline bool check_entry_ids(std::span<const std::uint32_t> ids, std::uint32_t capacity,
                            const char* who) {
  if (ids.empty()) {
    return true;
  }
  const entry_id_stats st = entry_id_stats_of(ids);
  if (st.top >= capacity) [[unlikely]] {
    for (const std::uint32_t b : ids) {
      if (b >= capacity) {
        raise(errc::out_of_range, who, ": entry ", b, " >= capacity = ", capacity);
      }
    }
  }
  return st.steps + 1 == ids.size();
}

//! @brief The length of the run of consecutive ids from `ids[i]` within its tile of `lanes`.
inline std::uint32_t tile_run(std::span<const std::uint32_t> ids, std::size_t i, bool contiguous,
                              std::uint32_t lanes) noexcept {
  const std::uint32_t b = ids[i], room = lanes - b % lanes;
  if (contiguous) {
    return static_cast<std::uint32_t>(ids.size() - i < room ? ids.size() - i : room);
  }
  std::uint32_t m = 1;
  while (i + m < ids.size() && m < room && ids[i + m] == b + m) {
    ++m;
  }
  return m;
}

//! @brief Scores of the ids `[i, j)` that share tile `ids[i] / lanes` with `ids[i]`, picked from
//! the whole tile's scores `all[lane * n + r]`. For ids that are not consecutive: a layer's
//! decoded blocks take entries interleaved with the other layers' (and sequences'), so several
//! of its entries share a tile without forming a run.
inline void pick_lanes(const float* all, std::span<const std::uint32_t> ids, std::size_t i,
                       std::size_t j, std::uint32_t lanes, std::uint32_t n,
                       const score_sink& out) noexcept {
  for (std::size_t k = i; k < j; ++k) {
    const float* src = all + std::size_t{ids[k] % lanes} * n;
    for (std::uint32_t r = 0; r < n; ++r) {
      out.at(k, r) = src[r];
    }
  }
}

//! @brief Where the ids sharing the tile of `ids[i]` end, when they are more than the run of
//! consecutive ids from `ids[i]` (`run`); else 0.
inline std::size_t same_tile_end(std::span<const std::uint32_t> ids, std::size_t i,
                                 std::uint32_t run, std::uint32_t lanes) noexcept {
  const std::uint32_t t = ids[i] / lanes;
  std::size_t j = i + run;
  while (j < ids.size() && ids[j] / lanes == t) {
    ++j;
  }
  return j > i + run ? j : 0;
}

//! @brief `out.at(i, r)` = row `r` of `split` (`[n][q+ (d)][q- (d)]`) against entry `ids[i]`
//! of `tiles` (one KV head's tiles), plus the entry's `bias`. Consecutive ids within a tile are
//! scored as one run, so a sequence whose entries are consecutive reads each tile once; ids
//! that share a tile without being consecutive are scored with one pass over the whole tile
//! (a tile costs the same whether 1 or 16 of its lanes are wanted); only ids alone in their
//! tile cost a tile each. `contiguous`: the ids are consecutive ascending.
template <class S>
void minmax_score_tiles(score_isa isa, const S* tiles, const float* bias, std::uint32_t d,
                        std::span<const std::uint32_t> ids, bool contiguous, const float* split,
                        std::uint32_t n, const score_sink& out) {
  const std::size_t tile_elems = std::size_t{2} * d * minmax_tile_lanes;
  auto run = [&](const S* tile, const float* tb, std::uint32_t lane0, std::uint32_t m,
                 const score_sink& to, std::size_t i0) {
#if OASISKV_SCORE_X86
    if (isa == score_isa::avx512) {
      minmax_run_avx512(tile, tb, d, lane0, m, split, n, to, i0);
      return;
    }
    if (isa == score_isa::avx2) {
      minmax_run_avx2(tile, tb, d, lane0, m, split, n, to, i0);
      return;
    }
#endif
    minmax_lanes_scalar(tile, tb, d, lane0, m, split, n, to, i0);
  };
  thread_local std::vector<float> all;  // one whole tile's scores, [lane][row]
  std::size_t i = 0;
  while (i < ids.size()) {
    const std::uint32_t b = ids[i], lane0 = b % minmax_tile_lanes;
    const std::uint32_t m = tile_run(ids, i, contiguous, minmax_tile_lanes);
    const std::size_t t = b / minmax_tile_lanes;
    const S* tile = tiles + t * tile_elems;
    const float* tb = bias + t * minmax_tile_lanes;
    const std::size_t j = contiguous ? 0 : same_tile_end(ids, i, m, minmax_tile_lanes);
    if (j != 0) {
      all.resize(std::size_t{minmax_tile_lanes} * n);
      run(tile, tb, 0, minmax_tile_lanes, score_sink::entry_major(all.data(), n), 0);
      pick_lanes(all.data(), ids, i, j, minmax_tile_lanes, n, out);
      i = j;
      continue;
    }
    run(tile, tb, lane0, m, out, i);
    i += m;
  }
}

}  // namespace detail
}  // namespace oasiskv
