// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The `eviction_policy` concept: which resident block of the fast tier gives up its slot.
#pragma once

#include <concepts>
#include <cstdint>
#include <optional>

#include "oasiskv/core/ids.hpp"

namespace oasiskv {

namespace detail {
//! @brief The shape of the predicate `victim` is called with (a lambda in the scheduler).
struct slot_predicate {
  bool operator()(slot_id) const;
};
}  // namespace detail

//! @brief Orders the resident slots of a staging scheduler's fast tier for eviction.
//!
//! `E{slots}` tracks fast slots `[0, slots)`. Required expressions, for `e` an `E&`, `ce` a
//! `const E&`, fast slot `s` (below `slots`), `step` the scheduler's monotonically increasing
//! step count and `can_evict` a callable `bool(slot_id)`:
//! - `e.insert(s, step)`: `s` now holds a block (staged at `step`). `s` was not tracked.
//! - `e.touch(s, step)`: the block in `s` was wanted again (prefetched or acquired) at `step`.
//! - `e.erase(s)`: `s` no longer holds a block; `victim` never returns it until it is inserted
//!   again.
//! - `ce.victim(can_evict)` -> `std::optional<slot_id>`: a tracked slot for which `can_evict`
//!   holds, the one the policy would give up first, or `nullopt` when there is none. Never
//!   returns a slot for which `can_evict` is false (the scheduler passes one that refuses
//!   pinned, in-flight and currently wanted blocks). Does not change the order.
//! Complexity is the policy's to document (`lru_eviction`: O(1) updates, O(1 + skipped)
//! victim; `score_eviction`: O(1) updates, O(slots) victim).
template <class E>
concept eviction_policy = std::constructible_from<E, std::uint32_t> &&
    requires(E& e, const E& ce, slot_id s, std::uint64_t step, detail::slot_predicate can_evict) {
  e.insert(s, step);
  e.touch(s, step);
  e.erase(s);
  { ce.victim(can_evict) } -> std::same_as<std::optional<slot_id>>;
};

}  // namespace oasiskv
