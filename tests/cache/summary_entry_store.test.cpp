// SPDX-License-Identifier: Apache-2.0
// cache::summary_entry_store: which summary entry each capacity slot in use has, checked against
// a model of the slots held, the runs of entries a layer's blocks get, a failed growth, and the
// store's own audit.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <new>
#include <random>
#include <set>
#include <span>
#include <vector>

#include "oasiskv/cache/summary_entry_store.hpp"
#include "oasiskv/summary/minmax_summary.hpp"
#include "support/expect_error.hpp"

using namespace oasiskv;
using oasiskv::testing::expect_error;

namespace {

const kv_layout layout{1, 2, 1, 8, 4, dtype::f32};

// A summary that records what the store asks of it: the tokens folded into each entry since its
// last reset (-1: never reset), how often it grew, and a switch that makes `grow` fail.
template <bool Growable, std::uint32_t Tile = 16>
struct recording_summary {
  static constexpr std::uint32_t entries_per_tile = Tile;
  recording_summary(const kv_layout&, std::uint32_t capacity) : tokens(capacity, -1) {}
  std::uint32_t capacity() const noexcept { return static_cast<std::uint32_t>(tokens.size()); }
  void reset(std::uint32_t b) { tokens.at(b) = 0; }
  void update(std::uint32_t b, const std::byte*, std::uint32_t, std::uint32_t count) {
    REQUIRE(tokens.at(b) >= 0);  // updates only an entry that was reset
    tokens.at(b) += count;
  }
  void score(std::uint32_t, std::span<const std::uint32_t>, const float*, std::uint32_t,
             float*) const {}
  std::size_t bytes_per_block() const { return 10; }
  void grow(std::uint32_t n) requires Growable {
    if (fail_grow) {
      throw std::bad_alloc();
    }
    REQUIRE(n > tokens.size());
    tokens.resize(n, -1);
    ++grows;
  }
  std::vector<int> tokens;
  int grows = 0;
  bool fail_grow = false;
};
using compact_summary = recording_summary<true>;
using fixed_summary = recording_summary<false>;

static_assert(cache::summary_entry_store<compact_summary>::compact);
static_assert(!cache::summary_entry_store<fixed_summary>::compact);
static_assert(cache::summary_entry_store<recording_summary<true, 8>>::run == 8);
static_assert(cache::summary_entry_store<minmax_summary<>>::compact);

// The store's invariants against the model's set of held slots: each held slot has its own entry
// within the store, no free slot has one, and the audit agrees.
template <class Store>
void check_against(const Store& store, std::uint32_t num_slots, const std::set<slot_id>& held) {
  std::set<std::uint32_t> entries;
  for (slot_id s = 0; s < num_slots; ++s) {
    const std::uint32_t e = store.entry(s);
    if (held.count(s) != 0) {
      REQUIRE(e < store.summaries().capacity());
      REQUIRE(entries.insert(e).second);
    } else {
      REQUIRE(e == Store::no_entry);
    }
  }
  CHECK(store.in_use() == held.size());
  CHECK(store.summaries().capacity() <= num_slots);
  store.check([&](slot_id s) { return held.count(s) != 0 ? 1u : 0u; });
}

}  // namespace

TEST_CASE("summary_entry_store: a compact store matches a model over random binds and unbinds") {
  constexpr std::uint32_t num_slots = 300;
  cache::summary_entry_store<compact_summary> store(layout, num_slots);
  CHECK(store.summaries().capacity() == 64);  // starts small
  std::mt19937 rng(7);
  std::set<slot_id> held;
  std::vector<std::vector<slot_id>> chains(4);  // four (sequence, layer) block lists
  for (int op = 0; op < 20000; ++op) {
    const bool bind = held.size() < num_slots && (held.empty() || rng() % 3 != 0);
    auto& chain = chains[rng() % chains.size()];
    if (bind) {
      slot_id s = 0;
      do {
        s = static_cast<slot_id>(rng() % num_slots);
      } while (held.count(s) != 0);
      const slot_id after = chain.empty() ? null_slot : chain.back();
      store.bind(s, after);
      REQUIRE(store.summaries().tokens[store.entry(s)] == 0);  // an empty entry
      const auto n = static_cast<std::uint32_t>(1 + rng() % 4);
      store.update(s, nullptr, 0, n);
      REQUIRE(store.summaries().tokens[store.entry(s)] == static_cast<int>(n));
      held.insert(s);
      chain.push_back(s);
    } else if (!chain.empty()) {
      // Drops a random block of the chain (a sequence removed, an append undone, a COW copy).
      const std::size_t i = rng() % chain.size();
      const slot_id s = chain[i];
      chain.erase(chain.begin() + static_cast<std::ptrdiff_t>(i));
      store.unbind(s);
      store.unbind(s);  // a second unbind is a no-op
      held.erase(s);
    }
    if (op % 97 == 0) {
      check_against(store, num_slots, held);
    }
  }
  check_against(store, num_slots, held);
  for (auto& chain : chains) {
    for (const slot_id s : chain) {
      store.unbind(s);
    }
  }
  check_against(store, num_slots, {});
}

