// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The scoring kernels of `minmax_summary`. Entries are stored in tiles of 16,
//! interleaved per dimension, so that one vector holds one dimension's bound for 16 entries:
//! scoring is then one broadcast multiply-add per (query row, dimension, 16 entries) with no
//! horizontal reduction. Of a dimension's two bounds a row needs one (the maximum where its
//! query is >= 0, the minimum where it is negative); the vector kernels visit the dimensions
//! grouped by which rows are negative, so that choice is fixed per group, and the f16
//! conversions are shared by up to 4 rows.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <utility>
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
        for (std::uint32_t e = 0; e < 8; ++e) {  // the one nonzero term, as the vector paths
          acc[e] += qn[x + e] < 0.0f ? qn[x + e] * widen(tile[minmax_tile_at<S>(x + e, 1, j)])
                                     : qp[x + e] * widen(tile[minmax_tile_at<S>(x + e, 0, j)]);
        }
      }
      out.at(i0 + k, r) =
          (((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))) +
          bias[j];
    }
  }
}

//! @brief Rows per group of the vector kernels: a group's dimensions are split by sign pattern,
//! 2^4 of them at most.
inline constexpr std::uint32_t minmax_group_rows = 4;

//! @brief Up to 4 query rows prepared for the vector kernels. In q+ . max + q- . min one term is
//! zero for each (row, dimension): a row meets a dimension's minimum where its query is
//! negative, its maximum elsewhere. The group's dimensions are ordered by sign pattern (bit r:
//! row r is negative), so within a pattern every row's choice is fixed: one multiply-add per
//! (row, dimension) instead of two, and a dimension that every row meets on the same side
//! widens only that bound.
struct minmax_row_group {
  std::uint32_t rows = 0;                                   //!< 1..4
  std::uint32_t first = 0;                                  //!< the group's first row of `split`
  std::uint32_t begin[(1u << minmax_group_rows) + 1] = {};  //!< pattern p: [begin[p], begin[p+1])
  //! [d] where the i-th dimension (by pattern) starts in a tile: `minmax_tile_at(x, 0, 0)`
  const std::uint32_t* at = nullptr;
  const float* q = nullptr;  //!< [d][4] row r's query at the i-th dimension: q[i * 4 + r]
};

//! @brief The row groups of `split` (`[n][q+ (d)][q- (d)]`), as even as 4 rows per group allow.
class minmax_row_plan {
 public:
  std::span<const minmax_row_group> build(const float* split, std::uint32_t n, std::uint32_t d) {
    const std::uint32_t count = (n + minmax_group_rows - 1) / minmax_group_rows;
    groups_.resize(count);
    at_.resize(std::size_t{count} * d);
    q_.resize(std::size_t{count} * minmax_group_rows * d);
    pattern_.resize(d);
    std::uint32_t first = 0;
    for (std::uint32_t k = 0; k < count; ++k) {
      minmax_row_group& g = groups_[k];
      g.rows = n / count + (k < n % count ? 1 : 0);
      g.first = first;
      first += g.rows;
      std::uint32_t* at_dim = at_.data() + std::size_t{k} * d;
      float* q = q_.data() + std::size_t{k} * minmax_group_rows * d;
      std::uint32_t at[(1u << minmax_group_rows) + 1] = {};
      for (std::uint32_t x = 0; x < d; ++x) {
        std::uint32_t p = 0;
        for (std::uint32_t r = 0; r < g.rows; ++r) {
          p |= (split[(std::size_t{g.first + r} * 2 + 1) * d + x] < 0.0f ? 1u : 0u) << r;
        }
        pattern_[x] = static_cast<std::uint8_t>(p);
        ++at[p + 1];
      }
      for (std::uint32_t p = 0; p < (1u << minmax_group_rows); ++p) {
        at[p + 1] += at[p];
      }
      std::copy(std::begin(at), std::end(at), std::begin(g.begin));
      for (std::uint32_t x = 0; x < d; ++x) {
        const std::uint32_t i = at[pattern_[x]]++;
        at_dim[i] = x * 2 * minmax_tile_lanes;  // both layouts: a dimension is 32 elements
        for (std::uint32_t r = 0; r < minmax_group_rows; ++r) {  // rows past the group's: 0
          float v = 0.0f;
          if (r < g.rows) {
            const float* s = split + std::size_t{g.first + r} * 2 * d;
            v = s[x] + s[d + x];  // the nonzero one of q+, q-
          }
          q[std::size_t{i} * minmax_group_rows + r] = v;
        }
      }
      g.at = at_dim;
      g.q = q;
    }
    return groups_;
  }

