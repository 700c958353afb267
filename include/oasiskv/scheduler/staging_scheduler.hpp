// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `staging_scheduler`: residency of the fast tier, prefetch, eviction and `acquire`.
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "oasiskv/concepts/block_allocator.hpp"
#include "oasiskv/concepts/eviction_policy.hpp"
#include "oasiskv/concepts/prefetch_scheduler.hpp"
#include "oasiskv/concepts/tier_backend.hpp"
#include "oasiskv/concepts/transfer_engine.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/scheduler/eviction.hpp"

namespace oasiskv {

//! @brief A block the step needs but that was not staged is fetched before the step runs.
struct fetch_on_miss {};
//! @brief A block the step needs but that was not staged is left out of the step (counted).
struct skip_on_miss {};

//! @brief Totals of a scheduler since construction.
struct scheduler_stats {
  std::uint64_t blocks_prefetched = 0;
  std::uint64_t bytes_prefetched = 0;
  std::uint64_t blocks_evicted = 0;
  std::uint64_t bytes_evicted = 0;
  std::uint64_t failed_transfers = 0;  //!< batches that failed; their blocks were refetched
  acquire_stats acquired{};            //!< sum over every `acquire`
};

//! @brief Stages blocks of a capacity tier `Slow` into a fast tier `Fast` through `Engine`,
//! with slots from `Allocator` and victims from `Eviction`. Models `prefetch_scheduler`. Not
//! synchronised: the cache serialises calls (the engine's copies run concurrently with them).
template <class Fast, class Slow, class Engine, class Allocator, class Eviction, prefetch_mode Mode,
          class Miss>
requires tier_backend<Fast> && tier_backend<Slow> && transfer_engine<Engine, Slow, Fast> &&
    block_allocator<Allocator> && std::constructible_from<Allocator, std::size_t>
class staging_scheduler {
  static_assert(eviction_policy<Eviction>,
                "oasiskv: staging_scheduler's Eviction does not model oasiskv::eviction_policy");

 public:
  //! @brief When this scheduler moves blocks; the cache stages every new block up front for
  //! `all_resident`.
  static constexpr prefetch_mode mode = Mode;

  struct options {
    //! Evictions one `prefetch` may make; the rest of its blocks wait for `acquire`. Caps the
    //! damage of one bad prediction to the blocks the next steps still want.
    std::uint32_t max_evictions_per_prefetch = std::numeric_limits<std::uint32_t>::max();
  };

  staging_scheduler(Fast& fast, const Slow& slow, Engine& engine, options o = {})
      : fast_(fast),
        slow_(slow),
        engine_(engine),
        options_(o),
        allocator_(static_cast<std::size_t>(fast.num_slots())),
        eviction_(fast.num_slots()),
        slots_(fast.num_slots()),
        where_(slow.num_slots(), null_slot),
        block_bytes_(fast.layout().block_bytes()) {
    if (!(fast.layout() == slow.layout())) [[unlikely]] {
      detail::raise(errc::layout_mismatch, "staging_scheduler: fast and slow tier layouts differ");
    }
  }
  staging_scheduler(const staging_scheduler&) = delete;
  staging_scheduler& operator=(const staging_scheduler&) = delete;
  ~staging_scheduler() {
    for (auto& [id, b] : batches_) {
      try {
        engine_.wait(b.ticket);  // the engine must not write slots that outlive us
      } catch (...) {
      }
    }
  }

  void prefetch(std::span<const slot_id> sources) {
    if constexpr (Mode == prefetch_mode::on_demand) {
      check_sources(sources);
      return;
    } else {
      check_sources(sources);
      poll();
      ++step_;
      const std::uint64_t mark = ++mark_;
      for (slot_id x : sources) {
        if (where_[x] != null_slot) {
          wanted_[where_[x]] = mark;
        }
      }
      std::uint32_t evictions = 0;
      constexpr bool can_evict = Mode != prefetch_mode::all_resident;
      copies_.clear();
      for (slot_id x : sources) {
        if (where_[x] != null_slot) {
          eviction_.touch(where_[x], step_);
          continue;
        }
        const auto s = take_slot(mark, can_evict && evictions < options_.max_evictions_per_prefetch,
                                 &evictions);
        if (!s) {
          break;  // no room now: the rest become misses if the step needs them
        }
        place(x, *s, mark);
        copies_.push_back({x, *s});
      }
      submit_copies(stats_.blocks_prefetched, stats_.bytes_prefetched);
    }
  }

