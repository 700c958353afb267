// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The `log_mass_summary` concept: an optional refinement of `block_summary`.
#pragma once

#include <concepts>
#include <cstdint>
#include <span>

#include "oasiskv/concepts/block_summary.hpp"

namespace oasiskv {

//! @brief A `block_summary` that also provides, as an optional expression,
//! `cs.score_log_mass(h, entries, q, n, scale, out)`: `out[i * n + r]` =
//! `log(sum_t exp(scale * dot(q_r, k_t))) / scale` over the keys `k_t` (as the summary holds
//! them) of KV head `h` in entry `entries[i]`, at the attention logit scale `scale`
//! (`aggregation_context::scale`); `-inf` for an empty entry. It is in the units of `score` (a
//! soft maximum of the same dot products), so the predictor passes it to a `mass_aggregation`
//! in place of `score`: the softmax over blocks of `scale * out` is then each block's exact
//! share of the row's attention, where the max (a bound or not) only estimates it, at best, as
//! if one token took the block's whole mass. Models: `quantized_key_summary<Bits>`.
template <class S>
concept log_mass_summary = block_summary<S> &&
    requires(const S& cs, std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
             std::uint32_t n, float scale, float* out) {
  { cs.score_log_mass(h, entries, q, n, scale, out) } -> std::same_as<void>;
};

}  // namespace oasiskv
