// SPDX-License-Identifier: Apache-2.0
//! Predictors defined outside the library, as an engine would write them: they exercise the
//! facade through the `importance_predictor` concept alone.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/selection.hpp"

namespace oasiskv::testing {

//! Every block of the sequence (dense attention through the sparse path).
struct select_all_predictor {
  using summary_type = no_summary;
  static constexpr prediction_timing timing = prediction_timing::lookahead;
  void select(const prediction_input<no_summary>& in, const selection_params&, selection& out) {
    const std::uint32_t n = in.layout.blocks_for(in.seq_len);
    out.tables = 1;
    out.blocks.resize(n);
    std::iota(out.blocks.begin(), out.blocks.end(), 0u);
    out.offsets = {0, n};
  }
};

//! The blocks with the highest exact max q.k over the group's heads and the lookahead tokens,
//! plus sinks and the recent window; reads the exact keys (`in.keys`).
struct exact_max_predictor {
  using summary_type = no_summary;
  static constexpr prediction_timing timing = prediction_timing::lookahead;
  void select(const prediction_input<no_summary>& in, const selection_params& sp, selection& out) {
    const kv_layout& l = in.layout;
    const std::uint32_t n = l.blocks_for(in.seq_len);
    if (sp.budget_blocks < sp.sink_blocks + sp.recent_blocks) {
      detail::raise(errc::invalid_argument, "exact_max_predictor: budget too small");
    }
    std::vector<float> score(n, 0.0f);
    visit_dtype(l.kv_dtype, [&](auto e) {
      using T = decltype(e);
      for (std::uint32_t b = 0; b < n; ++b) {
        float best = -1e30f;
        const std::uint32_t fill =
            std::min(l.tokens_per_block, in.seq_len - b * l.tokens_per_block);
        for (std::uint32_t h = 0; h < l.num_q_heads; ++h) {
          const T* k = in.keys.template keys<T>(in.key_slots[b], h / l.group_size());
          for (std::uint32_t j = 0; j < in.queries.num_tokens; ++j) {
            const float* q = in.queries.data + (std::size_t{j} * l.num_q_heads + h) * l.head_dim;
            for (std::uint32_t t = 0; t < fill; ++t) {
              float dot = 0.0f;
              for (std::uint32_t x = 0; x < l.head_dim; ++x) {
                dot += q[x] * to_float(k[t * l.head_dim + x]);
              }
              best = std::max(best, dot);
            }
          }
        }
        score[b] = best;
      }
    });
    std::vector<std::uint32_t> order(n);
    std::iota(order.begin(), order.end(), 0u);
    for (std::uint32_t b = 0; b < n; ++b) {
      if (b < sp.sink_blocks || b + sp.recent_blocks >= n) {
        score[b] = 1e30f;
      }
    }
    const std::uint32_t k = std::min(n, sp.budget_blocks);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](auto a, auto b) {
      return score[a] > score[b] || (score[a] == score[b] && a < b);
    });
    out.tables = 1;
    out.blocks.assign(order.begin(), order.begin() + k);
    std::sort(out.blocks.begin(), out.blocks.end());
    out.offsets = {0, k};
  }
};

}  // namespace oasiskv::testing