  acquire_stats acquire(std::span<const slot_id> sources, std::span<slot_id> out) {
    if (out.size() != sources.size()) [[unlikely]] {
      detail::raise(errc::invalid_argument, "staging_scheduler::acquire: ", sources.size(),
                    " sources but ", out.size(), " output slots");
    }
    check_sources(sources);
    acquire_stats st;
    const auto start = std::chrono::steady_clock::now();
    poll();
    ++step_;
    const std::uint64_t mark = ++mark_;
    for (slot_id x : sources) {
      if (where_[x] != null_slot) {
        wanted_[where_[x]] = mark;
      }
    }
    // Hits: wait for those still in flight. A batch that failed loses its blocks: they become
    // misses and are fetched again below (the capacity tier still holds them).
    for (slot_id x : sources) {
      const slot_id s = where_[x];
      if (s != null_slot && slots_[s].st == state::in_flight) {
        finish_batch(slots_[s].batch);
      }
    }
    copies_.clear();
    for (std::size_t i = 0; i < sources.size(); ++i) {
      const slot_id x = sources[i];
      if (where_[x] != null_slot) {
        out[i] = where_[x];
        if (slots_[out[i]].st == state::ready) {
          ++st.hits;
        }  // else: a miss of this same call, already queued below
        continue;
      }
      ++st.misses;
      if constexpr (std::same_as<Miss, skip_on_miss>) {
        out[i] = null_slot;
        ++st.dropped;
        continue;
      }
      const auto s = take_slot(mark, Mode != prefetch_mode::all_resident);
      if (!s) [[unlikely]] {
        abandon_copies();
        detail::raise(errc::capacity_exceeded, "staging_scheduler::acquire: the fast tier's ",
                      fast_.num_slots(),
                      " slots are all pinned, in flight or needed by this step (", sources.size(),
                      " blocks requested)");
      }
      place(x, *s, mark);
      out[i] = *s;
      copies_.push_back({x, *s});
    }
    std::uint64_t fetched_blocks = 0;
    if (!copies_.empty()) {
      const std::uint64_t id = submit_copies(fetched_blocks, st.bytes_fetched);
      finish_batch(id);
      for (std::size_t i = 0; i < sources.size(); ++i) {
        if (out[i] != null_slot && slots_[out[i]].st != state::ready) [[unlikely]] {
          detail::raise(errc::transfer_failed,
                        "staging_scheduler::acquire: fetching capacity slot ", sources[i],
                        " failed: ", last_failure_);
        }
      }
    }
    for (slot_id s : out) {
      if (s != null_slot) {
        ++slots_[s].pins;
        eviction_.touch(s, step_);
      }
    }
    st.stall_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    stats_.acquired += st;
    return st;
  }

  void release(std::span<const slot_id> fast_slots) {
    for (slot_id s : fast_slots) {
      if (s == null_slot) {
        continue;
      }
      if (s >= slots_.size() || slots_[s].pins == 0) [[unlikely]] {
        detail::raise(errc::invalid_argument, "staging_scheduler::release: fast slot ", s,
                      " is not pinned");
      }
      --slots_[s].pins;
    }
  }

  //! @brief Waits for every batch in flight; their blocks become ready (or free, where a batch
  //! failed: counted in `failed_transfers`, as `acquire` would find it).
  void drain() {
    while (!batches_.empty()) {
      finish_batch(batches_.begin()->first);
    }
  }

  std::optional<slot_id> settle(slot_id x) {
    check_source(x);
    const slot_id s = where_[x];
    if (s == null_slot) {
      return std::nullopt;
    }
    if (slots_[s].st == state::in_flight) {
      finish_batch(slots_[s].batch);
    }
    return where_[x] == null_slot ? std::nullopt : std::optional<slot_id>(where_[x]);
  }

  void forget(slot_id x) {
    if (auto s = settle(x)) {
      if (slots_[*s].pins != 0) [[unlikely]] {
        detail::raise(errc::slot_in_flight, "staging_scheduler::forget: capacity slot ", x,
                      " is pinned by a running step (fast slot ", *s, ")");
      }
      drop(*s);
    }
  }

