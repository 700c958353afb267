// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The dispatch of `minmax_summary`'s scoring: the entry-id checks and tile runs that
//! every tiled summary shares (`check_entry_ids`, `tile_run`, `pick_lanes`, `same_tile_end`) and
//! `minmax_score_tiles`, which calls the per-ISA kernels of `summary/cpu/minmax_*.hpp` (the tile
//! layout itself is `summary/cpu/minmax_layout.hpp`).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "oasiskv/core/error.hpp"
#include "oasiskv/core/isa.hpp"
#include "oasiskv/summary/cpu/minmax_avx2.hpp"
#include "oasiskv/summary/cpu/minmax_avx512.hpp"
#include "oasiskv/summary/cpu/minmax_layout.hpp"
#include "oasiskv/summary/cpu/minmax_scalar.hpp"
#include "oasiskv/summary/cpu/simd_math.hpp"

namespace oasiskv {
namespace detail {

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
