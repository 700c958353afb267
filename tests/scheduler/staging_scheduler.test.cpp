// SPDX-License-Identifier: Apache-2.0
#include <doctest/doctest.h>

#include "support/expect_error.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "oasiskv/allocator/free_list_allocator.hpp"
#include "oasiskv/scheduler/staging_scheduler.hpp"
#include "oasiskv/tier/host_tier.hpp"
#include "oasiskv/transfer/cpu_copy_engine.hpp"
#include "support/gated_io_tier.hpp"

using namespace oasiskv;
using oasiskv::testing::gated_io_tier;

namespace {
const kv_layout small{1, 2, 1, 8, 2, dtype::f32};  // 128-byte blocks

template <class Slow>
void stamp_all(Slow& slow) {
  std::vector<std::byte> block(small.block_bytes());
  for (slot_id s = 0; s < slow.num_slots(); ++s) {
    for (std::size_t i = 0; i < block.size(); ++i) {
      block[i] = std::byte(static_cast<unsigned char>(s * 31 + i));
    }
    if constexpr (host_accessible_tier<Slow>) {
      std::memcpy(slow.slot_data(s), block.data(), block.size());
    } else {
      slow.write_block(s, block.data());
    }
  }
}
bool holds(const host_tier& fast, slot_id f, slot_id source) {
  const std::byte* p = fast.slot_data(f);
  for (std::size_t i = 0; i < small.block_bytes(); ++i) {
    if (p[i] != std::byte(static_cast<unsigned char>(source * 31 + i))) {
      return false;
    }
  }
  return true;
}

using oasiskv::testing::expect_error;

template <class Policy, class Slow = host_tier>
using scheduler_for =
    typename Policy::template bind<host_tier, Slow, cpu_copy_engine, free_list_allocator>;
using lookahead_lru = scheduler_for<lookahead_prefetcher<lru_eviction>>;
using lookahead_score = scheduler_for<lookahead_prefetcher<score_eviction>>;
using lookahead_skip = scheduler_for<lookahead_prefetcher<lru_eviction, skip_on_miss>>;
using on_demand = scheduler_for<on_demand_fetcher<>>;
using dense = scheduler_for<all_resident>;

static_assert(prefetch_scheduler<lookahead_lru> && prefetch_scheduler<on_demand> &&
              prefetch_scheduler<dense> && prefetch_scheduler<lookahead_score>);
static_assert(scheduler_policy<lookahead_prefetcher<>, host_tier, gated_io_tier, cpu_copy_engine,
                               free_list_allocator>);

std::vector<slot_id> ids(std::initializer_list<slot_id> l) {
  return l;
}
}  // namespace

TEST_CASE_TEMPLATE("staging_scheduler: acquire serves exact copies and pins them", S, lookahead_lru,
                   lookahead_score, on_demand, dense) {
  host_tier slow(small, 16), fast(small, 8);
  stamp_all(slow);
  cpu_copy_engine engine;
  S s(fast, slow, engine);
  const auto want = ids({3, 9, 12});
  s.prefetch(want);
  std::vector<slot_id> out(3);
  const acquire_stats st = s.acquire(want, out);
  CHECK(st.hits + st.misses == 3);
  CHECK(st.dropped == 0);
  for (std::size_t i = 0; i < 3; ++i) {
    REQUIRE(out[i] != null_slot);
    CHECK(holds(fast, out[i], want[i]));
  }
  CHECK(s.resident_blocks() == 3);
  s.check_invariants();
  s.release(out);
  expect_error([&] { s.release(out); }, errc::invalid_argument, "is not pinned");
  // A second acquire of the same blocks is all hits.
  const acquire_stats again = s.acquire(want, out);
  CHECK(again.hits == 3);
  CHECK(again.misses == 0);
  s.release(out);
  expect_error([&] { s.prefetch(ids({16})); }, errc::invalid_slot, "capacity slot 16");
}

