// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The `tier_backend` concept and its refinements `addressable_tier`,
//! `host_accessible_tier`, `block_io_tier` and `batched_block_io_tier`, and the optional hooks
//! `tiered_kv_cache` uses where a tier has them (`slot_io_tier`, read-only slots, `flush`).
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "oasiskv/core/ids.hpp"
#include "oasiskv/core/layout.hpp"
#include "oasiskv/core/views.hpp"

namespace oasiskv {

//! @brief Where a tier's slots live: what can read them, and at what cost.
enum class memory_kind : std::uint8_t {
  host,         //!< pageable host memory
  pinned_host,  //!< page-locked host memory a device can DMA from
  device,       //!< accelerator memory (HBM)
  file,         //!< a file on local storage
  remote,       //!< another node's memory
};

constexpr std::string_view to_string(memory_kind k) noexcept {
  switch (k) {
    case memory_kind::host:
      return "host";
    case memory_kind::pinned_host:
      return "pinned_host";
    case memory_kind::device:
      return "device";
    case memory_kind::file:
      return "file";
    case memory_kind::remote:
      return "remote";
  }
  return "unknown";
}

//! @brief A pool of `num_slots()` block slots, each `slot_bytes()` apart and holding one block
//! of `layout()`, in one memory space. A tier stores bytes; which slot holds which block is the
//! allocator's and the scheduler's business.
//!
//! Required expressions, for `t` a `const T&`:
//! - `T::memory` -> `memory_kind`, a constant: where the slots live.
//! - `t.layout()` -> `const kv_layout&`: the (validated) layout of every slot.
//! - `t.num_slots()` -> `std::uint32_t`: the pool size; constant.
//! - `t.slot_bytes()` -> `std::size_t`: the stride between slots, >= `layout().block_bytes()`.
//! All O(1), noexcept, and safe to call from any thread.
template <class T>
concept tier_backend = requires(const T& t) {
  { T::memory } -> std::convertible_to<memory_kind>;
  { t.layout() } -> std::same_as<const kv_layout&>;
  { t.num_slots() } -> std::same_as<std::uint32_t>;
  { t.slot_bytes() } -> std::same_as<std::size_t>;
};

//! @brief A tier whose slots are plain memory in one address space, so that a kernel can read
//! them through a `block_pool_view`.
//!
//! Additional expressions, for `t` a `T&`, `ct` a `const T&`, `s` a `slot_id`:
//! - `t.slot_data(s)` -> `std::byte*`, `ct.slot_data(s)` -> `const std::byte*`: the slot's first
//!   byte (in the tier's address space). `s >= num_slots()` throws `errc::invalid_slot`. O(1).
//! - `ct.view()` -> `block_pool_view`: the whole pool.
template <class T>
concept addressable_tier = tier_backend<T> && requires(T& t, const T& ct, slot_id s) {
  { t.slot_data(s) } -> std::same_as<std::byte*>;
  { ct.slot_data(s) } -> std::same_as<const std::byte*>;
  { ct.view() } -> std::same_as<block_pool_view>;
};

//! @brief An addressable tier in host memory: the CPU can read and write its slots directly.
template <class T>
concept host_accessible_tier = addressable_tier<T> &&
    (T::memory == memory_kind::host || T::memory == memory_kind::pinned_host);

//! @brief A tier whose slots are reached through calls rather than pointers (a file, a remote
//! node): the CPU copies a block in or out of it.
//!
//! Additional expressions, for `t` a `T&`, `ct` a `const T&`, `s` a `slot_id`, `out` a
//! `std::byte*` and `in` a `const std::byte*` to `layout().block_bytes()` bytes:
//! - `ct.read_block(s, out)`: copies slot `s` into `out`.
//! - `t.write_block(s, in)`: copies `in` into slot `s`.
//! Both may block, are safe to call concurrently for distinct slots, and report failure (an I/O
//! error, a lost peer) by throwing; `s >= num_slots()` throws `errc::invalid_slot`.
template <class T>
concept block_io_tier = tier_backend<T> &&
    requires(T& t, const T& ct, slot_id s, std::byte* out, const std::byte* in) {
  { ct.read_block(s, out) } -> std::same_as<void>;
  { t.write_block(s, in) } -> std::same_as<void>;
};

//! @brief One block to read from a block-I/O tier: slot `slot` into the `layout().block_bytes()`
//! bytes at `out`.
struct block_read {
  slot_id slot = null_slot;
  std::byte* out = nullptr;
};

//! @brief One block to write to a block-I/O tier: the `layout().block_bytes()` bytes at `in` into
//! slot `slot`.
struct block_write {
  slot_id slot = null_slot;
  const std::byte* in = nullptr;
};

//! @brief A block-I/O tier that takes a batch of blocks in one call and keeps them in flight
//! together (io_uring submissions, a thread pool), which scattered blocks on an SSD or a network
//! need to approach the device's bandwidth. A transfer engine issues one call per batch.
//!
//! Additional expressions, for `t` a `T&`, `ct` a `const T&`, `r` a
//! `std::span<const block_read>`, `w` a `std::span<const block_write>`:
//! - `ct.read_blocks(r)`: performs every read of `r`; returns when all have completed.
//! - `t.write_blocks(w)`: performs every write of `w`; returns when all have completed (the
//!   bytes are with the tier: later reads see them).
//! Order within a batch is unspecified, so a slot should appear at most once among a batch's
//! writes. Every slot is checked before anything moves (`errc::invalid_slot`). A failure is
//! reported by throwing once every request already started has finished, so the caller's
//! buffers are free when the call returns or throws; some requests may then have completed.
//! Safe to call concurrently from several threads for distinct slots. O(batch size) work.
template <class T>
concept batched_block_io_tier = block_io_tier<T> &&
    requires(T& t, const T& ct, std::span<const block_read> r, std::span<const block_write> w) {
  { ct.read_blocks(r) } -> std::same_as<void>;
  { t.write_blocks(w) } -> std::same_as<void>;
};

// -- optional hooks: what `tiered_kv_cache` uses where a tier has it ------------------------------

//! @brief An addressable tier whose slots the CPU must not dereference (device memory: kernels
//! read them through `view()`), which copies bytes between host memory and a slot through calls.
//! Where the fast tier is one and is not `host_accessible_tier`, `tiered_kv_cache` writes the
//! blocks it creates and the tokens it appends to staged copies, and reads them for `audit`,
//! through these calls; it never touches `slot_data` of such a tier.
//!
//! Additional expressions, for `t` a `T&`, `ct` a `const T&`, `s` a `slot_id`, `offset` and `n`
//! `std::size_t`s, `in` a `const std::byte*` and `out` a `std::byte*` to `n` bytes of host memory:
//! - `t.write_slot(s, offset, in, n)`: copies `in` into bytes `[offset, offset + n)` of slot `s`.
//! - `ct.read_slot(s, offset, out, n)`: copies bytes `[offset, offset + n)` of slot `s` into
//!   `out`.
//! Both are complete when they return: the host buffer may be reused, and every later transfer
//! or kernel, on any stream, sees what was written. The caller orders them against transfers
//! into the same slot (the cache waits for a slot's staging copy before it writes the slot) and
//! against kernels reading it (the cache never writes a slot a running step has pinned).
//! `s >= num_slots()` throws `errc::invalid_slot`, `offset + n > layout().block_bytes()`
//! `errc::out_of_range`, both naming the value. O(n).
template <class T>
concept slot_io_tier = addressable_tier<T> &&
    requires(T& t, const T& ct, slot_id s, std::size_t offset, const std::byte* in, std::byte* out,
             std::size_t n) {
  { t.write_slot(s, offset, in, n) } -> std::same_as<void>;
  { ct.read_slot(s, offset, out, n) } -> std::same_as<void>;
};

//! @brief A `slot_io_tier` that can also queue writes and complete them together, so a batch of
//! small writes (a batched append's write-through: one per sequence) waits once, not once each.
//!
//! Additional expressions, for `t` a `T&` and the arguments as for `slot_io_tier`:
//! - `t.write_slot_async(s, offset, in, n)`: checks its arguments as `write_slot` does (throwing
//!   before anything is queued) and queues the copy. `in` must stay valid and unchanged until
//!   the next `complete_writes` returns or throws.
//! - `t.complete_writes()`: waits for every queued write; when it returns they are as complete
//!   as `write_slot`'s. Where one failed it throws (`errc::transfer_failed`), and every slot
//!   written since the previous completion holds unspecified bytes.
//! Queued writes land in the order they were queued. The caller completes them before anything
//! else may read or stage into their slots.
template <class T>
concept async_slot_io_tier = slot_io_tier<T> &&
    requires(T& t, slot_id s, std::size_t offset, const std::byte* in, std::size_t n) {
  { t.write_slot_async(s, offset, in, n) } -> std::same_as<void>;
  { t.complete_writes() } -> std::same_as<void>;
};

//! @brief A tier that declares all its slots read-only: `T::read_only`, a constant convertible to
//! `bool` and true (a remote node's memory this node may read but never write). A
//! `composite_tier` whose first part declares it has `read_only_slots()`.
template <class T>
concept declares_read_only_tier = tier_backend<T> && requires {
  { T::read_only } -> std::convertible_to<bool>;
} && static_cast<bool>(T::read_only);

//! @brief A capacity tier some of whose slots are only ever adopted, never written.
//!
//! Additional expression, for `ct` a `const T&`:
//! - `ct.read_only_slots()` -> `std::uint32_t`: slots `[0, n)` cannot be written; constant.
//! `tiered_kv_cache` keeps them out of its allocator (which must be a `claimable_allocator`),
//! lets them enter only through `adopt`, and copies such a block to a slot of its own before an
//! append writes into it.
template <class T>
concept read_only_slot_tier = tier_backend<T> && requires(const T& ct) {
  { ct.read_only_slots() } -> std::same_as<std::uint32_t>;
};

//! @brief A tier that writes behind (`file_tier` with `write_behind`).
//!
//! Additional expression, for `t` a `T&`:
//! - `t.flush()`: returns once every write so far has reached the device; rethrows a deferred
//!   write error. `tiered_kv_cache::drain` calls it.
template <class T>
concept flushable_tier = tier_backend<T> && requires(T& t) {
  t.flush();
};

}  // namespace oasiskv
