// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The machinery `lookahead_predictor` and `current_query_predictor` share: score every
//! block of a (sequence, layer) from its summary, fold the query rows with an aggregation and
//! keep the top blocks under the budget.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "oasiskv/concepts/block_summary.hpp"
#include "oasiskv/concepts/log_mass_summary.hpp"
#include "oasiskv/concepts/row_scoring_summary.hpp"
#include "oasiskv/concepts/score_aggregation.hpp"
#include "oasiskv/concepts/two_stage_summary.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/selection.hpp"
#include "oasiskv/cpu/loop_runner.hpp"
#include "oasiskv/cpu/top_k.hpp"
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
  //! a two-stage summary's time; with fewer heads than twice the pool's threads, a two-stage
  //! summary's heads are scored in ranges of blocks); null, or one thread, scores them in turn on
  //! the calling thread. The aggregation folds the heads in order either way, so the selection is
  //! the same. `pool` is a `cpu::thread_pool` or any `cpu::loop_runner` (an engine's threads lent
  //! for the call); it must outlive the predictor's use of it. `select` from inside one of a
  //! `cpu::thread_pool`'s loops runs inline.
  void set_thread_pool(cpu::loop_runner* pool) noexcept { pool_ = pool; }
  //! @brief The pool `set_thread_pool` gave, or null.
  cpu::loop_runner* thread_pool() const noexcept { return pool_; }

  void select(const prediction_input<Summary>& in, const selection_params& sp, selection& out) {
    selection* const one[1] = {&out};
    select_many(std::span<const prediction_input<Summary>>(&in, 1), sp,
                std::span<selection* const>(one));
  }

  //! @brief `select` for several (sequence, layer) inputs at once, `outs[i]` from `ins[i]`: the
  //! scoring of every (input, KV head) pair is one loop on the pool, so a batch of sequences
  //! keeps every thread busy where one sequence's few KV heads would leave some idle. Each
  //! selection equals what `select` gives for its input alone: the heads are folded in order,
  //! and the tables are chosen in input order (an adaptive budget's running average sees them
  //! as that many `select` calls). All inputs are checked before any is scored; on an error no
  //! output is changed. `ins` and `outs` have the same size; an output must not alias another.
  void select_many(std::span<const prediction_input<Summary>> ins, const selection_params& sp,
                   std::span<selection* const> outs) {
    if (ins.size() != outs.size()) [[unlikely]] {
      raise(errc::invalid_argument, "select_many: ", ins.size(), " inputs but ", outs.size(),
            " outputs");
    }
    for (std::size_t i = 0; i < ins.size(); ++i) {
      if (outs[i] == nullptr) [[unlikely]] {
        raise(errc::invalid_argument, "select_many: outs[", i, "] is null");
      }
      check_input(ins[i], sp);
    }
    const std::size_t n = ins.size();
    if (items_.size() < n) {
      items_.resize(n);
    }
    std::uint32_t kv_heads = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const kv_layout& l = ins[i].layout;
      const std::uint32_t blocks = l.blocks_for(ins[i].seq_len);
      const std::uint32_t tables = Granularity::per_kv_head ? l.num_kv_heads : 1;
      items_[i].acc.resize(std::size_t{tables} * blocks);
      kv_heads = std::max(kv_heads, l.num_kv_heads);
    }
    // A fixed budget that covers every block keeps them all whatever their scores
    // (`block_selector::append_table`): such an input is not scored.
    const auto covered = [&](std::size_t i) {
      return sp.target_mass == 0.0f && sp.budget_blocks >= ins[i].layout.blocks_for(ins[i].seq_len);
    };
    // Scratch per (input, KV head) when scored in parallel; one set per input otherwise.
    // (A single pair is parallel too where its blocks can be scored in ranges.)
    const bool parallel = pool_ != nullptr && pool_->size() > 1 &&
                          (n * kv_heads > 1 || split_two_stage_summary<Summary>);
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint32_t want = parallel ? ins[i].layout.num_kv_heads : 1;
      if (items_[i].heads.size() < want) {
        items_[i].heads.resize(want);
      }
    }
    const auto score = [&](std::size_t i, std::uint32_t h, head_scratch& hs) {
      const prediction_input<Summary>& in = ins[i];
      const std::uint32_t rows = in.queries.num_tokens * in.layout.group_size();
      gather_group_rows(in.layout, in.queries, h, hs.rows);
      score_head(*in.summaries, h, in.summary_ids, rows, scale_of(in.layout), sp.budget_blocks, hs);
    };
    const auto fold = [&](std::size_t i, std::uint32_t h, const head_scratch& hs) {
      const prediction_input<Summary>& in = ins[i];
      const std::uint32_t blocks = in.layout.blocks_for(in.seq_len);
      const aggregation_context ctx = context_of(in);
      const std::uint32_t t = Granularity::per_kv_head ? h : 0;
      items_[i].aggregation.combine(ctx, hs.raw.data(),
                                    items_[i].acc.data() + std::size_t{t} * blocks,
                                    Granularity::per_kv_head || h == 0);
    };
    if (parallel) {
      bool split = false;
      if constexpr (split_two_stage_summary<Summary>) {
        // Fewer (input, KV head) pairs than twice the threads would leave threads idle (a
        // SmolLM2 sequence's 3 KV heads on 2 threads take 2 rounds of one head): each head's
        // blocks are then scored in ranges instead.
        split = n * kv_heads < 2 * std::size_t{pool_->size()};
        if (split) {
          score_split(ins, sp, kv_heads, covered);
        }
      }
      // Item k is input k / kv_heads, head k % kv_heads (inputs with fewer heads skip the rest).
      if (!split) {
        pool_->parallel_for(n * kv_heads, [&](std::size_t k) {
          const std::size_t i = k / kv_heads;
          const auto h = static_cast<std::uint32_t>(k % kv_heads);
          if (h < ins[i].layout.num_kv_heads && !covered(i)) {
            score(i, h, items_[i].heads[h]);
          }
        });
      }
      // Each input's heads fold into its own accumulator, in head order.
      const auto fold_input = [&](std::size_t i) {
        for (std::uint32_t h = 0; h < ins[i].layout.num_kv_heads && !covered(i); ++h) {
          fold(i, h, items_[i].heads[h]);
        }
      };
      if (n > 1) {
        pool_->parallel_for(n, fold_input);
      } else {
        fold_input(0);
      }
    } else {
      for (std::size_t i = 0; i < n; ++i) {
        for (std::uint32_t h = 0; h < ins[i].layout.num_kv_heads && !covered(i); ++h) {
          score(i, h, items_[i].heads[0]);
          fold(i, h, items_[i].heads[0]);
        }
      }
    }
    for (std::size_t i = 0; i < n; ++i) {
      const kv_layout& l = ins[i].layout;
      const std::uint32_t blocks = l.blocks_for(ins[i].seq_len);
      const std::uint32_t tables = Granularity::per_kv_head ? l.num_kv_heads : 1;
      selection& out = *outs[i];
      out.tables = tables;
      out.blocks.clear();
      out.offsets.resize(tables + 1);
      out.offsets[0] = 0;
      for (std::uint32_t t = 0; t < tables; ++t) {
        // A mass aggregation's scores are masses; max_aggregation's are logits (adaptive budgets
        // take their softmax at the attention scale).
        selector_.append_table(items_[i].acc.data() + std::size_t{t} * blocks, blocks, sp,
                               out.blocks, mass_aggregation<Aggregation> ? 0.0f : scale_of(l));
        out.offsets[t + 1] = static_cast<std::uint32_t>(out.blocks.size());
      }
    }
  }

 private:
  static float scale_of(const kv_layout& l) noexcept {
    return 1.0f / std::sqrt(static_cast<float>(l.head_dim));
  }
  static aggregation_context context_of(const prediction_input<Summary>& in) noexcept {
    const std::uint32_t group = in.layout.group_size();
    return aggregation_context{in.layout.blocks_for(in.seq_len), in.queries.num_tokens * group,
                               group, scale_of(in.layout), in.queries.weights};
  }

  // Every check `select` makes of one input, before anything is scored.
  static void check_input(const prediction_input<Summary>& in, const selection_params& sp) {
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
    const std::uint32_t top = blocks == 0 ? 0 : cpu::detail::entry_id_stats_of(in.summary_ids).top;
    if (top >= capacity) [[unlikely]] {
      for (std::uint32_t i = 0; i < blocks; ++i) {
        if (in.summary_ids[i] >= capacity) {
          raise(errc::out_of_range, "prediction_input.summary_ids[", i, "] = ", in.summary_ids[i],
                " is beyond the summary's capacity = ", capacity);
        }
      }
    }
  }

  // KV head h's scores of every block into hs.raw, [rows][blocks] (the aggregations' layout).
  // `budget` (blocks kept per table) lets a two-stage summary score only its contenders.
  struct head_scratch {
    std::vector<float> rows;      // [tokens][group][head_dim] of one KV head
    std::vector<float> raw;       // [rows][blocks] of one KV head
    std::vector<float> by_entry;  // [blocks][rows]: `score`'s layout, for other summaries
    // score_split's: the contender count, the bounds [blocks], the pick, the fine scores
    // [contenders][rows].
    std::uint32_t contenders = 0;
    std::vector<float> bound, ranked, pool;
    std::vector<std::uint32_t> picked, ids;  // the contenders' indices and entry ids, ascending
    std::vector<float> fine;
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

  // `score_head` for a two-stage summary whose stages run apart, every (input, KV head) pair's
  // blocks spread over the pool in `segments` ranges: the bounds of each range, one top-k per
  // pair, the fine scores of each range of its contenders, then each pair's scatter. Equal to
  // `score_head` (the stages are functions of each entry alone, the top-k sees every bound).
  template <class Covered>
  void score_split(std::span<const prediction_input<Summary>> ins, const selection_params& sp,
                   std::uint32_t kv_heads,
                   const Covered& covered) requires split_two_stage_summary<Summary> {
    constexpr float inf = std::numeric_limits<float>::infinity();
    const std::size_t pairs = ins.size() * kv_heads;
    const std::size_t segments =
        std::max<std::size_t>(1, (2 * std::size_t{pool_->size()} + pairs - 1) / pairs);
    // One loop on the pool: fn(in, h, hs, m, rows, part) for every part in [0, parts) of every
    // live (input, KV head) pair; m is the input's blocks, rows its query rows per KV head.
    const auto each = [&](std::size_t parts, auto&& fn) {
      pool_->parallel_for(pairs * parts, [&](std::size_t k) {
        const std::size_t i = k / parts / kv_heads;
        const auto h = static_cast<std::uint32_t>(k / parts % kv_heads);
        const prediction_input<Summary>& in = ins[i];
        if (h < in.layout.num_kv_heads && !covered(i)) {
          fn(in, h, items_[i].heads[h], static_cast<std::uint32_t>(in.summary_ids.size()),
             in.queries.num_tokens * in.layout.group_size(), k % parts);
        }
      });
    };
    // Part `seg` of `count` items: [lo, hi).
    const auto range = [&](std::size_t seg, std::uint32_t count) {
      return std::pair{static_cast<std::uint32_t>(seg * count / segments),
                       static_cast<std::uint32_t>((seg + 1) * count / segments)};
    };
    const auto scale_for = [&](const prediction_input<Summary>& in) {
      return mass_aggregation<Aggregation> ? scale_of(in.layout) : 0.0f;
    };
    // 1: each pair's rows and sizes.
    each(1, [&](const prediction_input<Summary>& in, std::uint32_t h, head_scratch& hs,
                std::uint32_t m, std::uint32_t rows, std::size_t) {
      gather_group_rows(in.layout, in.queries, h, hs.rows);
      hs.contenders = m == 0 ? 0 : in.summaries->contenders(m, sp.budget_blocks);
      hs.raw.resize(std::size_t{m} * rows);
      hs.by_entry.resize(hs.raw.size());
      hs.bound.resize(hs.contenders < m ? m : 0);
    });
    // 2: the bounds of each range (or, with every entry a contender, its fine scores).
    each(segments, [&](const prediction_input<Summary>& in, std::uint32_t h, head_scratch& hs,
                       std::uint32_t m, std::uint32_t rows, std::size_t seg) {
      const auto [lo, hi] = range(seg, m);
      if (hi == lo || hs.contenders == 0) {
        return;
      }
      const auto ids = in.summary_ids.subspan(lo, hi - lo);
      if (hs.contenders >= m) {
        in.summaries->score_fine(h, ids, hs.rows.data(), rows, scale_for(in),
                                 hs.by_entry.data() + std::size_t{lo} * rows);
      } else {
        in.summaries->score_bounds(h, ids, hs.rows.data(), rows, hs.bound.data() + lo);
      }
    });
    // 3: each pair's contenders, the top bounds (ties to the earlier entry).
    each(1, [&](const prediction_input<Summary>& in, std::uint32_t, head_scratch& hs,
                std::uint32_t m, std::uint32_t rows, std::size_t) {
      if (hs.contenders == 0 || hs.contenders >= m) {
        return;
      }
      hs.picked.clear();
      cpu::detail::keep_top(isa_, hs.bound.data(), m, hs.contenders, 0, hs.ranked, hs.pool,
                            hs.picked);
      hs.ids.resize(hs.picked.size());
      for (std::size_t j = 0; j < hs.picked.size(); ++j) {
        hs.ids[j] = in.summary_ids[hs.picked[j]];
      }
      hs.fine.resize(std::size_t{hs.contenders} * rows);
    });
    // 4: the fine scores of each range of the contenders.
    each(segments, [&](const prediction_input<Summary>& in, std::uint32_t h, head_scratch& hs,
                       std::uint32_t m, std::uint32_t rows, std::size_t seg) {
      if (hs.contenders == 0 || hs.contenders >= m) {
        return;
      }
      const auto [lo, hi] = range(seg, hs.contenders);
      if (hi > lo) {
        in.summaries->score_fine(h, std::span<const std::uint32_t>(hs.ids).subspan(lo, hi - lo),
                                 hs.rows.data(), rows, scale_for(in),
                                 hs.fine.data() + std::size_t{lo} * rows);
      }
    });
    // 5: each pair's scores in place, [rows][blocks].
    each(1, [&](const prediction_input<Summary>&, std::uint32_t, head_scratch& hs, std::uint32_t m,
                std::uint32_t rows, std::size_t) {
      if (hs.contenders < m) {
        std::fill(hs.by_entry.begin(), hs.by_entry.end(), -inf);
        for (std::size_t j = 0; j < hs.picked.size() && hs.contenders > 0; ++j) {
          std::copy_n(hs.fine.data() + j * rows, rows,
                      hs.by_entry.data() + std::size_t{hs.picked[j]} * rows);
        }
      }
      transpose(m, rows, hs);
    });
  }

  static void transpose(std::size_t blocks, std::uint32_t rows, head_scratch& hs) {
    for (std::size_t i = 0; i < blocks; ++i) {
      for (std::uint32_t r = 0; r < rows; ++r) {
        hs.raw[r * blocks + i] = hs.by_entry[i * rows + r];
      }
    }
  }

  // One input's scratch in a `select_many` (the aggregation keeps scratch of its own, so each
  // input has one: the inputs are folded concurrently).
  struct item_scratch {
    std::vector<head_scratch> heads;  // one per KV head when scored in parallel, else one
    std::vector<float> acc;           // [tables][blocks]
    Aggregation aggregation{};
  };

  block_selector selector_;
  std::vector<item_scratch> items_;
  cpu_isa isa_ = resolve_isa(cpu_isa::best);  // score_split's top-k (every path keeps the same)
  cpu::loop_runner* pool_ = nullptr;
};

}  // namespace detail

}  // namespace oasiskv