TEST_CASE("lookahead prefetch turns misses into hits; on-demand does not") {
  host_tier slow(small, 16), fast(small, 8);
  stamp_all(slow);
  cpu_copy_engine engine;
  lookahead_lru la(fast, slow, engine);
  const auto want = ids({1, 2, 5});
  la.prefetch(want);
  std::vector<slot_id> out(3);
  acquire_stats st = la.acquire(want, out);
  CHECK(st.hits == 3);
  CHECK(st.misses == 0);
  CHECK(la.stats().bytes_prefetched == 3 * small.block_bytes());
  la.release(out);

  host_tier fast2(small, 8);
  on_demand od(fast2, slow, engine);
  od.prefetch(want);  // ignored by design
  CHECK(od.resident_blocks() == 0);
  st = od.acquire(want, out);
  CHECK(st.misses == 3);
  CHECK(st.bytes_fetched == 3 * small.block_bytes());
  od.release(out);
}

// The eviction_policy contract, against a set model of the tracked slots: every model runs it.
TEST_CASE_TEMPLATE("eviction_policy conformance: victims are tracked, allowed and stable", E,
                   lru_eviction, score_eviction) {
  static_assert(eviction_policy<E>);
  constexpr std::uint32_t slots = 64;
  E e(slots);
  std::set<slot_id> tracked;
  auto any = [](slot_id) {
    return true;
  };
  CHECK_FALSE(e.victim(any).has_value());

  std::mt19937 rng(7);
  std::uint64_t step = 0;
  for (int round = 0; round < 2000; ++round) {
    const auto s = static_cast<slot_id>(rng() % slots);
    switch (rng() % 4) {
      case 0:
      case 1:
        if (tracked.insert(s).second) {
          e.insert(s, ++step);
        } else {
          e.touch(s, ++step);
        }
        break;
      case 2:
        if (tracked.erase(s) == 1) {
          e.erase(s);
        }
        break;
      default: {
        // A random refusal set: the victim is tracked and allowed, and asking twice agrees.
        const std::uint64_t refused = (std::uint64_t{rng()} << 32) | rng();
        auto allowed = [&](slot_id c) {
          return ((refused >> c) & 1) == 0;
        };
        const std::optional<slot_id> v = e.victim(allowed);
        const bool exists =
            std::any_of(tracked.begin(), tracked.end(), [&](slot_id c) { return allowed(c); });
        REQUIRE(v.has_value() == exists);
        if (v) {
          CHECK(tracked.count(*v) == 1);
          CHECK(allowed(*v));
          CHECK(e.victim(allowed) == v);
        }
      }
    }
  }
  // Draining by victims returns every tracked slot exactly once.
  std::set<slot_id> drained;
  while (auto v = e.victim(any)) {
    REQUIRE(tracked.count(*v) == 1);
    REQUIRE(drained.insert(*v).second);
    e.erase(*v);
  }
  CHECK(drained == tracked);
}

TEST_CASE("eviction: LRU order, the per-prefetch cap, pinned and wanted blocks stay") {
  host_tier slow(small, 16), fast(small, 4);
  stamp_all(slow);
  cpu_copy_engine engine;
  lookahead_lru s(fast, slow, engine, {.max_evictions_per_prefetch = 1});
  std::vector<slot_id> out(1);
  // Each copy is waited for: a block still in flight cannot be evicted, and under load the
  // copy engine's worker may not have run yet.
  for (slot_id x : {0u, 1u, 2u, 3u}) {  // touched in this order: 0 is the coldest
    s.prefetch(ids({x}));
    REQUIRE(s.settle(x).has_value());
  }
  s.acquire(ids({0}), out);  // 0 becomes the hottest, and pinned
  CHECK(s.resident_blocks() == 4);
  s.prefetch(ids({4, 5}));  // cap 1: evicts 1 (coldest unpinned) for 4; 5 waits
  CHECK(s.resident_slot(1) == std::nullopt);
  CHECK(s.resident_slot(4).has_value());
  CHECK(s.resident_slot(5) == std::nullopt);
  CHECK(s.resident_slot(0).has_value());
  CHECK(s.stats().blocks_evicted == 1);
  REQUIRE(s.settle(4).has_value());
  // A block wanted by the same call is never the victim.
  s.prefetch(ids({2, 6}));
  CHECK(s.resident_slot(2).has_value());
  CHECK(s.resident_slot(6).has_value());
  CHECK(s.resident_slot(3) == std::nullopt);
  s.release(out);
  s.check_invariants();
}

