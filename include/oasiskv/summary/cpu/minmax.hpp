// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The dispatcher of `minmax_summary`'s scoring kernels: `minmax_score_tiles` walks the
//! entries' tiles and calls the kernel of the resolved path (`minmax_scalar.hpp`,
//! `minmax_avx2.hpp`, `minmax_avx512.hpp`; the tile layout is `minmax_layout.hpp`).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/summary/cpu/minmax_avx2.hpp"
#include "oasiskv/summary/cpu/minmax_avx512.hpp"
#include "oasiskv/summary/cpu/minmax_layout.hpp"
#include "oasiskv/summary/cpu/minmax_scalar.hpp"
#include "oasiskv/summary/cpu/tiles.hpp"

namespace oasiskv::cpu::detail {

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
    if (isa_includes(isa, cpu_isa::avx512)) {
      minmax_run_avx512(tile, tb, d, lane0, m, groups, to, i0);
      return;
    }
    if (isa_includes(isa, cpu_isa::avx2)) {
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

}  // namespace oasiskv::cpu::detail
