// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `composite_tier<First, Second>`: two tiers seen as one pool of slots, routed by slot
//! range. The capacity tier of a cache whose sequences arrive with their blocks already in one
//! tier (a prefill node's memory) and grow in another (local host memory).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "oasiskv/concepts/tier_backend.hpp"
#include "oasiskv/core/error.hpp"

namespace oasiskv {

//! @brief A tier whose slots the CPU reads and writes, directly or through block I/O calls.
template <class T>
concept composable_tier = host_accessible_tier<T> || block_io_tier<T>;

//! @brief True for a tier that declares its slots read-only (`declares_read_only_tier`).
template <class T>
inline constexpr bool declares_read_only = declares_read_only_tier<T>;

//! @brief Slots `[0, n)` are the slots of `First` (n = `first().num_slots()`), slots
//! `[n, n + m)` those of `Second`, slot for slot. Reads and writes go to the part that holds the
//! slot; a batched read or write is split into one batch per part.
//!
//! The first part may be read-only (`first_read_only`, by default what `First` declares):
//! then `read_only_slots()` is n, every write into `[0, n)` throws `errc::unsupported`, and a
//! `tiered_kv_cache` never allocates those slots: they enter only through `adopt`, and appends go
//! to slots of the second part.
//!
//! Owns both parts (held by `unique_ptr`, so that a part that cannot move, a tier with a
//! connection and a thread, still makes a movable composite). Models `batched_block_io_tier`;
//! `memory` is the first part's. Thread safety: that of the parts.
template <composable_tier First, composable_tier Second>
class composite_tier {
 public:
  using first_type = First;
  using second_type = Second;
  static constexpr memory_kind memory = First::memory;

  composite_tier(std::unique_ptr<First> first, std::unique_ptr<Second> second,
                 bool first_read_only = declares_read_only<First>)
      : first_(std::move(first)), second_(std::move(second)), first_read_only_(first_read_only) {
    if (!first_ || !second_) [[unlikely]] {
      detail::raise(errc::invalid_argument, "composite_tier: a part is null");
    }
    if (!(first_->layout() == second_->layout())) [[unlikely]] {
      detail::raise(errc::layout_mismatch,
                    "composite_tier: the parts' layouts differ (block bytes ",
                    first_->layout().block_bytes(), " vs ", second_->layout().block_bytes(), ")");
    }
    if (std::uint64_t{first_->num_slots()} + second_->num_slots() >= null_slot) [[unlikely]] {
      detail::raise(errc::invalid_argument, "composite_tier: ", first_->num_slots(), " + ",
                    second_->num_slots(), " slots do not fit slot ids");
    }
  }

  const kv_layout& layout() const noexcept { return first_->layout(); }
  std::uint32_t num_slots() const noexcept { return first_->num_slots() + second_->num_slots(); }
  std::size_t slot_bytes() const noexcept {
    return std::max(first_->slot_bytes(), second_->slot_bytes());
  }
  //! @brief n: slots `[0, n)` are the first part's; slot `n + i` is slot `i` of the second.
  std::uint32_t first_slots() const noexcept { return first_->num_slots(); }
  //! @brief Slots `[0, read_only_slots())` cannot be written (0 or `first_slots()`).
  std::uint32_t read_only_slots() const noexcept {
    return first_read_only_ ? first_->num_slots() : 0;
  }

  First& first() noexcept { return *first_; }
  const First& first() const noexcept { return *first_; }
  Second& second() noexcept { return *second_; }
  const Second& second() const noexcept { return *second_; }

  void read_block(slot_id s, std::byte* out) const {
    check_slot(s, "read_block");
    if (s < first_slots()) {
      read_part(*first_, s, out);
    } else {
      read_part(*second_, s - first_slots(), out);
    }
  }

  void write_block(slot_id s, const std::byte* in) {
    check_writable(s, "write_block");
    if (s < first_slots()) {
      write_part(*first_, s, in);
    } else {
      write_part(*second_, s - first_slots(), in);
    }
  }

  //! @brief Every slot is checked first; then the first part's reads, then the second's.
  void read_blocks(std::span<const block_read> reads) const {
    std::vector<block_read> a, b;
    for (const block_read& r : reads) {
      check_slot(r.slot, "read_blocks");
      if (r.slot < first_slots()) {
        a.push_back(r);
      } else {
        b.push_back({r.slot - first_slots(), r.out});
      }
    }
    read_batch(*first_, a);
    read_batch(*second_, b);
  }

  //! @brief Every slot is checked first (a read-only one refuses the whole batch); then the
  //! first part's writes, then the second's.
  void write_blocks(std::span<const block_write> writes) {
    std::vector<block_write> a, b;
    for (const block_write& w : writes) {
      check_writable(w.slot, "write_blocks");
      if (w.slot < first_slots()) {
        a.push_back(w);
      } else {
        b.push_back({w.slot - first_slots(), w.in});
      }
    }
    write_batch(*first_, a);
    write_batch(*second_, b);
  }

 private:
  void check_slot(slot_id s, const char* what) const {
    if (s >= num_slots()) [[unlikely]] {
      detail::raise(errc::invalid_slot, "composite_tier::", what, ": slot ", s,
                    " is outside the pool of ", num_slots(), " slots (", first_slots(), " + ",
                    second_->num_slots(), ")");
    }
  }
  void check_writable(slot_id s, const char* what) const {
    check_slot(s, what);
    if (s < read_only_slots()) [[unlikely]] {
      detail::raise(errc::unsupported, "composite_tier::", what, ": slot ", s,
                    " belongs to the read-only first part (slots [0, ", read_only_slots(), "))");
    }
  }

  template <class T>
  static void read_part(const T& t, slot_id s, std::byte* out) {
    if constexpr (host_accessible_tier<T>) {
      std::memcpy(out, t.slot_data(s), t.layout().block_bytes());
    } else {
      t.read_block(s, out);
    }
  }
  template <class T>
  static void write_part(T& t, slot_id s, const std::byte* in) {
    if constexpr (host_accessible_tier<T>) {
      std::memcpy(t.slot_data(s), in, t.layout().block_bytes());
    } else {
      t.write_block(s, in);
    }
  }
  template <class T>
  static void read_batch(const T& t, std::span<const block_read> reads) {
    if (reads.empty()) {
      return;
    }
    if constexpr (batched_block_io_tier<T> && !host_accessible_tier<T>) {
      t.read_blocks(reads);
    } else {
      for (const block_read& r : reads) {
        read_part(t, r.slot, r.out);
      }
    }
  }
  template <class T>
  static void write_batch(T& t, std::span<const block_write> writes) {
    if (writes.empty()) {
      return;
    }
    if constexpr (batched_block_io_tier<T> && !host_accessible_tier<T>) {
      t.write_blocks(writes);
    } else {
      for (const block_write& w : writes) {
        write_part(t, w.slot, w.in);
      }
    }
  }

  std::unique_ptr<First> first_;
  std::unique_ptr<Second> second_;
  bool first_read_only_;
};

}  // namespace oasiskv
