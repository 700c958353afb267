// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The `growable_summary` concept: a `block_summary` whose capacity can grow in place.
#pragma once

#include <concepts>
#include <cstdint>

#include "oasiskv/concepts/block_summary.hpp"

namespace oasiskv {

//! @brief A `block_summary` that can take more entries without losing the ones it holds.
//!
//! Additional expression, for `s` an `S&` and `n` a `std::uint32_t`:
//! - `s.grow(n)`: `capacity()` becomes `n`; entries `[0, old capacity)` keep what they describe,
//!   the new ones describe an empty block. `n` below the current capacity throws
//!   `oasiskv::error` (`errc::invalid_argument`). O(n x bytes per entry): the store is rebuilt.
//!
//! `tiered_kv_cache` hands such a summary's entries out only to the capacity slots it holds,
//! so a capacity tier far larger than the cache's sequences (a prefill node's whole arena, a
//! large file tier) costs summary memory only for the blocks in use. A summary without `grow`
//! gets one entry per capacity slot.
template <class S>
concept growable_summary = block_summary<S> && requires(S& s, std::uint32_t n) {
  { s.grow(n) } -> std::same_as<void>;
};

}  // namespace oasiskv