TEST_CASE("no evictable slot: prefetch stops, acquire raises capacity_exceeded") {
  host_tier slow(small, 16), fast(small, 2);
  stamp_all(slow);
  cpu_copy_engine engine;
  lookahead_lru s(fast, slow, engine);
  std::vector<slot_id> out(2);
  s.acquire(ids({0, 1}), out);  // both pinned
  s.prefetch(ids({2}));
  CHECK(s.resident_slot(2) == std::nullopt);
  std::vector<slot_id> one(1);
  expect_error([&] { s.acquire(ids({2}), one); }, errc::capacity_exceeded,
               "the fast tier's 2 slots are all pinned");
  s.check_invariants();
  s.release(out);
  CHECK_NOTHROW(s.acquire(ids({2}), one));
  s.release(one);
}

TEST_CASE("all_resident never evicts") {
  host_tier slow(small, 16), fast(small, 3);
  stamp_all(slow);
  cpu_copy_engine engine;
  dense s(fast, slow, engine);
  s.prefetch(ids({0, 1, 2, 3}));  // only three fit; nothing is evicted for the fourth
  CHECK(s.resident_blocks() == 3);
  std::vector<slot_id> out(1);
  expect_error([&] { s.acquire(ids({3}), out); }, errc::capacity_exceeded, "3 slots");
  CHECK(s.stats().blocks_evicted == 0);
}

TEST_CASE_TEMPLATE("stage_new: a block the caller writes is staged without a copy", S,
                   lookahead_lru, lookahead_score, on_demand, dense) {
  host_tier slow(small, 16), fast(small, 3);
  stamp_all(slow);
  cpu_copy_engine engine;
  S s(fast, slow, engine);
  const auto f = s.stage_new(5);
  REQUIRE(f.has_value());
  CHECK(s.is_ready(5));
  CHECK(s.resident_slot(5) == f);
  std::memset(fast.slot_data(*f), 0x5a, small.block_bytes());  // the caller's content
  std::vector<slot_id> out(1);
  const acquire_stats st = s.acquire(ids({5}), out);
  CHECK(st.hits == 1);
  CHECK(st.misses == 0);
  CHECK(out[0] == *f);
  CHECK(fast.slot_data(*f)[7] == std::byte{0x5a});  // served as written, nothing fetched
  CHECK(engine.stats().blocks == 0);
  expect_error([&] { (void)s.stage_new(5); }, errc::invalid_argument,
               "capacity slot 5 is already staged (fast slot");
  expect_error([&] { (void)s.stage_new(16); }, errc::invalid_slot, "capacity slot 16");
  // A full fast tier: a ready, unpinned block makes room, except under all_resident; a pinned
  // one never does.
  std::vector<slot_id> two(2);
  s.acquire(ids({1, 2}), two);  // with 5 still pinned, every slot is pinned
  CHECK(s.stage_new(9) == std::nullopt);
  s.release(out);  // 5 may go now
  const auto g = s.stage_new(9);
  if constexpr (S::mode == prefetch_mode::all_resident) {
    CHECK(g == std::nullopt);
    CHECK(s.stats().blocks_evicted == 0);
  } else {
    REQUIRE(g.has_value());
    CHECK(s.resident_slot(5) == std::nullopt);  // least recently used of the unpinned
    CHECK(s.stats().blocks_evicted == 1);
  }
  s.release(two);
  s.check_invariants();
}

