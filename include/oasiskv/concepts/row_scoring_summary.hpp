// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The `row_scoring_summary` concept: a `block_summary` that also writes its scores row by
//! row.
#pragma once

#include <concepts>
#include <cstdint>
#include <span>

#include "oasiskv/concepts/block_summary.hpp"

namespace oasiskv {

//! @brief A `block_summary` whose scores can be written query row by query row.
//!
//! Additional expression, with the names of `block_summary`:
//! - `cs.score_rows(h, entries, q, n, out)`: the scores of `cs.score(h, entries, q, n, out)`,
//!   each bit-identical, at `out[r * entries.size() + i]` instead of `out[i * n + r]`.
//!
//! The predictors' aggregations read one row's scores over every block (a softmax over blocks,
//! a running max), so a predictor over such a summary scores straight into that layout; over any
//! other summary it transposes `score`'s output first. Models: `minmax_summary<S>`,
//! `quantized_minmax_summary`.
template <class S>
concept row_scoring_summary = block_summary<S> &&
    requires(const S& cs, std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
             std::uint32_t n, float* out) {
  { cs.score_rows(h, entries, q, n, out) } -> std::same_as<void>;
};

}  // namespace oasiskv
