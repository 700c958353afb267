// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `routing_engine<E1, E2>`: copies out of a `composite_tier`, each part's blocks through
//! its own engine (UCX gets for a remote part, memcpy for a local one).
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <exception>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include "oasiskv/concepts/transfer_engine.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/tier/composite_tier.hpp"
#include "oasiskv/transfer/detail/sorted_set.hpp"

namespace oasiskv {

//! @brief Models `transfer_engine<routing_engine<E1, E2>, composite_tier<A, B>, Dst>` wherever
//! `E1` moves blocks from `A` to `Dst` and `E2` from `B` to `Dst`. `submit` splits a batch by
//! source slot: copies from `[0, n)` go to `E1` as slots of `A`, the others to `E2` as slots of
//! `B` (rebased by n); the ticket holds both parts' tickets.
//!
//! Each engine is constructed from its part of the composite when it has such a constructor
//! (an engine bound to the tier it reads, as a UCX engine is to the exporter's connection), else
//! default-constructed; the same holds for the routing engine itself, so a `tiered_kv_cache`
//! builds it from its capacity tier.
//!
//! Validation: layouts, slot ranges, destinations named twice and destinations an unfinished
//! batch still writes (through either engine: each engine sees only its own batches) are
//! checked for the whole batch before anything moves; then each part's engine checks its part. If
//! the second part is refused after the first part started, `submit` waits for the first part to
//! finish before it throws, so the batch's slots are free again when the error reaches the caller.
//! `wait` waits for both parts and rethrows the first part's failure, else the second's, once.
//! Thread-safe if both engines are.
template <class E1, class E2>
class routing_engine {
 public:
  struct ticket {
    std::uint64_t id = 0;
    typename E1::ticket first{};
    typename E2::ticket second{};
    bool has_first = false;
    bool has_second = false;
  };

  routing_engine() requires std::default_initializable<E1> && std::default_initializable<E2>
      : first_(), second_() {}

  template <class A, class B>
  explicit routing_engine(const composite_tier<A, B>& tier)
      : first_(make<E1>(tier.first())), second_(make<E2>(tier.second())) {}

  routing_engine(const routing_engine&) = delete;
  routing_engine& operator=(const routing_engine&) = delete;

  template <class A, class B, tier_backend Dst>
  requires transfer_engine<E1, A, Dst> && transfer_engine<E2, B, Dst> ticket
  submit(const composite_tier<A, B>& src, Dst& dst, std::span<const block_copy> copies) {
    if (!(src.layout() == dst.layout())) [[unlikely]] {
      detail::raise(errc::layout_mismatch, "routing_engine::submit: source and destination ",
                    "layouts differ (block bytes ", src.layout().block_bytes(), " vs ",
                    dst.layout().block_bytes(), ")");
    }
    const slot_id n = src.first_slots();
    // Per-thread scratch: a submit allocates nothing once these have grown.
    thread_local std::vector<block_copy> a, b;
    thread_local std::vector<slot_id> dsts, sorted;
    a.clear();
    b.clear();
    dsts.clear();
    for (std::size_t i = 0; i < copies.size(); ++i) {
      const block_copy c = copies[i];
      if (c.src >= src.num_slots()) [[unlikely]] {
        detail::raise(errc::invalid_slot, "routing_engine::submit: copy ", i, " reads slot ", c.src,
                      " of a composite tier of ", src.num_slots(), " slots");
      }
      dsts.push_back(c.dst);
      if (c.src < n) {
        a.push_back(c);
      } else {
        b.push_back({c.src - n, c.dst});
      }
    }
    if (const std::size_t i = detail::first_repeat<slot_id>(dsts, sorted); i != dsts.size())
        [[unlikely]] {
      detail::raise(errc::invalid_argument, "routing_engine::submit: copy ", i, " writes slot ",
                    copies[i].dst, " which an earlier copy of the batch writes");
    }
    const std::uint64_t id = reserve(&dst, copies);
    ticket t;
    t.id = id;
    try {
      submit_parts(src, dst, a, b, t);
    } catch (...) {
      std::lock_guard lock(mutex_);
      retire(id);
      throw;
    }
    return t;
  }

