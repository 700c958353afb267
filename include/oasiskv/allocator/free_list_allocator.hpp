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
//! double free or a foreign id in O(1). Models `block_allocator`.
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
    free_.push_back(s);
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
};

}  // namespace oasiskv
