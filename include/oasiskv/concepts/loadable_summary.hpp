// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The `loadable_summary` concept: a `block_summary` that takes entries computed elsewhere.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

#include "oasiskv/concepts/block_summary.hpp"

namespace oasiskv {

//! @brief A `block_summary` whose entries can be set from bytes shipped with the blocks (a
//! prefill node computes them once; the decode node need not read the blocks to score them).
//!
//! Additional expressions, for `s` an `S&`, `cs` a `const S&`, entry `b`, `bytes` a
//! `std::span<const std::byte>` and `tokens` the block's token count:
//! - `cs.wire_bytes()` -> `std::size_t`: bytes of one shipped entry.
//! - `s.load(b, bytes, tokens)`: entry `b` describes the block the bytes were computed from.
//!   A size other than `wire_bytes()` throws `oasiskv::error` (`errc::invalid_argument`).
//!   O(bytes).
//! `tiered_kv_cache::adopt` loads summaries through these; a summary without them is computed
//! by reading the adopted blocks.
template <class S>
concept loadable_summary = block_summary<S> &&
    requires(S& s, const S& cs, std::uint32_t b, std::span<const std::byte> bytes,
             std::uint32_t tokens) {
  { cs.wire_bytes() } -> std::same_as<std::size_t>;
  { s.load(b, bytes, tokens) } -> std::same_as<void>;
};

}  // namespace oasiskv