 private:
  std::vector<minmax_row_group> groups_;
  std::vector<std::uint32_t> at_;
  std::vector<float> q_;
  std::vector<std::uint8_t> pattern_;
};

#if OASISKV_X86_KERNELS

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

// The maximum and minimum of one dimension of a tile (at `t`, its 16 entries), widened to f32.
OASISKV_TARGET_AVX512 inline void load_bounds16(const float* t, __m512& mx, __m512& mn) {
  mx = _mm512_loadu_ps(t);
  mn = _mm512_loadu_ps(t + 16);
}
OASISKV_TARGET_AVX512 inline void load_bounds16(const f16* t, __m512& mx, __m512& mn) {
  mx = load16(t);
  mn = load16(t + 16);
}
OASISKV_TARGET_AVX512 inline void load_bounds16(const bf16* t, __m512& mx, __m512& mn) {
  const __m512i w = _mm512_loadu_si512(t);
  mx = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, w, 16));
  mn = _mm512_castsi512_ps(
      _mm512_maskz_and_epi32(0xffff, w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// One bound of the dimension at element `at` of a tile (0 = max, 1 = min), widened to f32.
template <int Which>
OASISKV_TARGET_AVX512 inline __m512 load_bound16(const float* t) {
  return _mm512_loadu_ps(t + Which * 16);
}
template <int Which>
OASISKV_TARGET_AVX512 inline __m512 load_bound16(const f16* t) {
  return load16(t + Which * 16);
}
template <int Which>
OASISKV_TARGET_AVX512 inline __m512 load_bound16(const bf16* t) {
  __m512 mx, mn;
  load_bounds16(t, mx, mn);
  return Which == 0 ? mx : mn;
}

// Position i of a group's order, of sign pattern P (bit r set: row r of the group is negative
// there), into acc[K][row]. Every row meets the same bound of the dimension when P is 0 or all
// ones, so only that one is widened; a row takes one multiply-add (q+ . max + q- . min has one
// zero term). `pf` walks the next tile, a dimension per position: in a decode loop the
// summaries are evicted from L2 between calls, and this tile's order is not sequential.
template <int R, unsigned P, int K, class S>
[[gnu::always_inline]] OASISKV_TARGET_AVX512 inline void minmax_step_avx512(
    const S* tile, const minmax_row_group& g, std::uint32_t i, const S*& pf, __m512 (&acc)[2][R]) {
  constexpr unsigned all = (1u << R) - 1;
  _mm_prefetch(reinterpret_cast<const char*>(pf), _MM_HINT_T0);
  if constexpr (sizeof(S) == 4) {
    _mm_prefetch(reinterpret_cast<const char*>(pf + 16), _MM_HINT_T0);
  }
  pf += 2 * minmax_tile_lanes;
  const S* t = tile + g.at[i];
  __m512 mx = _mm512_setzero_ps(), mn = _mm512_setzero_ps();
  if constexpr (P == 0) {
    mx = load_bound16<0>(t);
  } else if constexpr (P == all) {
    mn = load_bound16<1>(t);
  } else {
    load_bounds16(t, mx, mn);
  }
  const float* q = g.q + std::size_t{i} * minmax_group_rows;
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    acc[K][r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r]), ((P >> r) & 1u) != 0 ? mn : mx, acc[K][r]);
  }
}

// The positions of sign pattern P, alternating between the two accumulator sets.
template <int R, unsigned P, class S>
[[gnu::always_inline]] OASISKV_TARGET_AVX512 inline void minmax_pattern_avx512(
    const S* tile, const minmax_row_group& g, const S*& pf, __m512 (&acc)[2][R]) {
  const std::uint32_t i1 = g.begin[P + 1];
  std::uint32_t i = g.begin[P];
  for (; i + 2 <= i1; i += 2) {
    minmax_step_avx512<R, P, 0>(tile, g, i, pf, acc);
    minmax_step_avx512<R, P, 1>(tile, g, i + 1, pf, acc);
  }
  if (i < i1) {
    minmax_step_avx512<R, P, 0>(tile, g, i, pf, acc);
  }
}