TEST_CASE("summary_entry_store: a layer's blocks fill whole tiles while layers interleave") {
  // Four layers append a block each in turn, as a decode step does: each layer's entries must
  // run consecutively inside a tile and start on a tile boundary, so that scoring one layer
  // reads ceil(blocks / 16) tiles rather than one tile per block.
  constexpr std::uint32_t layers = 4, blocks = 40, run = 16;
  cache::summary_entry_store<compact_summary> store(layout, 1000);
  std::vector<std::vector<slot_id>> chain(layers);
  slot_id next = 0;
  for (std::uint32_t b = 0; b < blocks; ++b) {
    for (std::uint32_t l = 0; l < layers; ++l) {
      const slot_id s = next++;
      store.bind(s, chain[l].empty() ? null_slot : chain[l].back());
      chain[l].push_back(s);
    }
  }
  for (std::uint32_t l = 0; l < layers; ++l) {
    std::vector<std::uint32_t> scratch;
    const auto e = store.entries_of(chain[l], scratch);
    REQUIRE(e.size() == blocks);
    CHECK(e[0] % run == 0);
    std::set<std::uint32_t> tiles;
    for (std::uint32_t b = 0; b < blocks; ++b) {
      tiles.insert(e[b] / run);
      if (b + 1 < blocks && (e[b] + 1) % run != 0) {
        CHECK(e[b + 1] == e[b] + 1);
      }
    }
    CHECK(tiles.size() == (blocks + run - 1) / run);
  }
  // A layer removed frees whole tiles; a new layer's run starts on one of them.
  std::set<std::uint32_t> freed;
  for (const slot_id s : chain[1]) {
    freed.insert(store.entry(s) / run);
    store.unbind(s);
  }
  const std::uint32_t cap = store.summaries().capacity();
  store.bind(next);
  CHECK(store.entry(next) % run == 0);
  CHECK(freed.count(store.entry(next) / run) == 1);
  CHECK(store.summaries().capacity() == cap);  // reused, not grown
}

TEST_CASE("summary_entry_store: reserve makes the next binds allocation-free") {
  cache::summary_entry_store<compact_summary> store(layout, 500);
  store.reserve(200);
  const int grows = store.summaries().grows;
  const std::uint32_t cap = store.summaries().capacity();
  CHECK(cap >= 200);
  for (slot_id s = 0; s < 200; ++s) {
    store.bind(s, s % 10 == 0 ? null_slot : s - 1, /*may_grow=*/false);
  }
  CHECK(store.summaries().grows == grows);
  CHECK(store.summaries().capacity() == cap);
  std::set<slot_id> held;
  for (slot_id s = 0; s < 200; ++s) {
    held.insert(s);
  }
  check_against(store, 500, held);
}

TEST_CASE("summary_entry_store: a bind whose growth fails leaves the store as it was") {
  constexpr std::uint32_t num_slots = 200;
  cache::summary_entry_store<compact_summary> store(layout, num_slots);
  std::set<slot_id> held;
  slot_id s = 0;
  for (; s < 64; ++s) {  // fills the initial 64 entries: four runs of a tile each
    store.bind(s, s % 16 == 0 ? null_slot : s - 1);
    held.insert(s);
  }
  check_against(store, num_slots, held);
  const std::uint32_t cap = store.summaries().capacity();
  store.summaries().fail_grow = true;
  CHECK_THROWS_AS(store.bind(s), std::bad_alloc);
  CHECK(store.entry(s) == decltype(store)::no_entry);
  CHECK(store.summaries().capacity() == cap);
  check_against(store, num_slots, held);
  store.summaries().fail_grow = false;
  store.bind(s);
  held.insert(s);
  CHECK(store.summaries().capacity() > cap);
  check_against(store, num_slots, held);
}

