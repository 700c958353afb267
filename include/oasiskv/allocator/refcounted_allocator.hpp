// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `refcounted_allocator<A>`: shared slots (prefix sharing) over any block allocator.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "oasiskv/concepts/block_allocator.hpp"
#include "oasiskv/core/error.hpp"

namespace oasiskv {

//! @brief What `refcounted_allocator::prepare_write` decided.
struct cow_result {
  slot_id slot = null_slot;  //!< the slot to write to
  bool copied = false;       //!< true: `slot` is new and the caller must copy the old slot into it
};

//! @brief Adds reference counts to allocator `A`: forked sequences share their prefix blocks
//! (`retain`), a slot returns to `A` when its last holder lets go (`deallocate`), and
//! `prepare_write` gives a holder a private slot before it writes into a shared one
//! (copy-on-write). Models `block_allocator`.
//!
//! Slots whose blocks come from elsewhere (a prefill node's memory, a restored prefix) enter
//! through `adopt` instead of `allocate`. `reserve` keeps such a slot out of the pool for good:
//! `allocate` never hands it out, and when its last holder lets go it returns to the reserve,
//! not to the pool (its memory may be read-only, or another node's).
template <block_allocator A>
class refcounted_allocator {
 public:
  using count_type = std::uint32_t;

  template <class... Args>
  explicit refcounted_allocator(Args&&... args)
      : base_(std::forward<Args>(args)...),
        counts_(base_.capacity(), 0),
        reserved_(base_.capacity(), 0) {}

  //! @brief A slot with one holder, or nullopt when the pool is exhausted.
  std::optional<slot_id> allocate() {
    auto s = base_.allocate();
    if (s) {
      counts_[*s] = 1;
    }
    return s;
  }

  //! @brief Drops one holder of `s`; the slot returns to the pool with the last one.
  void deallocate(slot_id s) {
    check_held(s, "deallocate");
    if (--counts_[s] == 0 && !reserved_[s]) {
      base_.deallocate(s);
    }
  }

  //! @brief Takes free slot `s` out of the pool for good: only `adopt` can give it holders.
  //! O(1). Throws `errc::invalid_slot` for a foreign id and `errc::invalid_argument` for a slot
  //! in use or already reserved; nothing changes then.
  void reserve(slot_id s) requires requires(A& a) { a.take(s); }
  {
    check_range(s, "reserve");
    if (reserved_[s] || counts_[s] != 0) [[unlikely]] {
      detail::raise(errc::invalid_argument, "reserve(slot ", s, "): slot is already ",
                    reserved_[s] ? "reserved" : "in use");
    }
    base_.take(s);
    reserved_[s] = 1;
  }

  //! @brief Gives `s`, a slot whose block already exists, its first holder: a reserved slot, or
  //! a free slot of the pool (taken out of it). O(1). Throws `errc::invalid_slot` for a foreign
  //! id and `errc::invalid_argument` for a slot already in use; nothing changes then.
  void adopt(slot_id s) requires requires(A& a) { a.take(s); }
  {
    check_range(s, "adopt");
    if (counts_[s] != 0) [[unlikely]] {
      detail::raise(errc::invalid_argument, "adopt(slot ", s, "): slot is already in use (",
                    counts_[s], counts_[s] == 1 ? " holder)" : " holders)");
    }
    if (!reserved_[s]) {
      base_.take(s);
    }
    counts_[s] = 1;
  }

  //! @brief Whether `s` was reserved (held or not).
  bool is_reserved(slot_id s) const noexcept { return s < reserved_.size() && reserved_[s] != 0; }

  //! @brief Adds a holder to `s` (a fork sharing the block).
  void retain(slot_id s) {
    check_held(s, "retain");
    if (counts_[s] == std::numeric_limits<count_type>::max()) [[unlikely]] {
      detail::raise(errc::out_of_range, "retain(slot ", s, "): reference count overflow");
    }
    ++counts_[s];
  }

  //! @brief Before writing into `s`: if `s` is shared, moves this holder to a fresh slot (the
  //! caller copies the block into it; the other holders keep `s`, which stays valid, so the copy
  //! source cannot vanish). nullopt when a copy is needed and the pool is exhausted; nothing
  //! changes then.
  std::optional<cow_result> prepare_write(slot_id s) {
    check_held(s, "prepare_write");
    if (counts_[s] == 1) {
      return cow_result{s, false};
    }
    auto fresh = allocate();
    if (!fresh) {
      return std::nullopt;
    }
    --counts_[s];  // >= 1 remains: the source survives the caller's copy
    return cow_result{*fresh, true};
  }

  count_type use_count(slot_id s) const noexcept { return s < counts_.size() ? counts_[s] : 0; }
  std::size_t capacity() const noexcept { return base_.capacity(); }
  std::size_t available() const noexcept { return base_.available(); }
  const A& base() const noexcept { return base_; }

 private:
  void check_range(slot_id s, const char* what) const {
    if (s >= counts_.size()) [[unlikely]] {
      detail::raise(errc::invalid_slot, what, "(slot ", s, "): not a slot of this pool of ",
                    counts_.size(), " slots");
    }
  }
  void check_held(slot_id s, const char* what) const {
    check_range(s, what);
    if (counts_[s] == 0) [[unlikely]] {
      detail::raise(errc::double_free, what, "(slot ", s, "): slot is not allocated");
    }
  }

  A base_;
  std::vector<count_type> counts_;
  std::vector<std::uint8_t> reserved_;  // [capacity]: 1 for a slot only `adopt` may hand out
};

}  // namespace oasiskv