TEST_CASE("skip_on_miss leaves unstaged blocks out and counts them") {
  host_tier slow(small, 16), fast(small, 4);
  stamp_all(slow);
  cpu_copy_engine engine;
  lookahead_skip s(fast, slow, engine);
  s.prefetch(ids({0, 1}));
  std::vector<slot_id> out(3);
  const acquire_stats st = s.acquire(ids({0, 1, 7}), out);
  CHECK(st.hits == 2);
  CHECK(st.misses == 1);
  CHECK(st.dropped == 1);
  CHECK(out[2] == null_slot);
  CHECK(holds(fast, out[0], 0));
  s.release(out);
}

TEST_CASE("in-flight blocks are neither evicted nor reused; settle waits for them") {
  gated_io_tier slow(small, 8);
  stamp_all(slow);
  host_tier fast(small, 2);
  cpu_copy_engine engine;
  scheduler_for<lookahead_prefetcher<>, gated_io_tier> s(fast, slow, engine);
  slow.set_open(false);
  s.prefetch(ids({0, 1}));  // both in flight, stalled
  CHECK_FALSE(s.is_ready(0));
  s.prefetch(ids({2, 3}));  // every slot is in flight: nothing can be evicted
  CHECK(s.resident_slot(2) == std::nullopt);
  CHECK(s.stats().blocks_evicted == 0);
  slow.set_open(true);
  const auto f = s.settle(0);
  REQUIRE(f.has_value());
  CHECK(holds(fast, *f, 0));
  CHECK(s.is_ready(0));
  s.forget(0);
  CHECK(s.resident_slot(0) == std::nullopt);
  s.check_invariants();
}

TEST_CASE("a failed transfer loses no data: the block is fetched again from the capacity tier") {
  gated_io_tier slow(small, 8);
  stamp_all(slow);
  host_tier fast(small, 4);
  cpu_copy_engine engine;
  scheduler_for<lookahead_prefetcher<>, gated_io_tier> s(fast, slow, engine);
  slow.poison(2);
  s.prefetch(ids({1, 2}));
  engine.drain();
  slow.cure();  // a transient error: the retry succeeds
  std::vector<slot_id> out(2);
  const acquire_stats st = s.acquire(ids({1, 2}), out);
  CHECK(s.stats().failed_transfers == 1);
  CHECK(st.misses == 2);  // the whole failed batch was refetched
  CHECK(holds(fast, out[0], 1));
  CHECK(holds(fast, out[1], 2));
  s.release(out);
  // A persistent error surfaces as transfer_failed naming the slot.
  slow.poison(5);
  expect_error([&] { s.acquire(ids({5}), std::span<slot_id>(out).first(1)); },
               errc::transfer_failed, "capacity slot 5 failed");
  s.check_invariants();
  // Pinned blocks cannot be forgotten.
  s.acquire(ids({1}), std::span<slot_id>(out).first(1));
  expect_error([&] { s.forget(1); }, errc::slot_in_flight, "pinned");
  s.release(std::span<const slot_id>(out).first(1));
}

TEST_CASE("drain waits for every batch in flight; a failed one is dropped, not served") {
  gated_io_tier slow(small, 8);
  stamp_all(slow);
  host_tier fast(small, 4);
  cpu_copy_engine engine;
  scheduler_for<lookahead_prefetcher<>, gated_io_tier> s(fast, slow, engine);
  slow.set_open(false);
  s.prefetch(ids({0, 1}));
  s.prefetch(ids({2}));
  slow.poison(2);
  CHECK_FALSE(s.is_ready(0));
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    slow.set_open(true);
  });
  s.drain();  // returns only once both batches have finished
  opener.join();
  CHECK(s.is_ready(0));
  CHECK(s.is_ready(1));
  CHECK(s.resident_slot(2) == std::nullopt);  // its read failed: not resident
  CHECK(s.stats().failed_transfers == 1);
  s.check_invariants();
  slow.cure();
  std::vector<slot_id> out(3);
  const acquire_stats st = s.acquire(ids({0, 1, 2}), out);
  CHECK(st.hits == 2);
  CHECK(st.misses == 1);  // the failed block is fetched again, from the capacity tier
  for (slot_id i = 0; i < 3; ++i) {
    CHECK(holds(fast, out[i], i));
  }
  s.release(out);
  s.drain();  // nothing in flight: returns at once
  s.check_invariants();
}