template <int R, class S, unsigned... P>
[[gnu::always_inline]] OASISKV_TARGET_AVX512 inline void minmax_patterns_avx512(
    const S* tile, const minmax_row_group& g, const S* pf, __m512 (&acc)[2][R],
    std::integer_sequence<unsigned, P...>) {
  (minmax_pattern_avx512<R, P>(tile, g, pf, acc), ...);
}

// The R rows of group `g` against the 16 entries of a tile: res[r * 16 + lane].
template <int R, class S>
OASISKV_TARGET_AVX512 inline void minmax_tile_avx512(const S* tile, const float* bias,
                                                     std::uint32_t d, const minmax_row_group& g,
                                                     float* res) {
  __m512 acc[2][R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    acc[0][r] = _mm512_setzero_ps();
    acc[1][r] = _mm512_setzero_ps();
  }
  minmax_patterns_avx512<R>(tile, g, tile + std::size_t{2} * d * minmax_tile_lanes, acc,
                            std::make_integer_sequence<unsigned, 1u << R>{});
  const __m512 bv = _mm512_loadu_ps(bias);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(res + 16 * r, _mm512_add_ps(_mm512_add_ps(acc[0][r], acc[1][r]), bv));
  }
}

// The rows of one run of `count` consecutive lanes of a tile, a row group at a time.
template <class S>
OASISKV_TARGET_AVX512 void minmax_run_avx512(const S* tile, const float* bias, std::uint32_t d,
                                             std::uint32_t lane0, std::uint32_t count,
                                             std::span<const minmax_row_group> groups,
                                             const score_sink& out, std::size_t i0) {
  alignas(64) float res[minmax_group_rows * 16];
  for (const minmax_row_group& g : groups) {
    switch (g.rows) {
      case 4:
        minmax_tile_avx512<4>(tile, bias, d, g, res);
        break;
      case 3:
        minmax_tile_avx512<3>(tile, bias, d, g, res);
        break;
      case 2:
        minmax_tile_avx512<2>(tile, bias, d, g, res);
        break;
      default:
        minmax_tile_avx512<1>(tile, bias, d, g, res);
        break;
    }
    out.put(res, 16, lane0, count, g.first, g.rows, i0);
  }
}

// The maximum and minimum of lanes [8 * half, 8 * half + 8) of one dimension of a tile (at `t`).
OASISKV_TARGET_AVX2 inline void load_bounds8(const float* t, std::uint32_t half, __m256& mx,
                                             __m256& mn) {
  mx = _mm256_loadu_ps(t + half * 8);
  mn = _mm256_loadu_ps(t + 16 + half * 8);
}
OASISKV_TARGET_AVX2 inline void load_bounds8(const f16* t, std::uint32_t half, __m256& mx,
                                             __m256& mn) {
  mx = load8(t + half * 8);
  mn = load8(t + 16 + half * 8);
}
OASISKV_TARGET_AVX2 inline void load_bounds8(const bf16* t, std::uint32_t half, __m256& mx,
                                             __m256& mn) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + half * 16));
  mx = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  mn = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// One bound (0 = max, 1 = min) of lanes [8 * half, 8 * half + 8) of the dimension at `t`.
template <int Which, class S>
OASISKV_TARGET_AVX2 inline __m256 load_bound8(const S* t, std::uint32_t half) {
  if constexpr (std::is_same_v<S, bf16>) {
    __m256 mx, mn;
    load_bounds8(t, half, mx, mn);
    return Which == 0 ? mx : mn;
  } else {
    return load8(t + Which * 16 + half * 8);
  }
}

