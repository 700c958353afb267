//! @file
//! @brief The `prefetch_scheduler` concept.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "oasiskv/core/ids.hpp"
#include "oasiskv/core/selection.hpp"

namespace oasiskv {

//! @brief What one `acquire` found: the step's hit rate and what its misses cost.
struct acquire_stats {
  std::uint32_t hits = 0;     //!< blocks staged before they were needed
  std::uint32_t misses = 0;   //!< blocks that were not, fetched synchronously
  std::uint32_t dropped = 0;  //!< misses left out of the step (skip-on-miss policies)
  std::uint64_t bytes_fetched = 0;
  double stall_seconds = 0.0;  //!< time `acquire` spent waiting for transfers
};

//! @brief Keeps the fast tier's residency: turns selections into evictions and fetches, and
//! serves each step the blocks it needs.
//!
//! Required, for `s` an `S&`, `cs` a `const S&`, a sequence `seq`, a layer `layer`, `sel` a
//! `const selection&` and `out` a `std::vector<block_ref>&`:
//! - `s.prefetch(seq, layer, sel)`: starts staging `sel`'s blocks (evicting, within the policy's
//!   per-step cap, blocks not pinned and not in flight); returns without waiting.
//! - `s.acquire(seq, layer, sel, out)` -> `acquire_stats`: returns once every block of `sel` the
//!   step will read is staged, with `out` holding their staged refs in table order; the blocks
//!   stay pinned (never evicted or reused) until `release`.
//! - `s.release(seq, layer)`: unpins what the last `acquire` of (seq, layer) pinned.
//! - `s.forget(seq)`: drops the sequence's staged blocks (after its in-flight copies finish).
//! - `cs.resident_blocks()` -> `std::size_t`: blocks staged or in flight; never above the budget.
template <class S>
concept prefetch_scheduler = requires(S& s, const S& cs, sequence_id seq, std::uint32_t layer,
                                      const selection& sel, std::vector<block_ref>& out) {
  { s.prefetch(seq, layer, sel) } -> std::same_as<void>;
  { s.acquire(seq, layer, sel, out) } -> std::same_as<acquire_stats>;
  { s.release(seq, layer) } -> std::same_as<void>;
  { s.forget(seq) } -> std::same_as<void>;
  { cs.resident_blocks() } -> std::same_as<std::size_t>;
};

}  // namespace oasiskv
