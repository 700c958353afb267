// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The `block_summary` concept.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

#include "oasiskv/core/layout.hpp"

namespace oasiskv {

//! @brief Small per-block metadata, kept in the fast tier, that a predictor scores queries
//! against instead of reading the block's keys.
//!
//! `S{layout, capacity}` holds `capacity` entries; which block an entry describes is the owner's
//! business. Required expressions, for `s` an `S&`, `cs` a `const S&`, entry `b`, `block` a
//! `const std::byte*` to one slot laid out as `layout`, token range `[first, first + count)`
//! of that block, KV head `h`, `entries` a `std::span<const std::uint32_t>`, `q` a
//! `const float*` to `n` query rows of `head_dim` floats and `out` a `float*`:
//! - `cs.capacity()` -> `std::uint32_t`: the number of entries.
//! - `s.reset(b)`: entry `b` describes an empty block. O(bytes per entry).
//! - `s.update(b, block, first, count)`: folds the keys of tokens `[first, first + count)` of
//!   `block` into entry `b`, so appends (one token or a bulk prefill) keep it current. O(count x
//!   kv heads x head_dim).
//! - `cs.score(h, entries, q, n, out)`: writes `out[i * n + r]`, an estimate (for bound-style
//!   summaries, an upper bound) of `max_t dot(q_r, k_t)` over the keys of KV head `h` folded into
//!   entry `entries[i]`. One call scores a whole sequence against every query row of a GQA group
//!   and every lookahead token, so the summary is read once. O(entries x n x head_dim).
//! - `cs.bytes_per_block()` -> `std::size_t`: fast-tier bytes one entry costs.
//! Out-of-range entries, heads or tokens throw `oasiskv::error`.
template <class S>
concept block_summary = std::constructible_from<S, const kv_layout&, std::uint32_t> &&
    requires(S& s, const S& cs, std::uint32_t b, const std::byte* block, std::uint32_t first,
             std::uint32_t count, std::uint32_t h, std::span<const std::uint32_t> entries,
             const float* q, std::uint32_t n, float* out) {
  { cs.capacity() } -> std::same_as<std::uint32_t>;
  { s.reset(b) } -> std::same_as<void>;
  { s.update(b, block, first, count) } -> std::same_as<void>;
  { cs.score(h, entries, q, n, out) } -> std::same_as<void>;
  { cs.bytes_per_block() } -> std::same_as<std::size_t>;
};

//! @brief How many consecutive entries of `S` one pass over a tile scores: `S::entries_per_tile`
//! where `S` names it, else 16 (one AVX-512 vector of f32 lanes). The facade keeps a layer's
//! consecutive blocks in consecutive entries of one such tile, so scoring a sequence reads each
//! tile once. A positive constant.
template <class S>
struct summary_tile_entries : std::integral_constant<std::uint32_t, 16> {};
template <class S>
requires requires {
  { S::entries_per_tile } -> std::convertible_to<std::uint32_t>;
}
struct summary_tile_entries<S> : std::integral_constant<std::uint32_t, S::entries_per_tile> {
  static_assert(S::entries_per_tile > 0, "oasiskv: a summary's entries_per_tile must be positive");
};
template <class S>
inline constexpr std::uint32_t summary_tile_entries_v = summary_tile_entries<S>::value;

}  // namespace oasiskv