// The AVX2 form of minmax_pattern_avx512: both halves of the tile, acc[half][row].
template <int R, unsigned P, class S>
[[gnu::always_inline]] OASISKV_TARGET_AVX2 inline void minmax_pattern_avx2(
    const S* tile, const minmax_row_group& g, __m256 (&acc)[2][R]) {
  constexpr unsigned all = (1u << R) - 1;
  const std::uint32_t i1 = g.begin[P + 1];
  for (std::uint32_t i = g.begin[P]; i < i1; ++i) {
    const S* t = tile + g.at[i];
    __m256 mx[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256 mn[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
#pragma GCC unroll 2
    for (std::uint32_t h = 0; h < 2; ++h) {
      if constexpr (P == 0) {
        mx[h] = load_bound8<0>(t, h);
      } else if constexpr (P == all) {
        mn[h] = load_bound8<1>(t, h);
      } else {
        load_bounds8(t, h, mx[h], mn[h]);
      }
    }
    const float* q = g.q + std::size_t{i} * minmax_group_rows;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 qv = _mm256_set1_ps(q[r]);
      const bool neg = ((P >> r) & 1u) != 0;
      acc[0][r] = _mm256_fmadd_ps(qv, neg ? mn[0] : mx[0], acc[0][r]);
      acc[1][r] = _mm256_fmadd_ps(qv, neg ? mn[1] : mx[1], acc[1][r]);
    }
  }
}

template <int R, class S, unsigned... P>
[[gnu::always_inline]] OASISKV_TARGET_AVX2 inline void minmax_patterns_avx2(
    const S* tile, const minmax_row_group& g, __m256 (&acc)[2][R],
    std::integer_sequence<unsigned, P...>) {
  (minmax_pattern_avx2<R, P>(tile, g, acc), ...);
}

// The R rows of group `g` against the 16 entries of a tile: res[r * 16 + lane].
template <int R, class S>
OASISKV_TARGET_AVX2 inline void minmax_tile_avx2(const S* tile, const float* bias,
                                                 const minmax_row_group& g, float* res) {
  __m256 acc[2][R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    acc[0][r] = _mm256_setzero_ps();
    acc[1][r] = _mm256_setzero_ps();
  }
  minmax_patterns_avx2<R>(tile, g, acc, std::make_integer_sequence<unsigned, 1u << R>{});
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(res + 16 * r, _mm256_add_ps(acc[0][r], _mm256_loadu_ps(bias)));
    _mm256_storeu_ps(res + 16 * r + 8, _mm256_add_ps(acc[1][r], _mm256_loadu_ps(bias + 8)));
  }
}

template <class S>
OASISKV_TARGET_AVX2 void minmax_run_avx2(const S* tile, const float* bias, std::uint32_t lane0,
                                         std::uint32_t count,
                                         std::span<const minmax_row_group> groups,
                                         const score_sink& out, std::size_t i0) {
  alignas(32) float res[minmax_group_rows * 16];
  for (const minmax_row_group& g : groups) {
    switch (g.rows) {
      case 4:
        minmax_tile_avx2<4>(tile, bias, g, res);
        break;
      case 3:
        minmax_tile_avx2<3>(tile, bias, g, res);
        break;
      case 2:
        minmax_tile_avx2<2>(tile, bias, g, res);
        break;
      default:
        minmax_tile_avx2<1>(tile, bias, g, res);
        break;
    }
    out.put(res, 16, lane0, count, g.first, g.rows, i0);
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // OASISKV_X86_KERNELS

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
void minmax_score_tiles(cpu_isa isa, const S* tiles, const float* bias, std::uint32_t d,
                        std::span<const std::uint32_t> ids, bool contiguous, const float* split,
                        std::uint32_t n, const score_sink& out) {
  const std::size_t tile_elems = std::size_t{2} * d * minmax_tile_lanes;
  thread_local minmax_row_plan plan;
  std::span<const minmax_row_group> groups;
  if (isa != cpu_isa::scalar) {
    groups = plan.build(split, n, d);
  }
  auto run = [&](const S* tile, const float* tb, std::uint32_t lane0, std::uint32_t m,
                 const score_sink& to, std::size_t i0) {
#if OASISKV_X86_KERNELS
    if (isa == cpu_isa::avx512) {
      minmax_run_avx512(tile, tb, d, lane0, m, groups, to, i0);
      return;
    }
    if (isa == cpu_isa::avx2) {
      minmax_run_avx2(tile, tb, lane0, m, groups, to, i0);
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
