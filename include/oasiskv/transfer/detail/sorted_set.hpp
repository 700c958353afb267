// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief A set kept as a sorted vector, for the transfer engines' bookkeeping of in-flight
//! destinations: a batch adds and removes a few keys among a few hundred, and a vector that keeps
//! its capacity does that without allocating (a node-based set allocates per key).
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

namespace oasiskv::detail {

//! @brief Ordered by `operator<`. Inserting a key already present adds another copy (a
//! multiset: a slot that several unfinished batches read), and `erase` removes one.
template <class T>
class sorted_set {
 public:
  bool contains(const T& x) const { return std::binary_search(v_.begin(), v_.end(), x); }

  //! @brief Adds `x`, before any equal key.
  void insert(const T& x) { v_.insert(std::lower_bound(v_.begin(), v_.end(), x), x); }

  //! @brief Removes one copy of `x` if present.
  void erase(const T& x) {
    const auto it = std::lower_bound(v_.begin(), v_.end(), x);
    if (it != v_.end() && *it == x) {
      v_.erase(it);
    }
  }

  std::size_t size() const noexcept { return v_.size(); }
  bool empty() const noexcept { return v_.empty(); }

 private:
  std::vector<T> v_;
};

//! @brief The index of the first element of `xs` equal to an earlier one, or `xs.size()`.
//! Sorts a copy in `scratch` (kept by the caller, so that it does not allocate once grown);
//! only when a duplicate exists does it search for the first one in order.
template <class T>
std::size_t first_repeat(std::span<const T> xs, std::vector<T>& scratch) {
  scratch.assign(xs.begin(), xs.end());
  std::sort(scratch.begin(), scratch.end());
  if (std::adjacent_find(scratch.begin(), scratch.end()) == scratch.end()) {
    return xs.size();
  }
  for (std::size_t i = 1; i < xs.size(); ++i) {
    if (std::find(xs.begin(), xs.begin() + static_cast<std::ptrdiff_t>(i), xs[i]) !=
        xs.begin() + static_cast<std::ptrdiff_t>(i)) {
      return i;
    }
  }
  return xs.size();  // not reached: the sort found a repeat
}

}  // namespace oasiskv::detail
