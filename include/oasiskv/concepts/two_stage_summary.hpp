// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The `two_stage_summary` concept: a `block_summary` that scores a budget's contenders
//! with a finer scorer after ruling the other blocks out with a cheap bound.
#pragma once

#include <concepts>
#include <cstdint>
#include <span>

#include "oasiskv/concepts/block_summary.hpp"

namespace oasiskv {

//! @brief A `block_summary` whose scoring can use the predictor's budget: a cheap pass over
//! every block keeps the contenders for it, and only those are scored finely.
//!
//! Additional expression, with the names of `block_summary` and `log_mass_summary`, `scale` a
//! `float` and `keep_blocks` a `std::uint32_t` (the blocks the predictor will keep per table,
//! `selection_params::budget_blocks`):
//! - `cs.score_two_stage(h, entries, q, n, scale, keep_blocks, out)`: writes `out[i * n + r]`
//!   (the layout of `score`) for every `entries[i]`: the summary's fine estimate for the entries
//!   it keeps as contenders for `keep_blocks` blocks, `-inf` (no mass, never selected before a
//!   scored block) for the others. `scale == 0` asks for the units of `score` (a max of dot
//!   products); `scale > 0` for those of `score_log_mass` at that logit scale, where the fine
//!   scorer provides them (else `score`'s). Which and how many entries are contenders is the
//!   model's business; with every entry a contender the result is its fine scorer's alone.
//!   Out-of-range entries or heads, or a negative or non-finite `scale`, throw `oasiskv::error`.
//!   Concurrent calls are safe. O(entries x n x head_dim) for the cheap pass, plus the fine
//!   scorer's cost over the contenders only.
//!
//! The predictors that score summaries (`lookahead_predictor`, `current_query_predictor`) call it
//! in place of `score` / `score_log_mass` when the summary provides it, passing their budget and,
//! for a `mass_aggregation`, the attention logit scale. Models:
//! `cascade_summary<Coarse, Fine>` (e.g. `qminmax_int4_cascade`).
template <class S>
concept two_stage_summary = block_summary<S> &&
    requires(const S& cs, std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
             std::uint32_t n, float scale, std::uint32_t keep_blocks, float* out) {
  { cs.score_two_stage(h, entries, q, n, scale, keep_blocks, out) } -> std::same_as<void>;
};

//! @brief A `two_stage_summary` whose stages can run apart, so that a predictor can spread one
//! KV head's scoring over several threads: the bounds of disjoint ranges of entries, then one
//! top-k over all of them, then the fine scores of disjoint ranges of the contenders.
//!
//! Additional expressions, with the names above, `m`, `keep_blocks` `std::uint32_t`s and `bound`
//! a `float*`:
//! - `cs.contenders(m, keep_blocks)` -> `std::uint32_t`: how many of `m` entries stage 1 keeps.
//! - `cs.score_bounds(h, entries, q, n, bound)`: `bound[i]` for every `entries[i]`, the entry's
//!   stage-1 bound folded over the rows (its maximum; NaN as `+inf`), a function of that entry
//!   alone.
//! - `cs.score_fine(h, entries, q, n, scale, out)`: the fine scores of `entries` in the layout
//!   and units of `score_two_stage`, a function of each entry alone.
//!
//! `score_two_stage` must equal: `c = contenders(m, keep_blocks)`; if `c >= m` the fine scores of
//! every entry; else the fine scores of the `c` entries with the highest bounds (ties to the
//! earlier entry) and `-inf` for the others. Concurrent calls are safe. Models:
//! `cascade_summary<Coarse, Fine>`, `qminmax_int2_summary`.
template <class S>
concept split_two_stage_summary = two_stage_summary<S> &&
    requires(const S& cs, std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
             std::uint32_t n, float scale, std::uint32_t m, std::uint32_t keep_blocks, float* bound,
             float* out) {
  { cs.contenders(m, keep_blocks) } -> std::convertible_to<std::uint32_t>;
  { cs.score_bounds(h, entries, q, n, bound) } -> std::same_as<void>;
  { cs.score_fine(h, entries, q, n, scale, out) } -> std::same_as<void>;
};

}  // namespace oasiskv
