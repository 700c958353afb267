// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The host half of `cuda::flashinfer_decode`: its split-KV plan (which requests
//! FlashInfer's decode kernel splits into how many chunks), the layout of the page lists it
//! uploads, and the device buffers a plan needs. Host code only, with no FlashInfer header, so that
//! the plan and its buffers are tested where neither a GPU nor FlashInfer is.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace oasiskv::cuda::detail {

//! @brief How FlashInfer's batch decode kernel covers the requests: one CTA column per *tile*
//! (`request[t]`, chunk `tile[t]` of it). Unsplit, tile t is request t whole. Split, a request of
//! `p` pages has `ceil(max(p, 1) / chunk_pages)` tiles, whose partial outputs and log-sum-exps go
//! to a workspace (`flashinfer_split_workspace`) and are merged into row `r` by
//! `VariableLengthMergeStates` over tiles `[o_indptr[r], o_indptr[r + 1])`.
struct flashinfer_split_plan {
  bool split = false;
  std::uint32_t chunk_pages = 0;       //!< pages per tile when split (else unused)
  std::vector<std::int32_t> request;   //!< [tiles] the request of each CTA column
  std::vector<std::int32_t> tile;      //!< [tiles] its chunk within the request
  std::vector<std::int32_t> o_indptr;  //!< [requests + 1] each request's first tile
  //! @brief CTA columns of the decode kernel (its `padded_batch_size`).
  std::uint32_t tiles() const noexcept { return static_cast<std::uint32_t>(request.size()); }
};

//! @brief FlashInfer 0.7.4's decode planner without CUDA graphs, restated
//! (`BatchDecodeWithPagedKVCacheWorkEstimationDispatched`, then `DecodeSplitKVIndptr`).
//! `max_grid`: CTAs of its decode kernel resident at once (blocks per SM x SMs, from its own
//! occupancy query); `indptr`: `[requests + 1]` page offsets. When the requests x KV heads fill
//! the grid there is no split; otherwise the least chunk (at least `max(128 / page_size, 1)`
//! pages) whose tiles x KV heads fit the grid, and a split only when some request then has more
//! than one tile. `allow_split == false` (`flashinfer_split::never`) plans one tile per request.
inline flashinfer_split_plan plan_flashinfer_split(std::uint32_t max_grid,
                                                   std::uint32_t num_kv_heads,
                                                   std::span<const std::int32_t> indptr,
                                                   std::uint32_t page_size, bool allow_split) {
  const std::size_t requests = indptr.empty() ? 0 : indptr.size() - 1;
  auto pages = [&](std::size_t r) {
    const std::int32_t n = indptr[r + 1] - indptr[r];
    return n > 0 ? static_cast<std::uint64_t>(n) : std::uint64_t{0};
  };
  auto ceil_div = [](std::uint64_t a, std::uint64_t b) {
    return (a + b - 1) / b;
  };
  flashinfer_split_plan sp;
  std::uint64_t chunk = 0;
  if (allow_split && std::uint64_t{requests} * num_kv_heads < max_grid) {
    std::uint64_t low = std::max<std::uint64_t>(128 / std::max<std::uint32_t>(page_size, 1), 1);
    std::uint64_t high = 0;
    for (std::size_t r = 0; r < requests; ++r) {
      high = std::max(high, pages(r));
    }
    while (low < high) {  // the least chunk whose tiles fit the grid
      const std::uint64_t mid = (low + high) / 2;
      std::uint64_t tiles = 0;
      for (std::size_t r = 0; r < requests; ++r) {
        tiles += ceil_div(pages(r), mid);
      }
      if (tiles * num_kv_heads > max_grid) {
        low = mid + 1;
      } else {
        high = mid;
      }
    }
    std::uint64_t tiles = 0;
    for (std::size_t r = 0; r < requests; ++r) {
      tiles += ceil_div(std::max<std::uint64_t>(pages(r), 1), low);
    }
    if (tiles != requests) {  // FlashInfer splits only when a request has several tiles
      chunk = low;
    }
  }
  sp.o_indptr.push_back(0);
  for (std::size_t r = 0; r < requests; ++r) {
    const std::uint64_t n = chunk == 0 ? 1 : ceil_div(std::max<std::uint64_t>(pages(r), 1), chunk);
    for (std::uint64_t t = 0; t < n; ++t) {
      sp.request.push_back(static_cast<std::int32_t>(r));
      sp.tile.push_back(static_cast<std::int32_t>(t));
    }
    sp.o_indptr.push_back(static_cast<std::int32_t>(sp.request.size()));
  }
  sp.split = chunk != 0;
  sp.chunk_pages = static_cast<std::uint32_t>(chunk);
  return sp;
}

