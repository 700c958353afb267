// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The `device_summary` concept: block summaries kept and updated in device memory.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

#include "oasiskv/core/layout.hpp"

namespace oasiskv {

//! @brief One summary entry per block, held in device memory and folded there from device keys:
//! the GPU counterpart of a summary that is both a `growable_summary` and a `loadable_summary`,
//! which a `device_selector` scores. The models are `cuda::device_minmax_summary` and
//! `cuda::device_quantized_minmax_summary` (`summary/cuda/`, over one
//! `cuda::device_summary_store`).
//!
//! Required expressions, for `s` an `S&`, `cs` a `const S&`, `e` and `n` `std::uint32_t`s,
//! `keys` a `const void*` and `block` a `const std::byte*` (device memory), `entries` and
//! `tokens` `std::span<const std::uint32_t>`s and `bytes` a `std::span<const std::byte>`. Every
//! call that touches the device also takes a stream last, defaulted to the legacy stream (the
//! expressions below use the default, so the concept needs no CUDA header); each is checked on
//! the host before anything is enqueued and throws `oasiskv::error` naming the bad value.
//! - `S(layout, capacity)`: `capacity` empty entries (they score `-inf`).
//! - `cs.layout()`, `cs.capacity()`: what it was built for (the capacity as grown).
//! - `cs.tokens(e)`: tokens folded into entry `e`, read from a host mirror of the device counts
//!   (no synchronisation); every change goes through `S`.
//! - `s.update(e, keys, n)`: folds `n` appended key rows (`[n][num_kv_heads][head_dim]`, the
//!   layout's dtype) into entry `e` with the host summary's rule, so the entry holds the host's
//!   bits; past `tokens_per_block` is `errc::out_of_range` (the host saturates).
//! - `s.recompute(e, block, n)`: entry `e` from the first `n` tokens of a block laid out as a
//!   fast-tier slot; `s.reset(e)`: entry `e` empty.
//! - `s.grow(n)`: as `growable_summary`'s, on the device (every device pointer changes).
//! - `cs.wire_bytes()`, `s.load(e, bytes, n)` and the batch `s.load(entries, bytes, tokens)`: as
//!   `loadable_summary`'s (the host wire format), the entries then holding the bytes the host
//!   summary holds after the same `load`.
//!
//! Not a `block_summary`: its keys and scores stay on the device, so the host expressions
//! (`update(b, block, first, count)` over host memory, `score` into a host array) are not its.
template <class S>
concept device_summary = std::constructible_from<S, const kv_layout&, std::uint32_t> &&
    requires(S& s, const S& cs, std::uint32_t e, std::uint32_t n, const void* keys,
             const std::byte* block, std::span<const std::uint32_t> entries,
             std::span<const std::byte> bytes, std::span<const std::uint32_t> tokens) {
  { cs.layout() } -> std::same_as<const kv_layout&>;
  { cs.capacity() } -> std::same_as<std::uint32_t>;
  { cs.tokens(e) } -> std::same_as<std::uint32_t>;
  { s.update(e, keys, n) } -> std::same_as<void>;
  { s.recompute(e, block, n) } -> std::same_as<void>;
  { s.reset(e) } -> std::same_as<void>;
  { s.grow(n) } -> std::same_as<void>;
  { cs.wire_bytes() } -> std::same_as<std::size_t>;
  { s.load(e, bytes, n) } -> std::same_as<void>;
  { s.load(entries, bytes, tokens) } -> std::same_as<void>;
};

}  // namespace oasiskv
