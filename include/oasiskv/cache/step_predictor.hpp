// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cache::step_predictor`: runs a cache's predictor over one sequence or a batch, with
//! what it may read (the summaries, the exact keys where the capacity tier is addressable), and
//! times it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "oasiskv/cache/layer_blocks.hpp"
#include "oasiskv/cache/sequence_table.hpp"
#include "oasiskv/concepts/tier_backend.hpp"
#include "oasiskv/core/selection.hpp"

namespace oasiskv::cache {

//! @brief The predictor of a cache, fed from its summary entries (`Entries`, a
//! `summary_entry_store`) and capacity tier (`Slow`). Owns the predictor and the inputs'
//! scratch; calls come under the cache's lock. `seconds()` sums the time spent in the
//! predictor's `select`/`select_many`.
template <class Predictor, class Entries, class Slow>
class step_predictor {
 public:
  using predictor_type = Predictor;
  using summary_type = typename Predictor::summary_type;
  static constexpr bool has_summary = !std::is_same_v<summary_type, no_summary>;
  //! True for a predictor that scores a batch together (`select_many`).
  static constexpr bool batched =
      requires(Predictor & p, std::span<const prediction_input<summary_type>> in,
               const selection_params& sp, std::span<selection* const> out) {
    p.select_many(in, sp, out);
  };

  step_predictor(Predictor predictor, const Entries& entries, Slow& slow)
      : predictor_(std::move(predictor)), entries_(entries), slow_(slow) {}

  Predictor& predictor() noexcept { return predictor_; }
  const Predictor& predictor() const noexcept { return predictor_; }
  double seconds() const noexcept { return seconds_; }

  //! @brief Selects the blocks of one (sequence, layer) for `queries` into `out`.
  void select(const layer_blocks& ls, query_view queries, const selection_params& sp,
              selection& out) {
    const prediction_input<summary_type> in = input_for(ls, queries, ids_);
    const auto start = std::chrono::steady_clock::now();
    predictor_.select(in, sp, out);
    seconds_ += elapsed(start);
  }

  //! @brief The selection a step of `ls` reads: the one its lookahead left pending, else one
  //! made now from the step's own queries `q` into `scratch` (for a lookahead predictor, a step
  //! it did not predict, counted in `unpredicted`).
  selection& for_step(layer_state& ls, query_view q, const selection_params& sp, selection& scratch,
                      std::uint64_t& unpredicted) {
    if (Predictor::timing == prediction_timing::lookahead) {
      if (ls.pending) {
        return *ls.pending;
      }
      ++unpredicted;
    }
    select(ls, q, sp, scratch);
    return scratch;
  }

  //! @brief `select_many` for `layers` whose selections become their pending ones, all at
  //! once: should the predictor throw, no layer's pending selection changes.
  void select_ahead(std::span<layer_state* const> layers, const float* q, std::size_t stride,
                    std::uint32_t q_len, const selection_params& sp) {
    if (ahead_.size() < layers.size()) {
      ahead_.resize(layers.size());
    }
    ahead_layers_.assign(layers.begin(), layers.end());
    select_many(ahead_layers_, q, stride, q_len, sp, ahead_);
    for (std::size_t i = 0; i < layers.size(); ++i) {
      layers[i]->pending.emplace();
      std::swap(*layers[i]->pending, ahead_[i]);
    }
  }

  //! @brief Selects for each of `layers`: layer `i`'s queries are
  //! `q[i * stride .. + q_len rows]`, its selection goes to `out[i]`. A batched predictor scores
  //! every (sequence, KV head) pair in one loop; otherwise one `select` per layer, in order.
  void select_many(std::span<layer_blocks* const> layers, const float* q, std::size_t stride,
                   std::uint32_t q_len, const selection_params& sp, std::span<selection> out) {
    const std::size_t n = layers.size();
    if (batch_ids_.size() < n) {
      batch_ids_.resize(n);
    }
    const auto start = std::chrono::steady_clock::now();
    if constexpr (batched) {
      inputs_.clear();
      outs_.clear();
      for (std::size_t i = 0; i < n; ++i) {
        inputs_.push_back(
            input_for(*layers[i], query_view{q + i * stride, nullptr, q_len}, batch_ids_[i]));
        outs_.push_back(&out[i]);
      }
      predictor_.select_many(std::span<const prediction_input<summary_type>>(inputs_), sp,
                             std::span<selection* const>(outs_));
    } else {
      for (std::size_t i = 0; i < n; ++i) {
        predictor_.select(
            input_for(*layers[i], query_view{q + i * stride, nullptr, q_len}, batch_ids_[i]), sp,
            out[i]);
      }
    }
    seconds_ += elapsed(start);
  }

 private:
  static double elapsed(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  prediction_input<summary_type> input_for(const layer_blocks& ls, query_view queries,
                                           std::vector<std::uint32_t>& ids) const {
    prediction_input<summary_type> in;
    in.layout = slow_.layout();
    in.seq_len = ls.tokens;
    if constexpr (has_summary) {
      in.summaries = &entries_.summaries();
    }
    in.summary_ids = entries_.entries_of(ls.blocks, ids);
    in.queries = queries;
    if constexpr (addressable_tier<Slow>) {
      in.keys = slow_.view();
      in.key_slots = ls.blocks;
    }
    return in;
  }

  Predictor predictor_;
  const Entries& entries_;
  Slow& slow_;
  double seconds_ = 0.0;
  std::vector<std::uint32_t> ids_;                      // select's summary ids
  std::vector<std::vector<std::uint32_t>> batch_ids_;   // select_many's, one per layer
  std::vector<prediction_input<summary_type>> inputs_;  // select_many's inputs
  std::vector<selection*> outs_;                        // and outputs
  std::vector<selection> ahead_;                        // select_ahead's selections
  std::vector<layer_blocks*> ahead_layers_;             // and layers
};

}  // namespace oasiskv::cache