TEST_CASE("score_eviction keeps the blocks the predictor keeps wanting") {
  host_tier slow(small, 32), fast(small, 4);
  stamp_all(slow);
  cpu_copy_engine engine;
  lookahead_score s(fast, slow, engine);
  for (int round = 0; round < 6; ++round) {
    s.prefetch(ids({0, 1}));  // heavy hitters, wanted every step
  }
  // One-off blocks displace each other, not 0 and 1. Each copy is waited for: a block still in
  // flight cannot be evicted, and under load the copy engine's worker may not have run yet.
  for (const slot_id one_off : {10u, 11u, 12u, 13u}) {
    s.prefetch(ids({one_off}));
    REQUIRE(s.settle(one_off).has_value());
  }
  CHECK(s.resident_slot(0).has_value());
  CHECK(s.resident_slot(1).has_value());
  s.check_invariants();
}

TEST_CASE_TEMPLATE("staging_scheduler: 100k random operations keep every invariant", S,
                   lookahead_lru, lookahead_score, lookahead_skip, on_demand) {
  host_tier slow(small, 40), fast(small, 12);
  stamp_all(slow);
  cpu_copy_engine engine;
  S s(fast, slow, engine, {.max_evictions_per_prefetch = 3});
  std::mt19937 rng(77);
  std::vector<std::vector<slot_id>> pinned;      // outstanding acquires: the fast slots...
  std::vector<std::vector<slot_id>> pinned_ids;  // ...and the capacity blocks they hold
  std::map<slot_id, int> pins;                   // fast slot -> pins we hold
  std::vector<slot_id> want, out;
  for (int op = 0; op < 100000; ++op) {
    const unsigned r = rng() % 100;
    want.clear();
    const unsigned n = 1 + rng() % 5;
    for (unsigned i = 0; i < n; ++i) {
      want.push_back(rng() % 40);
    }
    if (r < 40) {
      s.prefetch(want);
    } else if (r < 70 && pinned.size() < 2) {
      out.assign(want.size(), null_slot);
      try {
        s.acquire(want, out);
      } catch (const oasiskv::error& e) {
        REQUIRE(e.code() == errc::capacity_exceeded);
        continue;
      }
      for (std::size_t i = 0; i < want.size(); ++i) {
        if (out[i] != null_slot) {
          REQUIRE(holds(fast, out[i], want[i]));  // exact copy of the capacity block
          ++pins[out[i]];
        }
      }
      pinned.push_back(out);
      pinned_ids.push_back(want);
    } else if (r < 95 && !pinned.empty()) {
      const std::size_t i = rng() % pinned.size();
      for (slot_id f : pinned[i]) {
        if (f != null_slot) {
          --pins[f];
        }
      }
      s.release(pinned[i]);
      pinned.erase(pinned.begin() + static_cast<long>(i));
      pinned_ids.erase(pinned_ids.begin() + static_cast<long>(i));
    } else {
      const slot_id x = rng() % 40;
      const auto f = s.resident_slot(x);
      if (f && pins[*f] > 0) {
        REQUIRE_THROWS_AS(s.forget(x), oasiskv::error);
      } else {
        s.forget(x);
        REQUIRE(s.resident_slot(x) == std::nullopt);
      }
    }
    // Pinned blocks stay where acquire put them, with their content: neither a prefetch's
    // eviction nor another acquire may reuse a pinned slot.
    for (std::size_t i = 0; i < pinned.size(); ++i) {
      for (std::size_t j = 0; j < pinned[i].size(); ++j) {
        const slot_id f = pinned[i][j];
        if (f != null_slot) {
          REQUIRE(pins[f] > 0);
          REQUIRE(holds(fast, f, pinned_ids[i][j]));
        }
      }
    }
    REQUIRE(s.resident_blocks() <= fast.num_slots());
    if (op % 1000 == 0) {
      s.check_invariants();
    }
  }
  for (const auto& p : pinned) {
    s.release(p);
  }
  s.check_invariants();
}