  //! @brief Stages capacity block `x` without a copy, for a caller that writes the block's whole
  //! content into the returned fast slot itself: a block it has just created, whose bytes it
  //! holds. The slot is ready at once. When no slot is free, one ready and unpinned block is
  //! evicted (not with `all_resident`); returns `std::nullopt`, staging nothing, when none can
  //! be. Throws `errc::invalid_argument` if `x` is already staged.
  std::optional<slot_id> stage_new(slot_id x) {
    check_source(x);
    if (where_[x] != null_slot) [[unlikely]] {
      detail::raise(errc::invalid_argument, "staging_scheduler::stage_new: capacity slot ", x,
                    " is already staged (fast slot ", where_[x], ")");
    }
    poll();
    const std::uint64_t mark = ++mark_;
    const auto s = take_slot(mark, Mode != prefetch_mode::all_resident);
    if (!s) {
      return std::nullopt;
    }
    place(x, *s, mark);
    slots_[*s].st = state::ready;
    return s;
  }

  std::size_t resident_blocks() const noexcept { return resident_; }
  const scheduler_stats& stats() const noexcept { return stats_; }
  //! @brief The fast slot holding capacity slot `x`, if staged or in flight (no waiting).
  std::optional<slot_id> resident_slot(slot_id x) const {
    check_source(x);
    return where_[x] == null_slot ? std::nullopt : std::optional<slot_id>(where_[x]);
  }
  //! @brief Whether `x`'s copy has landed (false while in flight or not resident).
  bool is_ready(slot_id x) const {
    check_source(x);
    return where_[x] != null_slot && slots_[where_[x]].st == state::ready;
  }

  //! @brief Checks the bookkeeping against itself and the allocator; throws on a violation.
  //! O(fast slots + capacity slots): for tests and debugging.
  void check_invariants() const {
    std::size_t used = 0;
    for (slot_id s = 0; s < slots_.size(); ++s) {
      const slot_info& i = slots_[s];
      if (i.st == state::free) {
        if (i.pins != 0 || i.source != null_slot) {
          detail::raise(errc::invalid_argument, "invariant: free fast slot ", s,
                        " is pinned or "
                        "names a source");
        }
        continue;
      }
      ++used;
      if (i.source >= where_.size() || where_[i.source] != s) {
        detail::raise(errc::invalid_argument, "invariant: fast slot ", s, " and capacity slot ",
                      i.source, " disagree");
      }
      if (i.st == state::in_flight && !batches_.contains(i.batch)) {
        detail::raise(errc::invalid_argument, "invariant: fast slot ", s,
                      " is in flight in no batch");
      }
    }
    if (used != resident_ || allocator_.available() != slots_.size() - used) {
      detail::raise(errc::invalid_argument, "invariant: ", used, " slots in use, ", resident_,
                    " counted resident, allocator has ", allocator_.available(), " of ",
                    slots_.size(), " free");
    }
  }

 private:
  enum class state : std::uint8_t { free, in_flight, ready };
  struct slot_info {
    slot_id source = null_slot;
    state st = state::free;
    std::uint32_t pins = 0;
    std::uint64_t batch = 0;
  };
  struct batch_info {
    typename Engine::ticket ticket;
    std::vector<slot_id> slots;
  };

  void check_source(slot_id x) const {
    if (x >= where_.size()) [[unlikely]] {
      detail::raise(errc::invalid_slot, "staging_scheduler: capacity slot ", x,
                    " is outside the capacity tier of ", where_.size(), " slots");
    }
  }
  void check_sources(std::span<const slot_id> xs) const {
    for (slot_id x : xs) {
      check_source(x);
    }
  }

  // A free fast slot, else, when `may_evict`, the slot of the coldest block that may go now
  // (counted in `*evicted`); nullopt when neither.
  std::optional<slot_id> take_slot(std::uint64_t mark, bool may_evict,
                                   std::uint32_t* evicted = nullptr) {
    auto s = allocator_.allocate();
    if (!s && may_evict) {
      if (auto v = eviction_.victim([&](slot_id c) { return evictable(c, mark); })) {
        evict(*v);
        if (evicted != nullptr) {
          ++*evicted;
        }
        s = allocator_.allocate();
      }
    }
    return s;
  }

  bool evictable(slot_id s, std::uint64_t mark) const {
    return slots_[s].st == state::ready && slots_[s].pins == 0 && wanted_[s] != mark;
  }

  void place(slot_id x, slot_id s, std::uint64_t mark) {
    slots_[s].source = x;
    slots_[s].st = state::in_flight;
    slots_[s].pins = 0;
    where_[x] = s;
    wanted_[s] = mark;
    eviction_.insert(s, step_);
    ++resident_;
  }