//! @brief The device workspace of a split plan: FlashInfer's kernel writes each tile's partial
//! output (`tiles x num_q_heads x head_dim`, in the output type, sized as FlashInfer's planner
//! sizes it: in floats) and partial log-sum-exp (`tiles x num_q_heads` floats, from
//! `lse_offset`), which the merge reads. Unsplit, nothing (`bytes == 0`): the kernel then writes
//! the output rows directly, and FlashInfer takes a null partial output as "not split".
struct flashinfer_split_workspace {
  std::size_t lse_offset = 0;  //!< bytes from the start to the partial log-sum-exps
  std::size_t bytes = 0;       //!< the whole workspace; 0 unsplit
};

//! @brief The workspace `plan` needs for `num_q_heads` query heads of `head_dim`.
inline flashinfer_split_workspace split_workspace(const flashinfer_split_plan& plan,
                                                  std::uint32_t num_q_heads,
                                                  std::uint32_t head_dim) {
  flashinfer_split_workspace w;
  if (!plan.split) {
    return w;
  }
  const std::size_t rows = std::size_t{plan.tiles()} * num_q_heads;
  w.lse_offset = (rows * head_dim * sizeof(float) + 15) / 16 * 16;
  w.bytes = w.lse_offset + (rows * sizeof(float) + 15) / 16 * 16;
  return w;
}

//! @brief Where the arrays of `cuda::flashinfer_decode`'s uploaded page lists lie, in int32
//! elements from the start of one buffer (each 16-byte aligned).
struct flashinfer_list_layout {
  std::size_t indices = 0;                 //!< [pages] the pages of every request, in request order
  std::size_t indptr = 0;                  //!< [requests + 1]
  std::size_t last_page_len = 0;           //!< [requests]
  std::size_t request = 0;                 //!< [tiles] `flashinfer_split_plan::request`
  std::size_t tile = 0;                    //!< [tiles] `flashinfer_split_plan::tile`
  std::size_t o_indptr = 0;                //!< [requests + 1] `flashinfer_split_plan::o_indptr`
  std::size_t chunk = 0;                   //!< [1] tokens per tile when split
  std::size_t total = 0;                   //!< elements in all
  std::uint32_t tiles = 0;                 //!< CTA columns per KV head
  bool split = false;                      //!< the plan splits: the workspace is needed
  flashinfer_split_workspace workspace{};  //!< what a split needs besides the lists
};

//! @brief The layout of the page lists for `pages` pages, `requests` requests and `plan`.
inline flashinfer_list_layout make_list_layout(std::size_t pages, std::size_t requests,
                                               const flashinfer_split_plan& plan,
                                               std::uint32_t num_q_heads, std::uint32_t head_dim) {
  auto round4 = [](std::size_t n) {
    return (n + 3) / 4 * 4;
  };  // 16-byte aligned arrays
  flashinfer_list_layout at;
  at.tiles = plan.tiles();
  at.split = plan.split;
  at.indices = 0;
  at.indptr = round4(pages);
  at.last_page_len = at.indptr + round4(requests + 1);
  at.request = at.last_page_len + round4(requests);
  at.tile = at.request + round4(at.tiles);
  at.o_indptr = at.tile + round4(at.tiles);
  at.chunk = at.o_indptr + round4(requests + 1);
  at.total = at.chunk + 4;
  at.workspace = split_workspace(plan, num_q_heads, head_dim);
  return at;
}

}  // namespace oasiskv::cuda::detail