TEST_CASE("summary_entry_store: the audit names a slot whose entry disagrees with its holders") {
  cache::summary_entry_store<compact_summary> store(layout, 100);
  store.bind(3);
  store.bind(4, 3);
  store.check([](slot_id s) { return s == 3 || s == 4 ? 1u : 0u; });
  // The allocator says slot 5 is held, but it has no entry.
  expect_error([&] { store.check([](slot_id s) { return s >= 3 && s <= 5 ? 1u : 0u; }); },
               errc::invalid_argument, "capacity slot 5 (1 holders) has summary entry none");
  // The allocator says slot 4 is free, but it still has an entry.
  expect_error([&] { store.check([](slot_id s) { return s == 3 ? 1u : 0u; }); },
               errc::invalid_argument, "capacity slot 4 (0 holders) has summary entry 1");
}

TEST_CASE("summary_entry_store: a non-growable summary has one entry per slot, the slot") {
  cache::summary_entry_store<fixed_summary> store(layout, 50);
  CHECK(store.summaries().capacity() == 50);
  CHECK(store.bytes() == 50 * 10);
  store.bind(17, 16);
  CHECK(store.entry(17) == 17);
  CHECK(store.summaries().tokens[17] == 0);
  store.update(17, nullptr, 0, 5);
  CHECK(store.summaries().tokens[17] == 5);
  store.resummarize(17, nullptr, 2);
  CHECK(store.summaries().tokens[17] == 2);
  const std::vector<slot_id> slots{9, 17, 3};
  std::vector<std::uint32_t> scratch;
  const auto e = store.entries_of(slots, scratch);
  CHECK(e.data() == slots.data());  // the slots themselves: no copy
  CHECK(scratch.empty());
}

TEST_CASE("summary_entry_store: no summary stores nothing") {
  cache::summary_entry_store<no_summary> store(layout, 50);
  CHECK(store.bytes() == 0);
  store.bind(3);
  store.unbind(3);
  CHECK(store.in_use() == 0);
  expect_error([] { cache::summary_entry_store<no_summary>(kv_layout{}, 4); }, errc::invalid_layout,
               "kv_layout.num_layers = 0");
}

TEST_CASE("summary_entry_store: a real summary's entries follow their slots") {
  // minmax_summary through the store: a block's bounds land in its slot's entry and score
  // against that entry only.
  const kv_layout l{1, 1, 1, 8, 4, dtype::f32};
  cache::summary_entry_store<minmax_summary<>> store(l, 300);
  std::vector<float> block(l.block_bytes() / sizeof(float), 0.0f);
  std::vector<std::pair<slot_id, float>> filled;
  for (slot_id s = 0; s < 100; ++s) {
    const slot_id slot = 299 - 3 * s % 300;  // scattered slots
    store.bind(slot, filled.empty() ? null_slot : filled.back().first);
    const float key = static_cast<float>(s + 1);
    std::fill(block.begin(), block.end(), key);
    store.update(slot, reinterpret_cast<const std::byte*>(block.data()), 0, l.tokens_per_block);
    filled.emplace_back(slot, key);
  }
  std::vector<slot_id> slots;
  for (const auto& [slot, key] : filled) {
    slots.push_back(slot);
  }
  std::vector<std::uint32_t> scratch;
  const auto entries = store.entries_of(slots, scratch);
  const std::vector<float> q(l.head_dim, 1.0f);
  std::vector<float> out(entries.size());
  store.summaries().score(0, entries, q.data(), 1, out.data());
  for (std::size_t i = 0; i < filled.size(); ++i) {
    // dot(q, k) = head_dim * key; the f16 upper bound rounds up by at most a relative 2^-10.
    const float want = static_cast<float>(l.head_dim) * filled[i].second;
    CHECK(out[i] >= want);
    CHECK(out[i] <= want * (1.0f + 1.0f / 512));
  }
}
