// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The machinery `lookahead_predictor` and `current_query_predictor` share: score every
//! block of a (sequence, layer) from its summary, fold the query rows with an aggregation and
//! keep the top blocks under the budget.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "oasiskv/attention/cpu/thread_pool.hpp"
#include "oasiskv/concepts/block_summary.hpp"
#include "oasiskv/concepts/log_mass_summary.hpp"
#include "oasiskv/concepts/row_scoring_summary.hpp"
#include "oasiskv/concepts/score_aggregation.hpp"
#include "oasiskv/concepts/two_stage_summary.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/selection.hpp"
#include "oasiskv/predictor/aggregation.hpp"
#include "oasiskv/predictor/block_selector.hpp"

namespace oasiskv {
namespace detail {

//! @brief Scores the blocks of one (sequence, layer) from `Summary` against the query rows of
//! each KV head's GQA group, folds them with `Aggregation` and selects per `Granularity`. Owns
//! its scratch: steady-state `select` does not allocate (the summary's scratch is per thread).
template <block_summary Summary, score_aggregation Aggregation, selection_granularity Granularity>
class summary_scoring_predictor {
 public:
  using summary_type = Summary;
  using aggregation_type = Aggregation;
  using granularity_type = Granularity;

  //! @brief Scores the KV heads of each `select` in parallel on `pool` (their scoring is most of
  //! a two-stage summary's time); null, or a pool of one thread, scores them in turn on the
  //! calling thread. The aggregation folds the heads in order either way, so the selection is the
  //! same. The pool must outlive the predictor's use of it; `select` from inside one of the
  //! pool's loops runs inline (`cpu::thread_pool`).
  void set_thread_pool(cpu::thread_pool* pool) noexcept { pool_ = pool; }
  //! @brief The pool `set_thread_pool` gave, or null.
  cpu::thread_pool* thread_pool() const noexcept { return pool_; }

  void select(const prediction_input<Summary>& in, const selection_params& sp, selection& out) {
    const kv_layout& l = in.layout;
    check_prediction_basics(l, in.seq_len, sp);
    check_queries(in.queries);
    const std::uint32_t blocks = l.blocks_for(in.seq_len);
    if (in.summaries == nullptr) [[unlikely]] {
      raise(errc::invalid_argument, "prediction_input.summaries is null");
    }
    if (in.summary_ids.size() != blocks) [[unlikely]] {
      raise(errc::invalid_argument, "prediction_input.summary_ids.size() = ", in.summary_ids.size(),
            " but seq_len = ", in.seq_len, " needs ", blocks, " blocks");
    }
    const std::uint32_t capacity = in.summaries->capacity();
    // The largest id first (one vector pass); the offending index only on failure.
    const std::uint32_t top = blocks == 0 ? 0 : detail::entry_id_stats_of(in.summary_ids).top;
    if (top >= capacity) [[unlikely]] {
      for (std::uint32_t i = 0; i < blocks; ++i) {
        if (in.summary_ids[i] >= capacity) {
          raise(errc::out_of_range, "prediction_input.summary_ids[", i, "] = ", in.summary_ids[i],
                " is beyond the summary's capacity = ", capacity);
        }
      }
    }

    const std::uint32_t group = l.group_size();
    const std::uint32_t rows = in.queries.num_tokens * group;
    const std::uint32_t tables = Granularity::per_kv_head ? l.num_kv_heads : 1;
    acc_.resize(std::size_t{tables} * blocks);
    const aggregation_context ctx{
        blocks, rows, group, 1.0f / std::sqrt(static_cast<float>(l.head_dim)), in.queries.weights};
    const auto score = [&](std::uint32_t h, head_scratch& hs) {
      gather_group_rows(l, in.queries, h, hs.rows);
      score_head(*in.summaries, h, in.summary_ids, rows, ctx.scale, sp.budget_blocks, hs);
    };
    const auto fold = [&](std::uint32_t h, const head_scratch& hs) {
      const std::uint32_t t = Granularity::per_kv_head ? h : 0;
      aggregation_.combine(ctx, hs.raw.data(), acc_.data() + std::size_t{t} * blocks,
                           Granularity::per_kv_head || h == 0);
    };
    if (pool_ != nullptr && pool_->size() > 1 && l.num_kv_heads > 1) {
      heads_.resize(l.num_kv_heads);
      pool_->parallel_for(l.num_kv_heads,
                          [&](std::size_t h) { score(static_cast<std::uint32_t>(h), heads_[h]); });
      for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
        fold(h, heads_[h]);
      }
    } else {
      if (heads_.empty()) {
        heads_.resize(1);
      }
      for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
        score(h, heads_[0]);
        fold(h, heads_[0]);
      }
    }
    out.tables = tables;
    out.blocks.clear();
    out.offsets.resize(tables + 1);
    out.offsets[0] = 0;
    for (std::uint32_t t = 0; t < tables; ++t) {
      // A mass aggregation's scores are masses; max_aggregation's are logits (adaptive budgets
      // take their softmax at the attention scale).
      selector_.append_table(acc_.data() + std::size_t{t} * blocks, blocks, sp, out.blocks,
                             mass_aggregation<Aggregation> ? 0.0f : ctx.scale);
      out.offsets[t + 1] = static_cast<std::uint32_t>(out.blocks.size());
    }
  }

