// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief How a predictor folds the scores of many query rows (lookahead tokens x the q heads of
//! a GQA group, and for a shared selection every KV head) into one score per block, and whether
//! a sequence gets one selection or one per KV head.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "oasiskv/concepts/log_mass_summary.hpp"
#include "oasiskv/concepts/score_aggregation.hpp"
#include "oasiskv/cpu/math.hpp"

namespace oasiskv {

//! @brief The highest score over every row, and over KV heads for a shared selection: a block
//! is kept if any draft of any head wants it. Right for one lookahead token; with many drafts
//! each draft's peaks compete, so a block that one (possibly wrong) draft wants strongly beats a
//! block that every draft wants moderately: the selection for the next step gets diluted.
struct max_aggregation {
  //! @brief `acc[i] = max(acc[i], max_r raw[r][i])`; `first` starts `acc` afresh.
  //! Row by row over all blocks: elementwise, so it vectorises.
  void combine(const aggregation_context& c, const float* raw, float* acc, bool first) {
    const std::size_t blocks = c.num_blocks;
    if (first) {
      std::fill(acc, acc + blocks, -std::numeric_limits<float>::infinity());
    }
    for (std::uint32_t r = 0; r < c.num_rows; ++r) {
      const float* s = raw + r * blocks;
      for (std::size_t i = 0; i < blocks; ++i) {
        acc[i] = s[i] > acc[i] ? s[i] : acc[i];
      }
    }
  }
};

namespace detail {

//! @brief Per query row a softmax over the blocks' scaled scores, summed over rows with weight
//! `w(row)`: the share of each row's (estimated) attention each block receives.
class softmax_mass {
 public:
  template <class Weight>
  void combine(const aggregation_context& c, const float* raw, float* acc, bool first,
               Weight&& weight) {
    const std::size_t blocks = c.num_blocks;
    if (first) {
      std::fill(acc, acc + blocks, 0.0f);
    }
    row_.resize(blocks);
    for (std::uint32_t r = 0; r < c.num_rows; ++r) {
      // Clamped to finite values so that an overflowed bound (+inf, or NaN) or an empty entry
      // (-inf) cannot turn the subtraction of the maximum into NaN: such blocks take all, or
      // none, of the row's mass. Then the exponentials, their sum and the weighted accumulation,
      // each one vectorised pass over the row's contiguous blocks.
      const float m = cpu::detail::clamp_finite_max(raw + r * blocks, blocks, row_.data());
      const float sum = cpu::detail::exp_sum(row_.data(), m, blocks, c.scale, row_.data());
      // sum >= 1: the row's maximum contributes exp(0).
      cpu::detail::add_scaled(acc, row_.data(), weight(r / c.group_size) / sum, blocks);
    }
  }

 private:
  std::vector<float> row_;  // one row's clamped scores, then exponentials; reused
};

}  // namespace detail

//! @brief Per query row a softmax over the blocks' scores (scaled by 1/sqrt(head_dim)), summed
//! over rows (and KV heads for a shared selection): the estimated share of attention each block
//! gets. Every draft has one unit of mass to give, so a block that all drafts want moderately
//! outranks one that a single draft wants strongly, the opposite of `max_aggregation`.
struct softmax_mass_aggregation {
  //! Folds softmax mass: a summary's `score_log_mass` (see `log_mass_summary`) makes it exact.
  static constexpr bool sums_softmax_mass = true;

  void combine(const aggregation_context& c, const float* raw, float* acc, bool first) {
    mass_.combine(c, raw, acc, first, [](std::uint32_t) { return 1.0f; });
  }

 private:
  detail::softmax_mass mass_;
};

//! @brief `softmax_mass_aggregation` with each lookahead token's mass weighted by its draft
//! confidence (`query_view::weights`, e.g. the draft model's probability of the token; all 1
//! when null), so an unlikely draft moves the selection little.
struct confidence_weighted_aggregation {
  static constexpr bool sums_softmax_mass = true;

  void combine(const aggregation_context& c, const float* raw, float* acc, bool first) {
    const float* w = c.weights;
    mass_.combine(c, raw, acc, first,
                  [w](std::uint32_t token) { return w == nullptr ? 1.0f : w[token]; });
  }

 private:
  detail::softmax_mass mass_;
};

//! @brief One selection per (sequence, layer), shared by every KV head: scores are aggregated
//! over KV heads too. One block table per sequence; the fewest bytes to fetch.
struct shared_selection {
  static constexpr bool per_kv_head = false;
};

//! @brief One selection per KV head (`selection.tables == num_kv_heads`): each head keeps the
//! blocks it attends to, at the cost of fetching a block's heads separately.
struct per_kv_head_selection {
  static constexpr bool per_kv_head = true;
};

static_assert(score_aggregation<max_aggregation> && !mass_aggregation<max_aggregation>);
static_assert(mass_aggregation<softmax_mass_aggregation>);
static_assert(mass_aggregation<confidence_weighted_aggregation>);
static_assert(selection_granularity<shared_selection>);
static_assert(selection_granularity<per_kv_head_selection>);

}  // namespace oasiskv
