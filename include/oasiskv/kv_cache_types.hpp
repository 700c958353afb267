// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Options, statistics and reports of `tiered_kv_cache`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "oasiskv/concepts/prefetch_scheduler.hpp"

namespace oasiskv {

//! @brief How a `tiered_kv_cache` selects and stages blocks.
struct cache_options {
  std::uint32_t budget_tokens = 2048;  //!< tokens one (sequence, layer) attends to per step
  std::uint32_t sink_blocks = 1;       //!< first blocks, always attended (attention sinks)
  std::uint32_t recent_blocks = 1;     //!< last blocks, always attended (incl. the partial one)
  //! Evictions one lookahead may make (the damage one bad prediction can do).
  std::uint32_t max_evictions_per_step = std::numeric_limits<std::uint32_t>::max();
  std::uint64_t max_tokens_per_sequence = std::uint64_t{1} << 20;
  float scale = 0.0f;  //!< softmax scale; 0 means 1 / sqrt(head_dim)
  //! Adaptive budget (`selection_params::target_mass`): 0, every table takes `budget_tokens`;
  //! in (0, 1], each table takes the fewest blocks covering that share of the predicted
  //! attention mass, `budget_tokens` per table on average over the predictor's calls.
  float target_mass = 0.0f;
  //! With an adaptive budget, the most blocks one table may take; 0 means
  //! `min(2 * budget blocks, fast-tier slots - 1)`. At least the budget's blocks, and one below
  //! the fast tier's slots.
  std::uint32_t max_selected_blocks = 0;
};

//! @brief Totals since construction. `step` sums every `acquire`: hits and misses of the blocks
//! attention needed, and what the misses cost.
struct cache_stats {
  std::uint64_t sequence_steps = 0;   //!< (sequence, layer) attention steps
  std::uint64_t lookaheads = 0;       //!< lookahead calls that predicted
  std::uint64_t unpredicted = 0;      //!< steps that found no lookahead and predicted late
  std::uint64_t selected_blocks = 0;  //!< blocks attended over all steps and tables
  //! Time in the predictor's `select`: every block scored from its summary, and the top-k
  //! (by `lookahead`, and by `attend` when it predicts at attention time).
  double predict_seconds = 0.0;
  acquire_stats step{};
  std::uint64_t bytes_prefetched = 0;
  std::uint64_t bytes_evicted = 0;
  std::uint64_t blocks_evicted = 0;
  std::uint64_t failed_transfers = 0;
  std::size_t resident_blocks = 0;  //!< staged or in flight now

  //! @brief These counts with a scheduler's transfer totals and residency (`scheduler_stats`).
  template <class SchedulerStats>
  cache_stats& add_transfers(const SchedulerStats& ss, std::size_t resident) noexcept {
    bytes_prefetched = ss.bytes_prefetched;
    bytes_evicted = ss.bytes_evicted;
    blocks_evicted = ss.blocks_evicted;
    failed_transfers = ss.failed_transfers;
    resident_blocks = resident;
    return *this;
  }

  double hit_rate() const noexcept {
    const double total = static_cast<double>(step.hits) + step.misses;
    return total == 0 ? 1.0 : step.hits / total;
  }
};

//! @brief The blocks one `attend` call read, when the caller asks for them: for the i-th
//! sequence of the call and its table t (one table per sequence, or one per KV head with a
//! per-head granularity), the block indices (positions in the sequence's block order, not
//! slots) in the order the kernel read them. For tests that recompute attention independently,
//! and for engines that log their selections.
struct attended_blocks {
  std::vector<std::uint32_t> blocks;
  std::vector<std::uint32_t> offsets;  //!< `sequences * tables_per_seq + 1` entries
  std::uint32_t tables_per_seq = 0;

  std::size_t sequences() const noexcept {
    return tables_per_seq == 0 ? 0 : (offsets.size() - 1) / tables_per_seq;
  }
  std::span<const std::uint32_t> table(std::size_t seq, std::uint32_t t = 0) const {
    const std::size_t i = seq * tables_per_seq + t;
    return {blocks.data() + offsets.at(i), blocks.data() + offsets.at(i + 1)};
  }
};

//! @brief Sequences of one length that a fast-memory budget admits.
struct admission_report {
  std::uint64_t dense_bytes_per_sequence = 0;  //!< every block of every layer resident
  std::uint64_t oasis_bytes_per_sequence = 0;  //!< staged selections + summaries
  std::uint64_t dense_sequences = 0;
  std::uint64_t oasis_sequences = 0;
};

}  // namespace oasiskv
