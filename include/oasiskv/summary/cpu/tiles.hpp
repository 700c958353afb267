// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief What the tiled summary kernels share (`minmax`, `qminmax`, `int2_codes`, `qkey`):
//! `score_sink`, where a kernel writes its scores, and the runs of entry ids within tiles that
//! the summaries and dispatchers walk (`check_entry_ids`, `tile_run`, `pick_lanes`,
//! `same_tile_end`).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "oasiskv/core/error.hpp"
#include "oasiskv/cpu/math.hpp"

namespace oasiskv::cpu::detail {

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
        oasiskv::detail::raise(errc::out_of_range, who, ": entry ", b, " >= capacity = ", capacity);
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

}  // namespace oasiskv::cpu::detail
