// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The `block_allocator` concept.
#pragma once

#include <concepts>
#include <cstddef>
#include <optional>

#include "oasiskv/core/ids.hpp"

namespace oasiskv {

//! @brief Hands out and takes back the slot ids of a fixed pool of `capacity()` slots.
//!
//! Required expressions, for `a` an `A&`, `ca` a `const A&`, `s` a `slot_id`:
//! - `a.allocate()` -> `std::optional<slot_id>`: a slot no one holds, or `std::nullopt` when the
//!   pool is exhausted (exhaustion is a normal outcome, not an error). O(1).
//! - `a.deallocate(s)`: returns `s` to the pool. A slot the pool never handed out, or one already
//!   returned, throws `oasiskv::error` (`errc::invalid_slot`, `errc::double_free`) and leaves the
//!   allocator unchanged. O(1).
//! - `ca.capacity()` -> `std::size_t`: slots in the pool; constant over the allocator's life.
//! - `ca.available()` -> `std::size_t`: slots `allocate()` can still hand out. O(1).
//!
//! Allocators are not synchronised: the owner (a tier, the cache) serialises calls.
template <class A>
concept block_allocator = requires(A& a, const A& ca, slot_id s) {
  { a.allocate() } -> std::same_as<std::optional<slot_id>>;
  { a.deallocate(s) } -> std::same_as<void>;
  { ca.capacity() } -> std::same_as<std::size_t>;
  { ca.available() } -> std::same_as<std::size_t>;
};

//! @brief Optional hook: an allocator that can hand out one named slot.
//!
//! Additional expression, for `a` an `A&` and a slot `s`:
//! - `a.take(s)`: marks free slot `s` as in use; a slot outside the pool throws
//!   `errc::invalid_slot`, one in use `errc::invalid_argument`, leaving the allocator unchanged.
//!   O(1).
//! `tiered_kv_cache::adopt` (blocks that already lie in the capacity tier) and a capacity tier
//! with read-only slots (`read_only_slot_tier`) need it; `free_list_allocator` has it.
template <class A>
concept claimable_allocator = block_allocator<A> && requires(A& a, slot_id s) {
  { a.take(s) } -> std::same_as<void>;
};

}  // namespace oasiskv
