// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Eviction policies of the staging scheduler: which resident block gives up its slot.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "oasiskv/concepts/eviction_policy.hpp"
#include "oasiskv/core/ids.hpp"

namespace oasiskv {

//! @brief Least recently used: the block whose last prefetch or acquire is oldest goes first.
//! An intrusive list over fast slots makes `touch` O(1); `victim` walks from the cold end past
//! the blocks that cannot go (pinned, in flight, wanted now), so it is O(1 + skipped).
class lru_eviction {
 public:
  explicit lru_eviction(std::uint32_t slots) : prev_(slots, none), next_(slots, none) {}

  void insert(slot_id s, std::uint64_t /*step*/) { link_front(s); }
  void touch(slot_id s, std::uint64_t /*step*/) {
    unlink(s);
    link_front(s);
  }
  void erase(slot_id s) { unlink(s); }

  //! @brief The coldest slot for which `can_evict(slot)` holds, or nullopt.
  template <class Pred>
  std::optional<slot_id> victim(Pred&& can_evict) const {
    for (slot_id s = tail_; s != none; s = prev_[s]) {
      if (can_evict(s)) {
        return s;
      }
    }
    return std::nullopt;
  }

 private:
  static constexpr slot_id none = null_slot;
  void link_front(slot_id s) {
    prev_[s] = none;
    next_[s] = head_;
    if (head_ != none) {
      prev_[head_] = s;
    }
    head_ = s;
    if (tail_ == none) {
      tail_ = s;
    }
  }
  void unlink(slot_id s) {
    if (prev_[s] != none) {
      next_[prev_[s]] = next_[s];
    } else if (head_ == s) {
      head_ = next_[s];
    }
    if (next_[s] != none) {
      prev_[next_[s]] = prev_[s];
    } else if (tail_ == s) {
      tail_ = prev_[s];
    }
    prev_[s] = next_[s] = none;
  }
  std::vector<slot_id> prev_, next_;  // toward the hot end (prev) and the cold end (next)
  slot_id head_ = none, tail_ = none;
};

//! @brief Lowest score first, the score being how often the predictor has wanted the block,
//! decayed by half every `half_life` steps. Keeps blocks that recur across steps (the heavy
//! hitters of attention) even when a burst of one-off selections is more recent. `victim` scans
//! every slot: O(slots) per eviction.
class score_eviction {
 public:
  explicit score_eviction(std::uint32_t slots, double half_life = 8.0)
      : score_(slots, 0.0),
        stamp_(slots, 0),
        live_(slots, 0),
        decay_(std::exp2(-1.0 / half_life)) {}

  void insert(slot_id s, std::uint64_t step) {
    live_[s] = 1;
    score_[s] = 1.0;
    stamp_[s] = step;
    now_ = std::max(now_, step);
  }
  void touch(slot_id s, std::uint64_t step) {
    score_[s] = decayed(s, step) + 1.0;
    stamp_[s] = step;
    now_ = std::max(now_, step);
  }
  void erase(slot_id s) { live_[s] = 0; }

  template <class Pred>
  std::optional<slot_id> victim(Pred&& can_evict) const {
    std::optional<slot_id> best;
    double best_score = std::numeric_limits<double>::infinity();
    for (slot_id s = 0; s < score_.size(); ++s) {
      if (live_[s] && can_evict(s)) {
        const double v = decayed(s, now_);
        if (v < best_score) {
          best_score = v;
          best = s;
        }
      }
    }
    return best;
  }

 private:
  double decayed(slot_id s, std::uint64_t now) const {
    return score_[s] * std::pow(decay_, static_cast<double>(now - stamp_[s]));
  }
  std::vector<double> score_;
  std::vector<std::uint64_t> stamp_;
  std::vector<std::uint8_t> live_;
  double decay_;
  std::uint64_t now_ = 0;
};

static_assert(eviction_policy<lru_eviction>);
static_assert(eviction_policy<score_eviction>);

}  // namespace oasiskv
