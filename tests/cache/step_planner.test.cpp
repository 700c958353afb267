// SPDX-License-Identifier: Apache-2.0
// cache::step_planner over a real staging scheduler, host tiers and the CPU copy engine: the
// tables it plans point at fast slots holding exactly the capacity blocks they name, the kept
// window is merged in, what it pins is unpinned on close, and its plans are reused.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <vector>

#include "oasiskv/allocator/free_list_allocator.hpp"
#include "oasiskv/cache/step_planner.hpp"
#include "oasiskv/scheduler/staging_scheduler.hpp"
#include "oasiskv/tier/host_tier.hpp"
#include "oasiskv/transfer/cpu_copy_engine.hpp"
#include "support/expect_error.hpp"

using namespace oasiskv;
using oasiskv::testing::expect_error;

namespace {
const kv_layout small{1, 2, 1, 8, 2, dtype::f32};  // 2-token blocks of 128 bytes

template <class Miss>
using scheduler_for = typename lookahead_prefetcher<lru_eviction, Miss>::template bind<
    host_tier, host_tier, cpu_copy_engine, free_list_allocator>;

struct rig {
  host_tier slow{small, 32};
  host_tier fast{small, 16};
  cpu_copy_engine engine;
  rig() {
    for (slot_id s = 0; s < slow.num_slots(); ++s) {
      std::memset(slow.slot_data(s), static_cast<int>(s + 1), small.block_bytes());
    }
  }
  // True when fast slot `f` holds capacity slot `s`'s bytes.
  bool holds(slot_id f, slot_id s) const {
    return std::memcmp(fast.slot_data(f), slow.slot_data(s), small.block_bytes()) == 0;
  }
};

selection one_table(std::vector<std::uint32_t> blocks) {
  selection sel;
  sel.tables = 1;
  sel.offsets = {0, static_cast<std::uint32_t>(blocks.size())};
  sel.blocks = std::move(blocks);
  return sel;
}

cache::layer_blocks layer(std::uint32_t tokens, std::vector<slot_id> slots) {
  cache::layer_blocks ls;
  ls.tokens = tokens;
  ls.blocks = std::move(slots);
  return ls;
}
}  // namespace

TEST_CASE("cache::step_planner: merge_window adds the kept blocks and drops those past the end") {
  rig r;
  scheduler_for<fetch_on_miss> sched(r.fast, r.slow, r.engine);
  cache::step_planner planner(sched);
  selection sel;
  sel.tables = 2;
  sel.blocks = {2, 3, 8, 1, 4};  // table 0: {2, 3, 8}; table 1: {1, 4}
  sel.offsets = {0, 3, 5};
  planner.merge_window(kept_window(6, 1, 1), sel);
  CHECK(sel.tables == 2);
  CHECK(sel.offsets == std::vector<std::uint32_t>{0, 4, 8});
  CHECK(sel.blocks == std::vector<std::uint32_t>{0, 2, 3, 5, 0, 1, 4, 5});
}

TEST_CASE("cache::step_planner: a plan's tables point at the capacity blocks they name") {
  rig r;
  scheduler_for<fetch_on_miss> sched(r.fast, r.slow, r.engine);
  cache::step_planner planner(sched);
  const cache::layer_blocks a = layer(11, {20, 3, 7, 11, 25, 30});  // 6 blocks, the last partial
  const cache::layer_blocks b = layer(4, {9, 7});                   // shares capacity slot 7
  cache_stats stats;
  auto plan = planner.open();
  selection sa = one_table({2, 3, 8});
  planner.add(*plan, a, kept_window(6, 1, 1), sa, stats);
  selection sb = one_table({});
  planner.add(*plan, b, kept_window(2, 1, 1), sb, stats);

  CHECK(plan->sequences() == 2);
  CHECK(plan->lens == std::vector<std::uint32_t>{11, 4});
  CHECK(plan->tables_per_seq == 1);
  CHECK(plan->offsets == std::vector<std::uint32_t>{0, 4, 6});
  const std::vector<std::uint32_t> positions_a{0, 2, 3, 5}, positions_b{0, 1};
  for (std::uint32_t i = 0; i < 6; ++i) {
    const block_ref ref = plan->refs[i];
    const cache::layer_blocks& ls = i < 4 ? a : b;
    CHECK(ref.index == (i < 4 ? positions_a[i] : positions_b[i - 4]));
    CHECK(r.holds(ref.slot, ls.blocks[ref.index]));
  }
  // The shared capacity slot 7 (block 2 of a, block 1 of b) is staged once, for both.
  CHECK(plan->refs[1].index == 2);
  CHECK(plan->refs[5].slot == plan->refs[1].slot);
  CHECK(stats.sequence_steps == 2);
  CHECK(stats.selected_blocks == 6);
  // Nothing was prefetched: every block was fetched on demand, but b found slot 7 staged by a.
  CHECK(stats.step.misses == 5);
  CHECK(stats.step.hits == 1);
  attended_blocks seen;
  planner.describe(*plan, seen);
  CHECK(seen.sequences() == 2);
  CHECK(std::vector<std::uint32_t>(seen.table(0).begin(), seen.table(0).end()) == positions_a);

  // While the step runs its blocks are pinned: the capacity slot cannot be dropped.
  expect_error([&] { sched.forget(20); }, errc::slot_in_flight, "capacity slot 20 is pinned");
  planner.close(std::move(plan));
  CHECK_NOTHROW(sched.forget(20));
  sched.check_invariants();
}

