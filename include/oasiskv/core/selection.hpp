// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Vocabulary of prediction: the queries a predictor scores with, its budget, and the
//! selection it returns.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "oasiskv/core/layout.hpp"
#include "oasiskv/core/views.hpp"

namespace oasiskv {

//! @brief Queries of one sequence and layer: the lookahead (drafted) tokens' queries, or the
//! current token's.
struct query_view {
  const float* data = nullptr;     // [num_tokens][num_q_heads][head_dim]
  const float* weights = nullptr;  // [num_tokens] draft confidence of each token; null: all 1
  std::uint32_t num_tokens = 0;
};

//! @brief How many blocks a selection may hold and which it must always hold.
//!
//! With `target_mass == 0` every table takes `budget_blocks` (the fixed budget). With
//! `0 < target_mass <= 1` (an adaptive budget) a table takes the fewest blocks whose predicted
//! attention mass covers `target_mass` of the table's total, the kept blocks included, within a
//! ledger that keeps the mean per table at most `budget_blocks` (see `block_selector`); a table
//! never takes more than `max_blocks`. Predictors without per-block scores (recency, and the
//! device `topk_selector`) take the fixed budget.
struct selection_params {
  std::uint32_t budget_blocks = 0;  //!< total blocks per table, kept ones included
  std::uint32_t sink_blocks = 1;    //!< the first blocks (attention sinks), always kept
  std::uint32_t recent_blocks = 1;  //!< the last blocks (recent window, partial block), always kept
  //! 0: the fixed budget; in (0, 1]: the share of the predicted mass a table covers.
  float target_mass = 0.0f;
  //! The most blocks one table may take with an adaptive budget; 0 means `2 * budget_blocks`.
  //! At least `budget_blocks`.
  std::uint32_t max_blocks = 0;

  //! @brief The cap in effect: `max_blocks`, or `2 * budget_blocks` when it is 0.
  std::uint32_t block_cap() const noexcept {
    return max_blocks != 0 ? max_blocks : 2 * budget_blocks;
  }
};

//! @brief The blocks chosen for one (sequence, layer): one table shared by every KV head, or one
//! per KV head. Table `t` is `blocks[offsets[t] .. offsets[t+1])`, block indices ascending.
struct selection {
  std::uint32_t tables = 1;
  std::vector<std::uint32_t> blocks;
  std::vector<std::uint32_t> offsets{0, 0};

  std::span<const std::uint32_t> table(std::uint32_t t) const {
    return {blocks.data() + offsets[t], blocks.data() + offsets[t + 1]};
  }
};

//! @brief What a predictor may look at for one (sequence, layer), all of it known before the
//! step it predicts. `summary_ids[i]` is block `i`'s entry in `summaries`. `keys` and
//! `key_slots` give the exact keys (for exact scoring and the oracle); they may be empty.
template <class Summary>
struct prediction_input {
  kv_layout layout{};
  std::uint32_t seq_len = 0;
  const Summary* summaries = nullptr;
  std::span<const std::uint32_t> summary_ids{};
  query_view queries{};
  block_pool_view keys{};
  std::span<const slot_id> key_slots{};
};

//! @brief Summary type of predictors that need none (recency, oracle).
struct no_summary {};

//! @brief When a predictor's queries exist, and so when the cache calls it.
enum class prediction_timing : std::uint8_t {
  lookahead,     //!< from drafted tokens' queries, a step early: its selection is prefetched
  at_attention,  //!< from the true query at attention time (Quest): fetched on demand
};

}  // namespace oasiskv