  bool test(const ticket& t) const {
    check_issued(t);
    const bool done =
        (!t.has_first || first_.test(t.first)) && (!t.has_second || second_.test(t.second));
    if (done) {
      std::lock_guard lock(mutex_);
      retire(t.id);
    }
    return done;
  }

  void wait(const ticket& t) {
    check_issued(t);
    std::exception_ptr failure;
    if (t.has_first) {
      try {
        first_.wait(t.first);
      } catch (...) {
        failure = std::current_exception();
      }
    }
    if (t.has_second) {
      try {
        second_.wait(t.second);
      } catch (...) {
        if (!failure) {
          failure = std::current_exception();
        }
      }
    }
    {
      std::lock_guard lock(mutex_);
      retire(t.id);
    }
    if (failure) {
      std::rethrow_exception(failure);
    }
  }

  E1& first() noexcept { return first_; }
  E2& second() noexcept { return second_; }

 private:
  using dst_key = std::pair<const void*, slot_id>;

  template <class A, class B, class Dst>
  void submit_parts(const composite_tier<A, B>& src, Dst& dst, const std::vector<block_copy>& a,
                    const std::vector<block_copy>& b, ticket& t) {
    if (!a.empty()) {
      t.first = first_.submit(src.first(), dst, std::span<const block_copy>(a));
      t.has_first = true;
    }
    if (!b.empty()) {
      try {
        t.second = second_.submit(src.second(), dst, std::span<const block_copy>(b));
      } catch (...) {
        if (t.has_first) {
          try {
            first_.wait(t.first);
          } catch (const error&) {
          }
        }
        throw;
      }
      t.has_second = true;
    }
  }

  // Issues the batch's id and marks its destinations written, unless an unfinished batch still
  // writes one of them.
  std::uint64_t reserve(const void* dst, std::span<const block_copy> copies) {
    std::lock_guard lock(mutex_);
    for (std::size_t i = 0; i < copies.size(); ++i) {
      if (writing_.contains({dst, copies[i].dst})) [[unlikely]] {
        detail::raise(errc::slot_in_flight, "routing_engine::submit: copy ", i, " writes slot ",
                      copies[i].dst, " which an unfinished batch still writes");
      }
    }
    const std::uint64_t id = ++issued_;
    std::vector<dst_key> mine;
    if (!spare_.empty()) {  // a retired batch's list, its capacity kept
      mine = std::move(spare_.back());
      spare_.pop_back();
    }
    for (const block_copy& c : copies) {
      writing_.insert({dst, c.dst});
      mine.push_back({dst, c.dst});
    }
    active_.emplace_back(id, std::move(mine));
    return id;
  }

  // Lock held. Batch `id` has finished (or never started): its destinations are free.
  void retire(std::uint64_t id) const {
    const auto it =
        std::find_if(active_.begin(), active_.end(), [id](const auto& a) { return a.first == id; });
    if (it == active_.end()) {
      return;
    }
    for (const dst_key& k : it->second) {
      writing_.erase(k);
    }
    it->second.clear();
    spare_.push_back(std::move(it->second));
    if (it != active_.end() - 1) {
      *it = std::move(active_.back());
    }
    active_.pop_back();
  }

  template <class E, class T>
  static E make(const T& tier) {
    if constexpr (std::constructible_from<E, const T&>) {
      return E(tier);
    } else {
      return E();
    }
  }

  void check_issued(const ticket& t) const {
    std::lock_guard lock(mutex_);
    if (t.id == 0 || t.id > issued_) [[unlikely]] {
      detail::raise(errc::unknown_ticket, "routing_engine: ticket ", t.id, " was never issued");
    }
  }

  E1 first_;
  E2 second_;
  mutable std::mutex mutex_;
  std::uint64_t issued_ = 0;
  // Unfinished batches and their destinations; the lists of retired ones, kept for reuse. Flat
  // vectors: a submit and its retirement allocate nothing in steady state.
  mutable std::vector<std::pair<std::uint64_t, std::vector<dst_key>>> active_;
  mutable std::vector<std::vector<dst_key>> spare_;
  mutable detail::sorted_set<dst_key> writing_;  // their destinations (unique: checked at submit)
};

}  // namespace oasiskv