 private:
  // KV head h's scores of every block into hs.raw, [rows][blocks] (the aggregations' layout).
  // `budget` (blocks kept per table) lets a two-stage summary score only its contenders.
  struct head_scratch {
    std::vector<float> rows;      // [tokens][group][head_dim] of one KV head
    std::vector<float> raw;       // [rows][blocks] of one KV head
    std::vector<float> by_entry;  // [blocks][rows]: `score`'s layout, for other summaries
  };

  void score_head(const Summary& s, std::uint32_t h, std::span<const std::uint32_t> ids,
                  std::uint32_t rows, float scale, std::uint32_t budget, head_scratch& hs) {
    hs.raw.resize(ids.size() * rows);
    if constexpr (two_stage_summary<Summary>) {
      // A cheap bound rules blocks out (-inf: no mass); the fine scorer ranks the rest, in
      // log-mass units for a mass aggregation.
      hs.by_entry.resize(hs.raw.size());
      s.score_two_stage(h, ids, hs.rows.data(), rows, mass_aggregation<Aggregation> ? scale : 0.0f,
                        budget, hs.by_entry.data());
      transpose(ids.size(), rows, hs);
    } else if constexpr (mass_aggregation<Aggregation> && log_mass_summary<Summary>) {
      // The block's exact softmax mass (in the summary's domain) rather than its max.
      hs.by_entry.resize(hs.raw.size());
      s.score_log_mass(h, ids, hs.rows.data(), rows, scale, hs.by_entry.data());
      transpose(ids.size(), rows, hs);
    } else if constexpr (row_scoring_summary<Summary>) {
      s.score_rows(h, ids, hs.rows.data(), rows, hs.raw.data());
    } else {
      (void)budget;
      hs.by_entry.resize(hs.raw.size());
      s.score(h, ids, hs.rows.data(), rows, hs.by_entry.data());
      transpose(ids.size(), rows, hs);
    }
  }

  static void transpose(std::size_t blocks, std::uint32_t rows, head_scratch& hs) {
    for (std::size_t i = 0; i < blocks; ++i) {
      for (std::uint32_t r = 0; r < rows; ++r) {
        hs.raw[r * blocks + i] = hs.by_entry[i * rows + r];
      }
    }
  }

  Aggregation aggregation_{};
  block_selector selector_;
  std::vector<head_scratch> heads_;  // one per KV head when scored in parallel, else one
  std::vector<float> acc_;           // [tables][blocks]
  cpu::thread_pool* pool_ = nullptr;
};

}  // namespace detail

}  // namespace oasiskv
