// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cache::check_options`: `cache_options` checked against the tiers a cache is built on,
//! and what follows from them (the budget and cap in blocks, the softmax scale).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "oasiskv/core/decode_params.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/ids.hpp"
#include "oasiskv/core/kept_window.hpp"
#include "oasiskv/core/layout.hpp"
#include "oasiskv/core/selection.hpp"
#include "oasiskv/kv_cache_types.hpp"

namespace oasiskv::cache {

//! @brief What a cache's steps may select, derived once from its options: valid by
//! construction (only `check_options` makes one).
struct step_limits {
  std::uint32_t budget_blocks = 0;  //!< blocks one (sequence, layer) table takes on average
  std::uint32_t sink_blocks = 1;
  std::uint32_t recent_blocks = 1;
  float target_mass = 0.0f;  //!< 0: the fixed budget; else the adaptive budget's share
  //! With an adaptive budget, the most blocks one table takes; 0 with the fixed budget.
  std::uint32_t block_cap = 0;
  float scale = 1.0f;            //!< the softmax scale in effect
  std::uint64_t max_tokens = 0;  //!< tokens one sequence may hold

  //! @brief The parameters every prediction of the cache gets.
  selection_params selection() const noexcept {
    return {budget_blocks, sink_blocks, recent_blocks, target_mass, block_cap};
  }
  //! @brief The always-kept blocks of a sequence of `blocks` blocks.
  block_window window(std::uint32_t blocks) const noexcept {
    return kept_window(blocks, sink_blocks, recent_blocks);
  }

  //! @brief Raises `errc::out_of_range` where `n` more tokens on `tokens` pass `max_tokens`
  //! (`cache_options::max_tokens_per_sequence`), naming the call, sequence and layer.
  void check_room(std::uint64_t tokens, std::uint64_t n, const char* what, sequence_id seq,
                  std::uint32_t layer) const {
    if (tokens + n > max_tokens) [[unlikely]] {
      detail::raise(errc::out_of_range, what, ": ", n, " tokens to sequence ",
                    static_cast<std::uint64_t>(seq), " layer ", layer, " (", tokens,
                    " tokens) would pass max_tokens_per_sequence = ", max_tokens);
    }
  }
};

//! @brief Checks the queries of a lookahead for (seq, layer) of `tokens` tokens: 1 to
//! `max_query_tokens` rows of data, and a layer that holds tokens to select from.
inline void check_lookahead(const kv_layout& l, const query_view& q, std::uint32_t tokens,
                            sequence_id seq, std::uint32_t layer) {
  if (q.data == nullptr || q.num_tokens == 0 || q.num_tokens > max_query_tokens) [[unlikely]] {
    detail::raise(errc::invalid_argument, "lookahead: queries must be 1 to 16 tokens of ",
                  l.num_q_heads, " x ", l.head_dim, " floats (got ", q.num_tokens, " tokens",
                  q.data == nullptr ? ", null data)" : ")");
  }
  if (tokens == 0) [[unlikely]] {
    detail::raise(errc::invalid_argument, "lookahead: sequence ", static_cast<std::uint64_t>(seq),
                  " layer ", layer, " holds no tokens");
  }
}

//! @brief Checks `o` for a cache over a capacity tier of layout `slow`, and a fast tier of
//! layout `fast` with `fast_slots` slots; returns the limits that follow.
//!
//! Errors (`errc::layout_mismatch` for the layouts, else `errc::invalid_argument`), each naming
//! the value: layouts that differ; a budget of 0 tokens or below the kept blocks
//! (`min_budget_blocks`); a fast tier that cannot stage one selection plus the block being
//! appended to; a `target_mass` outside `{0} U (0, 1]` (NaN included); a `max_selected_blocks`
//! below the budget or beyond what the fast tier stages. The adaptive cap defaults to
//! `min(2 * budget, fast_slots - 1)`.
inline step_limits check_options(const cache_options& o, const kv_layout& slow,
                                 const kv_layout& fast, std::uint32_t fast_slots) {
  if (!(fast == slow)) [[unlikely]] {
    detail::raise(errc::layout_mismatch, "tiered_kv_cache: fast and slow tier layouts differ");
  }
  step_limits s;
  s.budget_blocks = slow.blocks_for(o.budget_tokens);
  s.sink_blocks = o.sink_blocks;
  s.recent_blocks = o.recent_blocks;
  s.target_mass = o.target_mass;
  const std::uint64_t kept = min_budget_blocks(o.sink_blocks, o.recent_blocks);
  if (o.budget_tokens == 0 || s.budget_blocks < kept) [[unlikely]] {
    detail::raise(errc::invalid_argument, "tiered_kv_cache: budget_tokens = ", o.budget_tokens,
                  " (", s.budget_blocks, " blocks) is smaller than sink_blocks + ",
                  "max(recent_blocks, 1) = ", kept);
  }
  if (std::uint64_t{s.budget_blocks} + 1 > fast_slots) [[unlikely]] {
    detail::raise(errc::invalid_argument, "tiered_kv_cache: the fast tier's ", fast_slots,
                  " slots cannot stage one selection of ", s.budget_blocks,
                  " blocks plus the block being appended to");
  }
  if (o.target_mass != 0.0f) {
    if (!(o.target_mass > 0.0f && o.target_mass <= 1.0f)) [[unlikely]] {
      detail::raise(errc::invalid_argument, "tiered_kv_cache: target_mass = ", o.target_mass,
                    " must be 0 (the fixed budget) or in (0, 1]");
    }
    // The default cap: twice the budget (what admission plans for), within what the fast tier
    // can stage beside the block being appended to.
    s.block_cap = o.max_selected_blocks != 0
                      ? o.max_selected_blocks
                      : std::min<std::uint32_t>(2 * s.budget_blocks, fast_slots - 1);
    if (s.block_cap < s.budget_blocks) [[unlikely]] {
      detail::raise(errc::invalid_argument, "tiered_kv_cache: max_selected_blocks = ", s.block_cap,
                    " is below the budget of ", s.budget_blocks, " blocks");
    }
    if (std::uint64_t{s.block_cap} + 1 > fast_slots) [[unlikely]] {
      detail::raise(errc::invalid_argument, "tiered_kv_cache: the fast tier's ", fast_slots,
                    " slots cannot stage a selection of up to ", s.block_cap,
                    " blocks (max_selected_blocks) plus the block being appended to");
    }
  }
  s.max_tokens = o.max_tokens_per_sequence;
  s.scale = o.scale > 0.0f ? o.scale : 1.0f / std::sqrt(static_cast<float>(slow.head_dim));
  return s;
}

//! @brief Checks one sequence's part of a step of `q_len` new tokens: the layer holds them, and
//! where the kernel's queries are device memory (`device_queries`), a lookahead selected for
//! this step (the predictor reads host queries).
inline void check_step(std::uint32_t tokens, bool has_lookahead, bool device_queries,
                       std::uint32_t q_len, sequence_id seq, std::uint32_t layer) {
  if (tokens < q_len) [[unlikely]] {
    detail::raise(errc::invalid_argument, "attend: sequence ", static_cast<std::uint64_t>(seq),
                  " layer ", layer, " holds ", tokens, " tokens, fewer than q_len = ", q_len);
  }
  if (device_queries && !has_lookahead) [[unlikely]] {
    detail::raise(errc::invalid_argument, "attend: sequence ", static_cast<std::uint64_t>(seq),
                  " layer ", layer, " has no lookahead selection for this step; the queries of ",
                  "a device kernel are device memory, which the predictor cannot read (call ",
                  "lookahead with host queries first)");
  }
}

}  // namespace oasiskv::cache
