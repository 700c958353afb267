// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The `importance_predictor` concept.
#pragma once

#include <concepts>

#include "oasiskv/concepts/block_summary.hpp"
#include "oasiskv/core/selection.hpp"

namespace oasiskv {

//! @brief The summary type a predictor names: a `block_summary` or `no_summary`.
template <class S>
concept predictor_summary = block_summary<S> || std::same_as<S, no_summary>;

//! @brief Scores the blocks of one (sequence, layer) and selects those the next step should find
//! staged.
//!
//! Required, for `p` a `P&`, `in` a `const prediction_input<typename P::summary_type>&`,
//! `sp` a `const selection_params&` and `out` a `selection&`:
//! - `typename P::summary_type`: a `block_summary`, or `no_summary` for predictors that read none.
//! - `P::timing` -> `prediction_timing`: whether its queries are lookahead queries (a step early)
//!   or the true query at attention time.
//! - `p.select(in, sp, out)`: writes to `out` at most `sp.budget_blocks` blocks per table, block
//!   indices ascending, always including the first `sp.sink_blocks`, the last `sp.recent_blocks`
//!   and the partial last block; the rest are the highest-scoring blocks (ties to the lower index).
//!   A budget below `sink_blocks + recent_blocks`, or queries whose shape does not match
//!   `in.layout`, throw `oasiskv::error`. O(blocks x (scoring cost)) plus O(blocks) for the top-k
//!   (a selection, not a sort). With `sp.target_mass > 0` (an adaptive budget) a predictor
//!   with per-block scores may take fewer or more blocks per table, at most `sp.block_cap()`,
//!   and at most `budget_blocks` per table on average over its calls (`block_selector`).
template <class P>
concept importance_predictor = predictor_summary<typename P::summary_type> &&
    std::convertible_to<decltype(P::timing), prediction_timing> &&
    requires(P& p, const prediction_input<typename P::summary_type>& in, const selection_params& sp,
             selection& out) {
  { p.select(in, sp, out) } -> std::same_as<void>;
};

}  // namespace oasiskv
