// SPDX-License-Identifier: Apache-2.0
// tiered_kv_cache::truncate and fork of a prefix, against an independent model: a sequence
// built directly to the truncated length. From then on both take the same calls, and every
// selection (the blocks each attend read) and every output must be identical; the audit checks
// that no staged copy differs from the capacity tier. Shipped policies (lookahead over the
// default and the f16 min/max summaries, cpu::sparse_decode), host and block-I/O capacity
// tiers, forks sharing the cut block, and prefetches in flight while a truncate waits for them.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

#include "oasiskv/oasiskv.hpp"
#include "support/expect_error.hpp"
#include "support/gated_io_tier.hpp"

using namespace oasiskv;
using oasiskv::testing::expect_error;
using oasiskv::testing::gated_io_tier;

namespace {

template <class Summary, class Slow = host_tier>
struct shipped {
  using allocator = free_list_allocator;
  using fast_tier = host_tier;
  using slow_tier = Slow;
  using transfer = cpu_copy_engine;
  using predictor = lookahead_predictor<Summary>;
  using scheduler = lookahead_prefetcher<lru_eviction>;
  using kernel = cpu::sparse_decode;
};

const kv_layout layout{2, 4, 2, 32, 4, dtype::f16};  // 4-token blocks
const cache_options options{.budget_tokens = 24, .sink_blocks = 1, .recent_blocks = 1};

// The keys and values of token `t` in `layer`: a pure function of (t, layer), so that two
// sequences given the same tokens hold the same bytes. `[num_kv_heads][head_dim]` f16.
std::vector<f16> rows(std::uint32_t first, std::uint32_t n, std::uint32_t layer, bool value,
                      std::uint32_t salt = 0) {
  std::vector<f16> r(std::size_t{n} * layout.num_kv_heads * layout.head_dim);
  for (std::uint32_t t = 0; t < n; ++t) {
    std::mt19937 rng((first + t) * 7919u + layer * 131u + (value ? 17u : 0u) + salt * 100003u);
    std::normal_distribution<float> g(0.0f, 1.0f);
    for (std::size_t i = 0; i < std::size_t{layout.num_kv_heads} * layout.head_dim; ++i) {
      r[t * layout.num_kv_heads * layout.head_dim + i] = from_float<f16>(g(rng));
    }
  }
  return r;
}

// Appends tokens [first, first + n) to every layer of `s`.
template <class Cache>
void append_tokens(Cache& c, sequence_id s, std::uint32_t first, std::uint32_t n,
                   std::uint32_t salt = 0) {
  for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
    const auto k = rows(first, n, l, false, salt), v = rows(first, n, l, true, salt);
    c.append(s, l, k.data(), v.data(), n);
  }
}

std::vector<float> queries(std::uint32_t step, std::uint32_t layer, std::uint32_t n) {
  std::mt19937 rng(step * 31u + layer);
  std::normal_distribution<float> g(0.0f, 1.5f);
  std::vector<float> q(std::size_t{n} * layout.num_q_heads * layout.head_dim);
  for (float& x : q) {
    x = g(rng);
  }
  return q;
}

// What one decode step of `s` read and wrote: per layer, the blocks of its tables and its
// output.
struct step_record {
  std::vector<attended_blocks> blocks;
  std::vector<std::vector<float>> out;
};

// `steps` decode steps of one token each: append, attend (with the lookahead made by the step
// before), lookahead with the next step's queries. Token positions continue from `length`.
template <class Cache>
std::vector<step_record> decode(Cache& c, sequence_id s, std::uint32_t steps) {
  std::vector<step_record> records(steps);
  const std::uint32_t start = c.length(s, 0);
  for (std::uint32_t i = 0; i < steps; ++i) {
    append_tokens(c, s, start + i, 1);
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      const auto q = queries(start + i, l, 1);
      std::vector<float> out(q.size());
      attended_blocks seen;
      c.attend(std::span<const sequence_id>(&s, 1), l, q.data(), 1, out.data(), nullptr, &seen);
      records[i].blocks.push_back(seen);
      records[i].out.push_back(out);
      const auto next = queries(start + i + 1, l, 2);
      c.lookahead(s, l, {next.data(), nullptr, 2});
    }
  }
  return records;
}

