// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `free_list_allocator`: O(1) slot ids of a fixed pool.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "oasiskv/core/error.hpp"
#include "oasiskv/core/ids.hpp"

namespace oasiskv {

//! @brief Hands out the slot ids `[0, capacity)` from a LIFO free list (the most recently freed
//! slot is reused first: it is the one most likely still in cache). A per-slot flag catches a
//! double free or a foreign id in O(1); a per-slot position in the free list lets `take` hand
//! out one particular slot in O(1). Models `block_allocator`.
class free_list_allocator {
 public:
  //! @brief A pool of `capacity` slots, all free. `capacity` must be in [1, 2^32 - 1).
  explicit free_list_allocator(std::size_t capacity) {
    if (capacity == 0 || capacity >= null_slot) [[unlikely]] {
      detail::raise(errc::invalid_argument, "free_list_allocator capacity = ", capacity,
                    " must be in [1, ", null_slot, ")");
    }
    free_.reserve(capacity);
    for (std::size_t i = capacity; i-- > 0;) {
      free_.push_back(static_cast<slot_id>(i));  // slot 0 on top: ids come out in order
    }
    allocated_.assign(capacity, 0);
    position_.resize(capacity);
    for (std::size_t i = 0; i < capacity; ++i) {
      position_[free_[i]] = static_cast<slot_id>(i);
    }
  }

  std::optional<slot_id> allocate() noexcept {
    if (free_.empty()) {
      return std::nullopt;
    }
    const slot_id s = free_.back();
    free_.pop_back();
    allocated_[s] = 1;
    return s;
  }

  void deallocate(slot_id s) {
    check_allocated(s, "deallocate");
    allocated_[s] = 0;
    position_[s] = static_cast<slot_id>(free_.size());
    free_.push_back(s);
  }

  //! @brief Hands out slot `s` itself (a slot whose contents already exist, e.g. a block loaded
  //! or shipped into the tier before the allocator knew of it). O(1). Throws `errc::invalid_slot`
  //! for a foreign id and `errc::invalid_argument` for a slot already handed out; the allocator
  //! is then unchanged.
  void take(slot_id s) {
    if (s >= allocated_.size()) [[unlikely]] {
      detail::raise(errc::invalid_slot, "take(slot ", s, "): not a slot of this pool of ",
                    allocated_.size(), " slots");
    }
    if (allocated_[s]) [[unlikely]] {
      detail::raise(errc::invalid_argument, "take(slot ", s, "): slot is already in use");
    }
    const slot_id at = position_[s];
    const slot_id last = free_.back();
    free_[at] = last;  // the last free slot fills the hole
    position_[last] = at;
    free_.pop_back();
    allocated_[s] = 1;
  }

  std::size_t capacity() const noexcept { return allocated_.size(); }
  std::size_t available() const noexcept { return free_.size(); }

  //! @brief Whether `s` is currently handed out. Foreign ids are simply not allocated.
  bool is_allocated(slot_id s) const noexcept {
    return s < allocated_.size() && allocated_[s] != 0;
  }

  //! @brief Throws unless `s` is currently handed out; `what` names the caller's operation.
  void check_allocated(slot_id s, const char* what) const {
    if (s >= allocated_.size()) [[unlikely]] {
      detail::raise(errc::invalid_slot, what, "(slot ", s, "): not a slot of this pool of ",
                    allocated_.size(), " slots");
    }
    if (!allocated_[s]) [[unlikely]] {
      detail::raise(errc::double_free, what, "(slot ", s, "): slot is not allocated");
    }
  }

 private:
  std::vector<slot_id> free_;
  std::vector<std::uint8_t> allocated_;  // not vector<bool>: one byte per slot, no bit twiddling
  std::vector<slot_id> position_;        // [capacity]: index in free_ of a free slot
};

}  // namespace oasiskv
