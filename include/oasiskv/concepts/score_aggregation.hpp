// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The policies a summary-scoring predictor composes: `score_aggregation` (how the
//! scores of many query rows fold into one score per block), `mass_aggregation` (one that folds
//! softmax mass) and `selection_granularity` (one selection per sequence or per KV head).
#pragma once

#include <concepts>
#include <cstdint>
#include <type_traits>

namespace oasiskv {

//! @brief What an aggregation sees of one KV head's raw scores `raw[row * num_blocks + block]`
//! (row-major: each row's scores over every block are contiguous). Row `r` is q head
//! `r % group_size` of the group, of lookahead token `r / group_size`.
struct aggregation_context {
  std::uint32_t num_blocks = 0;
  std::uint32_t num_rows = 0;
  std::uint32_t group_size = 1;
  float scale = 1.0f;              //!< 1/sqrt(head_dim): the attention logit scale
  const float* weights = nullptr;  //!< [num_rows / group_size] token confidence, or null (all 1)
};

//! @brief Folds one KV head's raw scores into per-block scores.
//!
//! Required, for `a` an `A&`, `c` a `const aggregation_context&`, `raw` a `const float*` to
//! `c.num_rows x c.num_blocks` scores (row-major) and `acc` a `float*` to `c.num_blocks`
//! accumulated scores:
//! - `A{}`: default constructible; the predictor owns one (its scratch, if any, is its own).
//! - `a.combine(c, raw, acc, first)`: folds `raw` into `acc`; with `first` true `acc` starts
//!   afresh (its old contents are ignored), else the result also folds in `acc`'s scores (the
//!   other KV heads of a shared selection). Blocks are compared by `acc` alone afterwards:
//!   higher is more important. O(num_rows x num_blocks).
template <class A>
concept score_aggregation = std::default_initializable<A> &&
    requires(A& a, const aggregation_context& c, const float* raw, float* acc, bool first) {
  a.combine(c, raw, acc, first);
};

//! @brief An aggregation that folds per-row softmax mass over blocks (it declares
//! `static constexpr bool sums_softmax_mass = true`): `softmax_mass_aggregation`,
//! `confidence_weighted_aggregation`.
template <class A>
concept mass_aggregation = score_aggregation<A> && requires {
  requires A::sums_softmax_mass;
};

//! @brief Whether a predictor selects once per (sequence, layer) or once per KV head.
//!
//! Required: `G::per_kv_head` -> `bool`, a constant. With `true` a selection holds
//! `num_kv_heads` tables and each KV head's scores are aggregated alone; with `false` one table
//! serves every KV head and their scores are aggregated together.
template <class G>
concept selection_granularity = requires {
  { G::per_kv_head } -> std::convertible_to<bool>;
  std::bool_constant<G::per_kv_head>{};
};

}  // namespace oasiskv