void check_same(const std::vector<step_record>& got, const std::vector<step_record>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    for (std::size_t l = 0; l < got[i].blocks.size(); ++l) {
      CAPTURE(i);
      CAPTURE(l);
      CHECK(got[i].blocks[l].blocks == want[i].blocks[l].blocks);
      CHECK(got[i].blocks[l].offsets == want[i].blocks[l].offsets);
      REQUIRE(got[i].out[l].size() == want[i].out[l].size());
      bool identical = true;
      for (std::size_t x = 0; x < got[i].out[l].size(); ++x) {
        // Bit for bit: the same blocks, bytes and kernel. A NaN fails (NaN != NaN).
        identical = identical && got[i].out[l][x] == want[i].out[l][x];
      }
      CHECK(identical);
    }
  }
}

template <class Cache>
Cache make_cache(std::uint32_t capacity_slots = 256) {
  if constexpr (std::is_same_v<typename Cache::slow_tier_type, host_tier>) {
    return Cache(host_tier(layout, capacity_slots), host_tier(layout, 64), options);
  } else {
    return Cache(gated_io_tier(layout, capacity_slots), host_tier(layout, 64), options);
  }
}

}  // namespace

using default_host = shipped<qminmax_int2_summary>;
using minmax_host = shipped<minmax_summary<>>;
using default_file = shipped<qminmax_int2_summary, gated_io_tier>;

TEST_CASE_TEMPLATE("truncate: the cut sequence behaves as one built to that length", B,
                   default_host, minmax_host, default_file) {
  // Cut points mid-block, on a block boundary, inside the first block, to nothing, and a no-op.
  for (const std::uint32_t cut : {97u, 96u, 64u, 3u, 0u, 150u}) {
    CAPTURE(cut);
    auto cache = make_cache<tiered_kv_cache<B>>();
    const sequence_id a = cache.add_sequence();
    append_tokens(cache, a, 0, 120);  // 30 blocks per layer
    (void)decode(cache, a, 3);        // lookaheads made, blocks staged, then rejected
    cache.truncate(a, cut);
    const std::uint32_t kept = std::min(cut, 123u);
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      CHECK(cache.length(a, l) == kept);
      CHECK(cache.block_slots(a, l).size() == layout.blocks_for(kept));
    }
    const sequence_id b = cache.add_sequence();
    append_tokens(cache, b, 0, std::min(kept, 120u));
    if (kept > 120) {  // the 3 decoded tokens are kept too: give b the same ones
      for (std::uint32_t t = 120; t < kept; ++t) {
        append_tokens(cache, b, t, 1);
      }
    }
    if (kept == 0) {  // nothing to attend to yet: both start again from the same prompt
      append_tokens(cache, a, 0, 9);
      append_tokens(cache, b, 0, 9);
    }
    // a's last lookahead, made before the cut, is still pending (its blocks past the end are
    // dropped at attention): both predict afresh, from the same queries.
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      const auto next = queries(500, l, 2);
      cache.lookahead(a, l, {next.data(), nullptr, 2});
      cache.lookahead(b, l, {next.data(), nullptr, 2});
    }
    check_same(decode(cache, a, 6), decode(cache, b, 6));
    cache.drain();
    CHECK(cache.audit() > 0);
  }
}

TEST_CASE("truncate: a lookahead made before the cut still serves the next step") {
  auto cache = make_cache<tiered_kv_cache<default_host>>();
  const sequence_id a = cache.add_sequence();
  append_tokens(cache, a, 0, 120);
  (void)decode(cache, a, 2);  // the last step's lookahead stays pending
  const cache_stats before = cache.stats();
  cache.truncate(a, 60);
  const auto steps = decode(cache, a, 1);
  CHECK(cache.stats().unpredicted == before.unpredicted);  // the pending selection was used
  for (const attended_blocks& seen : steps[0].blocks) {
    for (const std::uint32_t b : seen.blocks) {
      CHECK(b < layout.blocks_for(61));  // nothing past the cut
    }
  }
}

