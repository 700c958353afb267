// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The `transfer_engine` concept.
#pragma once

#include <concepts>
#include <span>

#include "oasiskv/concepts/tier_backend.hpp"
#include "oasiskv/core/ids.hpp"

namespace oasiskv {

//! @brief One block copy of a batch: slot `src` of the source tier to slot `dst` of the
//! destination tier, the whole slot.
struct block_copy {
  slot_id src = null_slot;
  slot_id dst = null_slot;
  friend constexpr bool operator==(const block_copy&, const block_copy&) = default;
};

//! @brief Moves batches of blocks from tier `Src` to tier `Dst` asynchronously.
//!
//! Required expressions, for `e` an `E&`, `src` a `const Src&`, `dst` a `Dst&`, `b` a
//! `std::span<const block_copy>` and `t` a `const typename E::ticket&`:
//! - `e.submit(src, dst, b)` -> `E::ticket`: validates the whole batch (layouts equal, slot ids in
//!   range, no destination twice, no slot that an unfinished batch writes, no destination that an
//!   unfinished batch reads) and throws `oasiskv::error` before anything moves if it is bad;
//!   otherwise starts the copies and returns at once. O(batch).
//! - `e.test(t)` -> `bool`: whether the batch has finished (successfully or not). Never blocks.
//! - `e.wait(t)`: blocks until the batch has finished, then rethrows its failure, if any, as an
//!   `oasiskv::error` (`errc::transfer_failed`), once. A ticket the engine never issued throws
//!   `errc::unknown_ticket`.
//! Until `test` returns true, the batch's slots must be neither freed nor reused.
template <class E, class Src, class Dst>
concept transfer_engine = tier_backend<Src> && tier_backend<Dst> &&
    requires(E& e, const Src& src, Dst& dst, std::span<const block_copy> b,
             const typename E::ticket& t) {
  { e.submit(src, dst, b) } -> std::same_as<typename E::ticket>;
  { e.test(t) } -> std::same_as<bool>;
  { e.wait(t) } -> std::same_as<void>;
};

//! @brief Optional hook: an engine bound to the capacity tier it reads, constructed from it
//! (`routing_engine` over a `composite_tier`, which routes each part to its own engine).
//! `tiered_kv_cache` constructs its engine from the capacity tier where `E(slow)` is valid, else
//! default-constructs it.
template <class E, class Slow>
concept tier_bound_engine = std::constructible_from<E, Slow&>;

}  // namespace oasiskv
