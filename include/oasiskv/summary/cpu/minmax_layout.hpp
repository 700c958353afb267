// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The tiled layout of `minmax_summary` that its scoring kernels share. Entries are
//! stored in tiles of 16, interleaved per dimension, so that one vector holds one dimension's
//! bound for 16 entries: scoring is then one broadcast multiply-add per (query row, dimension,
//! 16 entries) with no horizontal reduction. Of a dimension's two bounds a row needs one (the
//! maximum where its query is >= 0, the minimum where it is negative); the vector kernels visit
//! the dimensions grouped by which rows are negative (`minmax_row_plan`), so that choice is
//! fixed per group. Also the outward rounding of the stored bounds.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <span>
#include <type_traits>
#include <vector>

#include "oasiskv/core/dtype.hpp"

namespace oasiskv::cpu::detail {

//! @brief Entries per tile: one AVX-512 vector of f32 lanes.
inline constexpr std::uint32_t minmax_tile_lanes = 16;

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

}  // namespace oasiskv::cpu::detail