  void drop(slot_id s) {
    where_[slots_[s].source] = null_slot;
    slots_[s] = slot_info{};
    eviction_.erase(s);
    allocator_.deallocate(s);
    --resident_;
  }

  void evict(slot_id s) {
    drop(s);
    ++stats_.blocks_evicted;
    stats_.bytes_evicted += block_bytes_;
  }

  // Submits `copies_` as one batch; returns its id (0 when empty).
  std::uint64_t submit_copies(std::uint64_t& blocks, std::uint64_t& bytes) {
    if (copies_.empty()) {
      return 0;
    }
    typename Engine::ticket t;
    try {
      t = engine_.submit(slow_, fast_, std::span<const block_copy>(copies_));
    } catch (...) {
      abandon_copies();
      throw;
    }
    const std::uint64_t id = ++next_batch_;
    batch_info b{t, {}};
    b.slots.reserve(copies_.size());
    for (const block_copy& c : copies_) {
      slots_[c.dst].batch = id;
      b.slots.push_back(c.dst);
    }
    batches_.emplace(id, std::move(b));
    blocks += copies_.size();
    bytes += copies_.size() * block_bytes_;
    copies_.clear();
    return id;
  }

  // Undoes the placements of `copies_` that were never submitted.
  void abandon_copies() {
    for (const block_copy& c : copies_) {
      drop(c.dst);
    }
    copies_.clear();
  }

  // Waits for batch `id`; its slots become ready, or free if the batch failed.
  void finish_batch(std::uint64_t id) {
    auto it = batches_.find(id);
    if (it == batches_.end()) {
      return;
    }
    bool ok = true;
    try {
      engine_.wait(it->second.ticket);
    } catch (const error& e) {
      ok = false;
      last_failure_ = e.what();
      ++stats_.failed_transfers;
    }
    complete(it, ok);
  }

  void complete(typename std::unordered_map<std::uint64_t, batch_info>::iterator it, bool ok) {
    for (slot_id s : it->second.slots) {
      if (ok) {
        slots_[s].st = state::ready;
      } else {
        drop(s);
      }
    }
    batches_.erase(it);
  }

  // Retires the batches that have finished, without blocking.
  void poll() {
    for (auto it = batches_.begin(); it != batches_.end();) {
      auto next = std::next(it);
      if (engine_.test(it->second.ticket)) {
        finish_batch(it->first);
      }
      it = next;
    }
  }

  Fast& fast_;
  const Slow& slow_;
  Engine& engine_;
  options options_;
  Allocator allocator_;
  Eviction eviction_;
  std::vector<slot_info> slots_;  // [fast slots]
  std::vector<slot_id> where_;    // [capacity slots] -> fast slot or null_slot
  std::vector<std::uint64_t> wanted_ = std::vector<std::uint64_t>(slots_.size(), 0);
  std::unordered_map<std::uint64_t, batch_info> batches_;
  std::vector<block_copy> copies_;  // scratch, reused
  std::size_t resident_ = 0;
  std::size_t block_bytes_;
  std::uint64_t step_ = 0, mark_ = 0, next_batch_ = 0;
  scheduler_stats stats_{};
  std::string last_failure_;
};

//! @brief Prefetches each step's predicted blocks during the previous step (the OasisKV
//! scheduler). `Miss` decides what a block the step needs but that was not staged costs.
template <class Eviction = lru_eviction, class Miss = fetch_on_miss>
struct lookahead_prefetcher {
  template <class Fast, class Slow, class Engine, class Allocator>
  using bind =
      staging_scheduler<Fast, Slow, Engine, Allocator, Eviction, prefetch_mode::lookahead, Miss>;
};

//! @brief Fetches what a step needs when the step asks (the baseline without lookahead).
template <class Eviction = lru_eviction>
struct on_demand_fetcher {
  template <class Fast, class Slow, class Engine, class Allocator>
  using bind = staging_scheduler<Fast, Slow, Engine, Allocator, Eviction, prefetch_mode::on_demand,
                                 fetch_on_miss>;
};

//! @brief Keeps every block staged once fetched, never evicting (the dense baseline: the fast
//! tier must be as large as the whole KV cache).
struct all_resident {
  template <class Fast, class Slow, class Engine, class Allocator>
  using bind = staging_scheduler<Fast, Slow, Engine, Allocator, lru_eviction,
                                 prefetch_mode::all_resident, fetch_on_miss>;
};

}  // namespace oasiskv
