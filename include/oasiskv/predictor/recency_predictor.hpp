// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `recency_predictor`: the attention sinks and the most recent blocks (StreamingLLM).
#pragma once

#include <algorithm>
#include <cstdint>

#include "oasiskv/core/kept_window.hpp"
#include "oasiskv/core/selection.hpp"
#include "oasiskv/predictor/aggregation.hpp"
#include "oasiskv/predictor/block_selector.hpp"

namespace oasiskv {

//! @brief Keeps the first `sink_blocks` and fills the rest of the budget with the most recent
//! blocks. Reads no summary and no query.
//!
//! Its timing is `lookahead`: the selection depends only on the sequence length, which is known
//! a step early, so waiting for the query would only turn prefetches into on-demand fetches. The
//! queries are ignored and not checked. Every table of a per-KV-head selection is the same.
template <class Granularity = shared_selection>
class basic_recency_predictor {
 public:
  using summary_type = no_summary;
  using granularity_type = Granularity;
  static constexpr prediction_timing timing = prediction_timing::lookahead;

  void select(const prediction_input<no_summary>& in, const selection_params& sp, selection& out) {
    detail::check_prediction_basics(in.layout, in.seq_len, sp);
    const std::uint32_t blocks = in.layout.blocks_for(in.seq_len);
    const std::uint32_t tables = Granularity::per_kv_head ? in.layout.num_kv_heads : 1;
    const std::uint32_t sinks = kept_window(blocks, sp).sinks;
    const std::uint32_t total = std::min(sp.budget_blocks, blocks);
    out.tables = tables;
    out.blocks.clear();
    out.offsets.assign(tables + 1, 0);  // (resize trips a gcc 12 -O3 -Warray-bounds false positive)
    for (std::uint32_t t = 0; t < tables; ++t) {
      for (std::uint32_t i = 0; i < sinks; ++i) {
        out.blocks.push_back(i);
      }
      for (std::uint32_t i = std::max(sinks, blocks - (total - sinks)); i < blocks; ++i) {
        out.blocks.push_back(i);
      }
      out.offsets[t + 1] = static_cast<std::uint32_t>(out.blocks.size());
    }
  }
};

//! @brief The sink + recent-window predictor with one table per sequence.
using recency_predictor = basic_recency_predictor<shared_selection>;

}  // namespace oasiskv