TEST_CASE("cache::step_planner: one granularity per plan; an error leaves only what close frees") {
  rig r;
  scheduler_for<fetch_on_miss> sched(r.fast, r.slow, r.engine);
  cache::step_planner planner(sched);
  const cache::layer_blocks a = layer(8, {1, 2, 3, 4});
  cache_stats stats;
  auto plan = planner.open();
  selection sa = one_table({1});
  planner.add(*plan, a, kept_window(4, 1, 1), sa, stats);
  const std::size_t pinned = plan->pinned.size();
  selection per_head;
  per_head.tables = 2;
  per_head.blocks = {1, 2};
  per_head.offsets = {0, 1, 2};
  expect_error([&] { planner.add(*plan, a, kept_window(4, 1, 1), per_head, stats); },
               errc::invalid_argument, "different granularities (1 and 2 tables)");
  CHECK(plan->pinned.size() == pinned);  // nothing acquired for the refused sequence
  planner.close(std::move(plan));
  for (const slot_id s : a.blocks) {
    CHECK_NOTHROW(sched.forget(s));
  }
}

TEST_CASE("cache::step_planner: a miss the scheduler skips is left out of the table") {
  rig r;
  scheduler_for<skip_on_miss> sched(r.fast, r.slow, r.engine);
  cache::step_planner planner(sched);
  const cache::layer_blocks a = layer(12, {5, 6, 7, 8, 9, 10});
  // Blocks 0 and 5 (the kept window) are staged ahead; block 3 is not, and is skipped.
  selection ahead = one_table({});
  planner.prefetch(a.blocks, kept_window(6, 1, 1), ahead);
  sched.drain();
  cache_stats stats;
  auto plan = planner.open();
  selection sel = one_table({3});
  planner.add(*plan, a, kept_window(6, 1, 1), sel, stats);
  CHECK(plan->offsets == std::vector<std::uint32_t>{0, 2});
  CHECK(plan->refs[0].index == 0);
  CHECK(plan->refs[1].index == 5);
  CHECK(r.holds(plan->refs[0].slot, 5));
  CHECK(r.holds(plan->refs[1].slot, 10));
  CHECK(stats.step.hits == 2);
  CHECK(stats.selected_blocks == 3);  // selected, even where skipped
  planner.close(std::move(plan));
  sched.check_invariants();
}

TEST_CASE("cache::step_planner: admit stages the kept full blocks, or every full block") {
  rig r;
  scheduler_for<skip_on_miss> sched(r.fast, r.slow, r.engine);
  cache::step_planner planner(sched);
  const std::vector<slot_id> blocks{11, 12, 13, 14, 15};  // 9 tokens: 4 full blocks and a partial
  planner.admit(blocks, kept_window(5, 1, 2), 4, admission_mode::selective);
  sched.drain();
  std::set<slot_id> staged;
  for (const slot_id s : blocks) {
    if (sched.settle(s)) {
      staged.insert(s);
    }
  }
  CHECK(staged == std::set<slot_id>{11, 14});  // sink 0, recent 3 (4 is partial: left alone)
  planner.admit(blocks, kept_window(5, 1, 2), 4, admission_mode::full);
  sched.drain();
  for (std::size_t b = 0; b < 4; ++b) {
    CHECK(sched.settle(blocks[b]).has_value());
  }
  CHECK_FALSE(sched.settle(15).has_value());
}

TEST_CASE("cache::step_planner: plans are the cache's, one per step running, reused") {
  rig r;
  scheduler_for<fetch_on_miss> sched(r.fast, r.slow, r.engine);
  cache::step_planner planner(sched);
  CHECK(planner.idle_plans() == 0);
  auto p1 = planner.open();
  auto p2 = planner.open();  // two steps at once (other sequences, other threads)
  CHECK(p1.get() != p2.get());
  const cache::step_plan* first = p1.get();
  const cache::step_plan* second = p2.get();
  planner.close(std::move(p1));
  planner.close(std::move(p2));
  CHECK(planner.idle_plans() == 2);
  const cache::layer_blocks a = layer(4, {1, 2});
  for (int step = 0; step < 50; ++step) {
    cache_stats stats;
    auto p = planner.open();
    CHECK((p.get() == first || p.get() == second));
    CHECK(p->refs.empty());
    CHECK(p->sequences() == 0);
    selection sel = one_table({0, 1});
    planner.add(*p, a, kept_window(2, 1, 1), sel, stats);
    planner.close(std::move(p));
  }
  CHECK(planner.idle_plans() == 2);
}