TEST_CASE("truncate: a fork's shared blocks and summaries stay as they were") {
  auto cache = make_cache<tiered_kv_cache<default_host>>();
  const sequence_id parent = cache.add_sequence();
  append_tokens(cache, parent, 0, 90);
  const sequence_id child = cache.fork(parent);
  const std::vector<slot_id> shared = cache.block_slots(parent, 0);
  cache.truncate(child, 45);  // mid-block: the child gets its own copy of block 11
  const std::vector<slot_id> child_slots = cache.block_slots(child, 0);
  REQUIRE(child_slots.size() == 12);
  CHECK(std::equal(child_slots.begin(), child_slots.begin() + 11, shared.begin()));
  CHECK(child_slots[11] != shared[11]);
  CHECK(cache.block_slots(parent, 0) == shared);
  CHECK(cache.length(parent, 1) == 90);

  // The parent decodes as a sequence that never had a fork; the child as one built to 45.
  const sequence_id parent_model = cache.add_sequence();
  append_tokens(cache, parent_model, 0, 90);
  const sequence_id child_model = cache.add_sequence();
  append_tokens(cache, child_model, 0, 45);
  check_same(decode(cache, parent, 4), decode(cache, parent_model, 4));
  check_same(decode(cache, child, 4), decode(cache, child_model, 4));

  // A prefix fork is a fork then a truncate.
  const sequence_id prefix = cache.fork(parent, 30);
  const sequence_id prefix_model = cache.add_sequence();
  append_tokens(cache, prefix_model, 0, 30);
  check_same(decode(cache, prefix, 3), decode(cache, prefix_model, 3));
  cache.drain();
  CHECK(cache.audit() > 0);

  expect_error([&] { cache.truncate(sequence_id{999}, 3); }, errc::unknown_sequence,
               "truncate: sequence 999");
}

TEST_CASE("truncate: all or nothing when the cut block cannot be copied") {
  // 2 layers x 6 blocks fill the 12-slot capacity tier: a fork's truncate then has no slot for
  // its private copies of the cut blocks.
  tiered_kv_cache<default_host> cache(host_tier(layout, 12), host_tier(layout, 12),
                                      {.budget_tokens = 12});
  const sequence_id a = cache.add_sequence();
  append_tokens(cache, a, 0, 24);
  const sequence_id b = cache.fork(a);
  expect_error([&] { cache.truncate(b, 10); }, errc::capacity_exceeded,
               "no capacity slot left to copy shared block 2");
  CHECK(cache.length(b, 0) == 24);
  CHECK(cache.length(b, 1) == 24);
  CHECK(cache.block_slots(b, 1) == cache.block_slots(a, 1));
  CHECK_NOTHROW(cache.audit());
  // A cut on a block boundary needs no copy.
  cache.truncate(b, 8);
  CHECK(cache.length(b, 0) == 8);
  expect_error([&] { (void)cache.fork(a, 10); }, errc::capacity_exceeded, "no capacity slot");
  CHECK(cache.num_sequences() == 2);  // the refused prefix fork left nothing behind
  CHECK_NOTHROW(cache.audit());
}

TEST_CASE("truncate: prefetches in flight are waited for and never served after the cut") {
  auto cache = make_cache<tiered_kv_cache<default_file>>();
  const sequence_id a = cache.add_sequence();
  append_tokens(cache, a, 0, 120);
  (void)decode(cache, a, 1);
  cache.drain();
  // The next lookahead's prefetches stay in flight: the capacity tier holds its reads.
  cache.capacity_tier().set_open(false);
  const std::uint64_t before = cache.stats().bytes_prefetched;
  for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
    const auto q = queries(900, l, 2);
    cache.lookahead(a, l, {q.data(), nullptr, 2});
  }
  REQUIRE(cache.stats().bytes_prefetched > before);  // reads were submitted, and wait
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    cache.capacity_tier().set_open(true);
  });
  cache.truncate(a, 50);  // waits for the reads of the blocks it drops
  opener.join();
  // The freed capacity slots take new tokens (other bytes): a stale staged copy of one would
  // now differ from the capacity tier, which the audit and the model below would see.
  append_tokens(cache, a, 50, 40, /*salt=*/1);
  const sequence_id model = cache.add_sequence();
  append_tokens(cache, model, 0, 50);
  append_tokens(cache, model, 50, 40, /*salt=*/1);
  for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
    const auto q = queries(901, l, 2);
    cache.lookahead(a, l, {q.data(), nullptr, 2});
    cache.lookahead(model, l, {q.data(), nullptr, 2});
  }
  check_same(decode(cache, a, 4), decode(cache, model, 4));
  cache.drain();
  CHECK(cache.audit() > 0);
}
