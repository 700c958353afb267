// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The `prefetch_scheduler` concept.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

#include "oasiskv/core/ids.hpp"

namespace oasiskv {

//! @brief What one `acquire` found: the step's hit rate and what its misses cost.
struct acquire_stats {
  std::uint32_t hits = 0;           //!< blocks staged (or in flight) before the step asked
  std::uint32_t misses = 0;         //!< blocks that were not: fetched synchronously, or dropped
  std::uint32_t dropped = 0;        //!< misses left out of the step (skip-on-miss policies)
  std::uint64_t bytes_fetched = 0;  //!< bytes the misses fetched
  double stall_seconds = 0.0;       //!< time spent waiting for transfers

  acquire_stats& operator+=(const acquire_stats& o) noexcept {
    hits += o.hits;
    misses += o.misses;
    dropped += o.dropped;
    bytes_fetched += o.bytes_fetched;
    stall_seconds += o.stall_seconds;
    return *this;
  }
};

//! @brief Keeps the fast tier's residency: turns wanted blocks into evictions and fetches, and
//! serves each step the blocks it needs. A block is named by its slot in the capacity tier (its
//! *source*), so blocks that forked sequences share are staged once.
//!
//! Required, for `s` an `S&`, `cs` a `const S&`, `src` a `std::span<const slot_id>` of source
//! slots, `out` a `std::span<slot_id>` of `src.size()`, `fast` a `std::span<const slot_id>` and
//! a source slot `x`:
//! - `s.prefetch(src)`: starts staging the blocks not yet resident, evicting (within the policy's
//!   per-call cap) blocks that are neither pinned nor in flight nor in `src`; returns without
//!   waiting. Blocks it cannot place are left for `acquire`. O(src + evictions).
//! - `s.acquire(src, out)` -> `acquire_stats`: returns once every block of `src` is staged (misses
//!   fetched synchronously) or, under a skip-on-miss policy, dropped (`out[i] == null_slot`);
//!   `out[i]` is the fast slot of `src[i]`, pinned: never evicted or reused until `release`.
//!   Throws `errc::capacity_exceeded` when the fast tier has no evictable slot left.
//! - `s.release(fast)`: unpins slots that `acquire` returned (one pin per occurrence).
//! - `s.settle(x)` -> `std::optional<slot_id>`: waits for any transfer of `x` in flight, then
//!   returns its fast slot if resident, so the caller can write an appended token through.
//! - `s.forget(x)`: `x` no longer holds that block (freed or rewritten): waits for its transfer in
//!   flight, then drops its residency. Pinned blocks cannot be forgotten (`errc::slot_in_flight`).
//! - `cs.resident_blocks()` -> `std::size_t`: blocks staged or in flight; never above the fast
//!   tier's slots.
template <class S>
concept prefetch_scheduler = requires(S& s, const S& cs, std::span<const slot_id> src,
                                      std::span<slot_id> out, slot_id x) {
  { s.prefetch(src) } -> std::same_as<void>;
  { s.acquire(src, out) } -> std::same_as<acquire_stats>;
  { s.release(std::span<const slot_id>(out)) } -> std::same_as<void>;
  { s.settle(x) } -> std::same_as<std::optional<slot_id>>;
  { s.forget(x) } -> std::same_as<void>;
  { cs.resident_blocks() } -> std::same_as<std::size_t>;
};

//! @brief When the scheduler moves blocks.
enum class prefetch_mode : std::uint8_t {
  lookahead,     //!< `prefetch` stages predicted blocks ahead of the step
  on_demand,     //!< nothing ahead: `acquire` fetches what is missing (the baseline)
  all_resident,  //!< every block stays staged once fetched; never evicts (the dense baseline)
};

// -- optional hooks: what `tiered_kv_cache` uses where a scheduler has it -------------------------

//! @brief A scheduler with background work that can be waited for.
//! - `s.drain()`: returns once every prefetch in flight is staged or, where its transfer failed,
//!   dropped. `tiered_kv_cache::drain` calls it.
template <class S>
concept drainable_scheduler = prefetch_scheduler<S> && requires(S& s) {
  s.drain();
};

//! @brief A scheduler that stages a block the cache has just created from memory, without a
//! transfer.
//! - `s.stage_new(x)` -> `std::optional<slot_id>`: a fast slot for the new block of source slot
//!   `x` (not resident), marked resident, which the caller fills with the block's bytes before
//!   anything reads it; `std::nullopt` when no slot is free without evicting.
//! `tiered_kv_cache` calls it for the block an append starts, where the fast tier is
//! host-accessible or a `slot_io_tier`, so the first attention over it does not miss.
template <class S>
concept new_block_staging_scheduler = prefetch_scheduler<S> && requires(S& s, slot_id x) {
  { s.stage_new(x) } -> std::same_as<std::optional<slot_id>>;
};

//! @brief A scheduler that names its prefetch mode: `S::mode` -> `prefetch_mode`, a constant.
//! `prefetch_mode::all_resident` (the dense baseline) makes `tiered_kv_cache` stage every block
//! as soon as it fills.
template <class S>
concept moded_scheduler = prefetch_scheduler<S> && requires {
  { S::mode } -> std::convertible_to<prefetch_mode>;
};

//! @brief A scheduler *policy* as a bundle names it (`lookahead_prefetcher<lru_eviction>`): a
//! tag whose `bind<Fast, Slow, Engine, Allocator>` is the scheduler for those tiers.
template <class P, class Fast, class Slow, class Engine, class Allocator>
concept scheduler_policy = requires {
  typename P::template bind<Fast, Slow, Engine, Allocator>;
}
&&prefetch_scheduler<typename P::template bind<Fast, Slow, Engine, Allocator>>;

}  // namespace oasiskv
