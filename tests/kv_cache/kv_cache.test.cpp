// SPDX-License-Identifier: Apache-2.0
#include <doctest/doctest.h>

#include "support/expect_error.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "oasiskv/oasiskv.hpp"
#include "support/gated_io_tier.hpp"
#include "support/kv_fixture.hpp"
#include "support/test_predictors.hpp"

using namespace oasiskv;
using oasiskv::testing::exact_max_predictor;
using oasiskv::testing::select_all_predictor;

namespace {

template <class Scheduler, class Predictor>
struct bundle {
  using allocator = free_list_allocator;
  using fast_tier = host_tier;
  using slow_tier = host_tier;
  using transfer = cpu_copy_engine;
  using predictor = Predictor;
  using scheduler = Scheduler;
  using kernel = reference_decode;
};

using oasiskv::testing::expect_error;

// Random KV of `n` tokens for one layer: [n][num_kv_heads][head_dim] of the layout's dtype.
std::vector<std::byte> random_rows(const kv_layout& l, std::uint32_t n, std::mt19937& rng) {
  std::vector<std::byte> rows(std::size_t{n} * l.num_kv_heads * l.row_bytes());
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  visit_dtype(l.kv_dtype, [&](auto e) {
    using T = decltype(e);
    T* p = reinterpret_cast<T*>(rows.data());
    for (std::size_t i = 0; i < rows.size() / sizeof(T); ++i) {
      p[i] = from_float<T>(u(rng));
    }
  });
  return rows;
}

template <class Cache>
void append_random(Cache& c, sequence_id s, std::uint32_t n, std::mt19937& rng) {
  for (std::uint32_t layer = 0; layer < c.layout().num_layers; ++layer) {
    auto k = random_rows(c.layout(), n, rng);
    auto v = random_rows(c.layout(), n, rng);
    c.append(s, layer, k.data(), v.data(), n);
  }
}

// One block of the capacity tier, wherever it lives (memory or a file).
template <class Cache>
void read_capacity_block(Cache& c, slot_id slot, std::byte* dst) {
  if constexpr (host_accessible_tier<std::remove_cvref_t<decltype(c.capacity_tier())>>) {
    std::memcpy(dst, c.capacity_tier().slot_data(slot), c.layout().block_bytes());
  } else {
    c.capacity_tier().read_block(slot, dst);
  }
}

// Attention over exactly `blocks`'s blocks of (s, layer), read from the capacity tier into a host
// copy (the capacity tier may be a file): what a sparse attend must equal.
template <class Cache>
void reference_over_attended(Cache& c, sequence_id s, std::uint32_t layer,
                             const attended_blocks& blocks, const float* q, std::uint32_t q_len,
                             float* out, float* lse) {
  const auto slots = c.block_slots(s, layer);
  host_tier copy(c.layout(),
                 static_cast<std::uint32_t>(std::max<std::size_t>(1, blocks.blocks.size())));
  std::vector<block_ref> refs;
  for (std::uint32_t i = 0; i < blocks.blocks.size(); ++i) {
    const std::uint32_t b = blocks.blocks[i];
    read_capacity_block(c, slots[b], copy.slot_data(i));
    refs.push_back({i, b});
  }
  const std::uint32_t len = c.length(s, layer);
  decode_params p{q,    copy.view(), {refs.data(), blocks.offsets.data(), 1, blocks.tables_per_seq},
                  &len, out,         lse,
                  1,    q_len,       1.0f / std::sqrt(static_cast<float>(c.layout().head_dim))};
  reference_decode{}.decode(p);
}

// Dense attention over the capacity tier, the definition `attend` must match.
template <class Cache>
void dense_reference(Cache& c, sequence_id s, std::uint32_t layer, const float* q,
                     std::uint32_t q_len, float* out, float* lse) {
  attended_blocks all;
  all.blocks.resize(c.block_slots(s, layer).size());
  for (std::uint32_t b = 0; b < all.blocks.size(); ++b) {
    all.blocks[b] = b;
  }
  all.offsets = {0, static_cast<std::uint32_t>(all.blocks.size())};
  all.tables_per_seq = 1;
  reference_over_attended(c, s, layer, all, q, q_len, out, lse);
}

std::vector<float> random_queries(const kv_layout& l, std::uint32_t n, std::mt19937& rng) {
  std::vector<float> q(std::size_t{n} * l.num_q_heads * l.head_dim);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (float& x : q) {
    x = u(rng);
  }
  return q;
}

const kv_layout tiny{2, 4, 2, 8, 4, dtype::f16};

}  // namespace

using all_lru = bundle<lookahead_prefetcher<lru_eviction>, select_all_predictor>;
using all_score = bundle<lookahead_prefetcher<score_eviction>, select_all_predictor>;
using all_on_demand = bundle<on_demand_fetcher<>, select_all_predictor>;
using all_resident_dense = bundle<all_resident, select_all_predictor>;
using exact_lru = bundle<lookahead_prefetcher<lru_eviction>, exact_max_predictor>;

TEST_CASE_TEMPLATE("tiered_kv_cache: a budget covering the context equals dense attention", B,
                   all_lru, all_score, all_on_demand, all_resident_dense, exact_lru) {
  std::mt19937 rng(5);
  tiered_kv_cache<B> cache(host_tier(tiny, 256), host_tier(tiny, 128),
                           {.budget_tokens = 128, .sink_blocks = 1, .recent_blocks = 1});
  const sequence_id a = cache.add_sequence(), b = cache.add_sequence();
  append_random(cache, a, 37, rng);  // bulk prefill, partial last block
  append_random(cache, b, 5, rng);
  for (int step = 0; step < 6; ++step) {
    for (sequence_id s : {a, b}) {
      const std::uint32_t q_len = 1 + static_cast<std::uint32_t>(rng() % 3);
      append_random(cache, s, q_len, rng);  // the new tokens, then attention over them
      for (std::uint32_t layer = 0; layer < tiny.num_layers; ++layer) {
        auto draft = random_queries(tiny, 2, rng);
        cache.lookahead(s, layer, {draft.data(), nullptr, 2});
        auto q = random_queries(tiny, q_len, rng);
        std::vector<float> out(q.size()), lse(q_len * tiny.num_q_heads);
        std::vector<float> ref_out(q.size()), ref_lse(lse.size());
        const sequence_id one[1] = {s};
        cache.attend(one, layer, q.data(), q_len, out.data(), lse.data());
        dense_reference(cache, s, layer, q.data(), q_len, ref_out.data(), ref_lse.data());
        REQUIRE(oasiskv::testing::max_rel_error(out, ref_out) < 1e-6);
        REQUIRE(oasiskv::testing::max_rel_error(lse, ref_lse) < 1e-6);
      }
    }
  }
  CHECK(cache.audit() > 0);
  const cache_stats st = cache.stats();
  CHECK(st.sequence_steps == 2 * 6 * tiny.num_layers);
  CHECK(st.unpredicted == 0);
  CHECK(st.predict_seconds > 0.0);  // every step predicted, ahead or at attention
  if constexpr (std::is_same_v<B, all_on_demand>) {
    CHECK(st.bytes_prefetched == 0);
  } else {
    CHECK(st.step.hits > st.step.misses);  // staged ahead: later steps find their blocks
  }
}

TEST_CASE("tiered_kv_cache: batched attend of several sequences equals one at a time") {
  std::mt19937 rng(8);
  tiered_kv_cache<exact_lru> cache(host_tier(tiny, 256), host_tier(tiny, 64),
                                   {.budget_tokens = 16});
  std::vector<sequence_id> seqs;
  for (int i = 0; i < 3; ++i) {
    seqs.push_back(cache.add_sequence());
    append_random(cache, seqs.back(), 20 + 9 * i, rng);
  }
  auto q = random_queries(tiny, 3, rng);  // one query token per sequence
  std::vector<float> batched(q.size()), single(q.size());
  cache.attend(seqs, 1, q.data(), 1, batched.data());
  for (std::size_t i = 0; i < 3; ++i) {
    const sequence_id one[1] = {seqs[i]};
    const std::size_t row = tiny.num_q_heads * tiny.head_dim;
    cache.attend(one, 1, q.data() + i * row, 1, single.data() + i * row);
  }
  CHECK(batched == single);
}

TEST_CASE_TEMPLATE("tiered_kv_cache: a batched lookahead predicts what one per sequence does", P,
                   lookahead_predictor<minmax_summary<>>, exact_max_predictor) {
  // Two caches fed the same tokens; one predicts sequence by sequence, the other in one call
  // (the predictor's select_many on a pool where it has one, else in turn). The next attend must
  // read the same blocks and give the same outputs, with a budget well below the contexts.
  using B = bundle<lookahead_prefetcher<lru_eviction>, P>;
  cpu::thread_pool pool(2);
  const auto make = [] {
    return tiered_kv_cache<B>(host_tier(tiny, 256), host_tier(tiny, 96), {.budget_tokens = 16});
  };
  tiered_kv_cache<B> one = make(), many = make();
  if constexpr (requires { many.predictor().set_thread_pool(&pool); }) {
    many.predictor().set_thread_pool(&pool);
  }
  std::vector<sequence_id> seqs;
  for (int i = 0; i < 3; ++i) {
    seqs.push_back(one.add_sequence());
    REQUIRE(many.add_sequence() == seqs.back());
    std::mt19937 a(50 + i), b(50 + i);
    append_random(one, seqs.back(), 30 + 11 * i, a);
    append_random(many, seqs.back(), 30 + 11 * i, b);
  }
  std::mt19937 rng(9);
  const std::size_t row = std::size_t{tiny.num_q_heads} * tiny.head_dim;
  for (std::uint32_t layer = 0; layer < tiny.num_layers; ++layer) {
    auto q = random_queries(tiny, 3 * 2, rng);  // 2 lookahead tokens per sequence
    for (std::size_t i = 0; i < 3; ++i) {
      one.lookahead(seqs[i], layer, query_view{q.data() + i * 2 * row, nullptr, 2});
    }
    many.lookahead(seqs, layer, q.data(), 2);
    CHECK(many.stats().lookaheads == one.stats().lookaheads);
    auto qa = random_queries(tiny, 1, rng);
    for (std::size_t i = 0; i < 3; ++i) {
      CAPTURE(layer);
      CAPTURE(i);
      const sequence_id s[1] = {seqs[i]};
      std::vector<float> out_one(row), out_many(row);
      attended_blocks got_one, got_many;
      one.attend(s, layer, qa.data(), 1, out_one.data(), nullptr, &got_one);
      many.attend(s, layer, qa.data(), 1, out_many.data(), nullptr, &got_many);
      CHECK(got_many.blocks == got_one.blocks);
      CHECK(got_one.blocks.size() < tiny.blocks_for(many.length(seqs[i], layer)));
      CHECK(out_many == out_one);
    }
  }
  CHECK(many.audit() > 0);
  // A repeated or unknown sequence, or no queries: an error naming it.
  auto q = random_queries(tiny, 2, rng);
  const sequence_id twice[2] = {seqs[0], seqs[0]};
  CHECK_THROWS_WITH_AS(many.lookahead(twice, 0, q.data(), 1),
                       doctest::Contains("appears more than once"), oasiskv::error);
  const sequence_id unknown[2] = {seqs[0], sequence_id{999}};
  CHECK_THROWS_WITH_AS(many.lookahead(unknown, 0, q.data(), 1), doctest::Contains("999"),
                       oasiskv::error);
  CHECK_THROWS_WITH_AS(many.lookahead(seqs, 0, nullptr, 1), doctest::Contains("null queries"),
                       oasiskv::error);
}

TEST_CASE("tiered_kv_cache: fork shares the prefix and copies the partial block on write") {
  std::mt19937 rng(3);
  tiered_kv_cache<all_lru> cache(host_tier(tiny, 64), host_tier(tiny, 64), {.budget_tokens = 64});
  const sequence_id parent = cache.add_sequence();
  append_random(cache, parent, 10, rng);  // blocks 0, 1 full; block 2 holds 2 tokens
  auto q = random_queries(tiny, 1, rng);
  std::vector<float> before(q.size()), after(q.size());
  const sequence_id p1[1] = {parent};
  cache.attend(p1, 0, q.data(), 1, before.data());

  const sequence_id child = cache.fork(parent);
  CHECK(cache.block_slots(child, 0) == cache.block_slots(parent, 0));
  append_random(cache, child, 3, rng);  // copy-on-write of block 2 for the child only
  const auto ps = cache.block_slots(parent, 0), cs = cache.block_slots(child, 0);
  CHECK(ps[0] == cs[0]);
  CHECK(ps[1] == cs[1]);
  CHECK(ps[2] != cs[2]);
  CHECK(cache.length(parent) == 10);
  CHECK(cache.length(child) == 13);
  cache.attend(p1, 0, q.data(), 1, after.data());
  CHECK(before == after);  // the parent never sees the child's tokens
  // The child attends over the shared prefix and its own tokens, as dense would.
  std::vector<float> out(q.size()), ref(q.size()), lse(tiny.num_q_heads), ref_lse(lse.size());
  const sequence_id c1[1] = {child};
  cache.attend(c1, 0, q.data(), 1, out.data(), lse.data());
  dense_reference(cache, child, 0, q.data(), 1, ref.data(), ref_lse.data());
  CHECK(oasiskv::testing::max_rel_error(out, ref) < 1e-6);
  cache.remove(parent);
  CHECK(cache.block_slots(child, 0)[0] == cs[0]);  // still held by the child
  cache.remove(child);
  CHECK(cache.num_sequences() == 0);
  CHECK(cache.audit() == 0);
}

TEST_CASE("tiered_kv_cache: bad input") {
  using C = tiered_kv_cache<exact_lru>;
  expect_error([] { C c(host_tier(tiny, 8), host_tier(tiny, 8), {.budget_tokens = 4}); },
               errc::invalid_argument, "budget_tokens = 4 (1 blocks) is smaller than");
  expect_error([] { C c(host_tier(tiny, 8), host_tier(tiny, 4), {.budget_tokens = 16}); },
               errc::invalid_argument,
               "fast tier's 4 slots cannot stage one selection of 4 blocks");
  // Adaptive budgets: a target in (0, 1], a cap of at least the budget that the fast tier holds.
  expect_error(
      [] {
        C c(host_tier(tiny, 8), host_tier(tiny, 8), {.budget_tokens = 16, .target_mass = 1.5f});
      },
      errc::invalid_argument, "target_mass = 1.5 must be 0");
  expect_error(
      [] {
        C c(host_tier(tiny, 8), host_tier(tiny, 8),
            {.budget_tokens = 16, .target_mass = std::numeric_limits<float>::quiet_NaN()});
      },
      errc::invalid_argument, "target_mass = nan");
  expect_error(
      [] {
        C c(host_tier(tiny, 8), host_tier(tiny, 8),
            {.budget_tokens = 16, .target_mass = 0.9f, .max_selected_blocks = 3});
      },
      errc::invalid_argument, "max_selected_blocks = 3 is below the budget of 4 blocks");
  expect_error(
      [] {
        C c(host_tier(tiny, 8), host_tier(tiny, 8),
            {.budget_tokens = 16, .target_mass = 0.9f, .max_selected_blocks = 8});
      },
      errc::invalid_argument, "fast tier's 8 slots cannot stage a selection of up to 8 blocks");
  {  // the default cap: twice the budget, within the fast tier
    C fits(host_tier(tiny, 8), host_tier(tiny, 6), {.budget_tokens = 16, .target_mass = 0.9f});
  }
  const kv_layout other{2, 4, 2, 16, 4, dtype::f16};
  expect_error([&] { C c(host_tier(tiny, 8), host_tier(other, 8), {.budget_tokens = 16}); },
               errc::layout_mismatch, "layouts differ");
  C c(host_tier(tiny, 16), host_tier(tiny, 8),
      {.budget_tokens = 16, .max_tokens_per_sequence = 40});
  std::mt19937 rng(1);
  const sequence_id s = c.add_sequence();
  append_random(c, s, 8, rng);
  auto q = random_queries(tiny, 1, rng);
  const sequence_id ghost{999};
  expect_error(
      [&] {
        c.lookahead(ghost, 0, {q.data(), nullptr, 1});
      },
      errc::unknown_sequence, "lookahead: sequence 999 is not in the cache");
  expect_error(
      [&] {
        c.lookahead(s, 0, {nullptr, nullptr, 1});
      },
      errc::invalid_argument, "null data");
  expect_error(
      [&] {
        c.lookahead(s, 0, {q.data(), nullptr, 0});
      },
      errc::invalid_argument, "got 0 tokens");
  expect_error(
      [&] {
        c.lookahead(s, 0, {q.data(), nullptr, 17});
      },
      errc::invalid_argument, "got 17 tokens");
  expect_error(
      [&] {
        c.lookahead(s, 2, {q.data(), nullptr, 1});
      },
      errc::out_of_range, "layer 2 is outside the model's 2 layers");
  auto rows = random_rows(tiny, 40, rng);
  expect_error([&] { c.append(s, 0, rows.data(), rows.data(), 33); }, errc::out_of_range,
               "would pass max_tokens_per_sequence = 40");
  std::vector<float> out(q.size() * 16);
  const sequence_id one[1] = {s};
  expect_error([&] { c.attend(one, 0, q.data(), 9, out.data()); }, errc::invalid_argument,
               "holds 8 tokens, fewer than q_len = 9");
  expect_error([&] { c.attend(one, 0, q.data(), 17, out.data()); }, errc::invalid_argument,
               "q_len = 17");
  // The capacity tier of 16 slots holds 8 blocks per layer at most: 2 layers x 8 = 16.
  const sequence_id t = c.add_sequence();
  append_random(c, t, 24, rng);  // 6 blocks per layer: 12 + 4 (sequence s) = 16 slots
  expect_error([&] { append_random(c, t, 4, rng); }, errc::capacity_exceeded,
               "capacity tier's 16 slots are all in use");
  // The refused appends left both sequences as they were, and every invariant holds.
  CHECK(c.length(s, 0) == 8);
  CHECK(c.length(t, 0) == 24);
  CHECK(c.length(t, 1) == 24);
  CHECK_NOTHROW(c.audit());
}

TEST_CASE("tiered_kv_cache: admission, dense vs OasisKV") {
  const kv_layout smollm2{30, 9, 3, 64, 16, dtype::f16};
  tiered_kv_cache<exact_lru> c(host_tier(smollm2, 64), host_tier(smollm2, 80),
                               {.budget_tokens = 1024});
  const std::uint64_t fast_bytes = std::uint64_t{8} << 30;
  const admission_report r = c.admission(32768, fast_bytes);
  CHECK(r.dense_bytes_per_sequence == 32768ull / 16 * 30 * smollm2.block_bytes());
  CHECK(r.oasis_bytes_per_sequence == 30ull * 2 * 64 * smollm2.block_bytes());
  CHECK(r.dense_sequences == fast_bytes / r.dense_bytes_per_sequence);
  CHECK(r.oasis_sequences >= 15 * r.dense_sequences);  // 32k context, 2 x 1k staged: 16x
}

namespace {

// What the concurrent test runs: the test's exact predictor over host tiers, and the shipped
// policies (lookahead over min/max or int8 min/max summaries, cpu::sparse_decode) over a host
// capacity tier and over a file_tier with write-behind.
template <class Summary, class Slow>
struct shipped_bundle {
  using allocator = free_list_allocator;
  using fast_tier = host_tier;
  using slow_tier = Slow;
  using transfer = cpu_copy_engine;
  using predictor = lookahead_predictor<Summary>;
  using scheduler = lookahead_prefetcher<lru_eviction>;
  using kernel = cpu::sparse_decode;
};
using shipped_minmax_file = shipped_bundle<minmax_summary<>, file_tier>;
using shipped_qminmax_host = shipped_bundle<quantized_minmax_summary, host_tier>;

template <class Slow>
Slow make_capacity(const kv_layout& l, std::uint32_t slots) {
  if constexpr (std::is_same_v<Slow, file_tier>) {
    return file_tier(l, slots, {.path = "/tmp", .write_behind = true});
  } else {
    return host_tier(l, slots);
  }
}

}  // namespace

TEST_CASE_TEMPLATE(
    "tiered_kv_cache: concurrent sequences, 100k operations, every attend exact, every invariant "
    "holds",
    B, exact_lru, shipped_minmax_file, shipped_qminmax_host) {
  // Threads own disjoint sequences (the documented contract) and share the cache, its tiers,
  // its scheduler and its copy engine. Every attend is checked against reference_decode over
  // the blocks it reports (read from the capacity tier), and against dense attention's mass.
  const kv_layout l{2, 2, 1, 8, 4, dtype::f32};
  tiered_kv_cache<B> cache(make_capacity<typename B::slow_tier>(l, 512), host_tier(l, 48),
                           {.budget_tokens = 12});
  constexpr int threads = 2;
  // A file capacity tier's references read every block through the file: fewer operations.
  constexpr int ops_per_thread = std::is_same_v<typename B::slow_tier, file_tier> ? 10000 : 50000;
  std::atomic<int> failures{0};
  std::atomic<std::uint64_t> checked{0}, sparse{0};
  auto worker = [&](int id) {
    std::mt19937 rng(100 + id);
    std::vector<sequence_id> mine;
    std::vector<float> out, lse, ref, ref_lse, dense, dense_lse;
    attended_blocks got;
    try {
      for (int op = 0; op < ops_per_thread; ++op) {
        const unsigned r = rng() % 100;
        if (mine.empty() || (r < 3 && mine.size() < 4)) {
          mine.push_back(cache.add_sequence());
          append_random(cache, mine.back(), 1 + rng() % 9, rng);
          continue;
        }
        const sequence_id s = mine[rng() % mine.size()];
        const std::uint32_t layer = rng() % l.num_layers;
        if (r < 5 && cache.length(s) > 48) {
          cache.remove(s);
          mine.erase(std::find(mine.begin(), mine.end(), s));
        } else if (r < 7 && mine.size() < 4) {
          mine.push_back(cache.fork(s));
        } else if (r < 40) {
          append_random(cache, s, 1 + rng() % 2, rng);
        } else if (r < 70) {
          auto draft = random_queries(l, 1 + rng() % 3, rng);
          cache.lookahead(
              s, layer,
              {draft.data(), nullptr,
               static_cast<std::uint32_t>(draft.size() / (l.num_q_heads * l.head_dim))});
        } else {
          auto q = random_queries(l, 1, rng);
          out.resize(q.size());
          lse.resize(l.num_q_heads);
          ref.resize(q.size());
          ref_lse.resize(l.num_q_heads);
          const sequence_id one[1] = {s};
          cache.attend(one, layer, q.data(), 1, out.data(), lse.data(), &got);
          reference_over_attended(cache, s, layer, got, q.data(), 1, ref.data(), ref_lse.data());
          const bool exact = oasiskv::testing::max_rel_error(out, ref) <= 1e-5 &&
                             oasiskv::testing::max_rel_error(lse, ref_lse) <= 1e-5;
          if (!exact) {
            ++failures;
          }
          if (got.blocks.size() < l.blocks_for(cache.length(s, layer))) {
            ++sparse;
          }
          if (r >= 95) {  // a subset never holds more softmax mass than dense attention
            dense.resize(q.size());
            dense_lse.resize(l.num_q_heads);
            dense_reference(cache, s, layer, q.data(), 1, dense.data(), dense_lse.data());
            for (std::uint32_t h = 0; h < l.num_q_heads; ++h) {
              if (!(lse[h] <= dense_lse[h] + 1e-4f)) {
                ++failures;
              }
            }
          }
          ++checked;
        }
      }
    } catch (const std::exception& e) {
      MESSAGE("worker " << id << ": " << e.what());
      ++failures;
    }
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back(worker, t);
  }
  std::thread auditor([&] {
    for (int i = 0; i < 20; ++i) {
      try {
        cache.audit();  // staged copies byte-equal to the capacity tier, bookkeeping consistent
      } catch (const std::exception& e) {
        MESSAGE("audit: " << e.what());
        ++failures;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  for (auto& t : pool) {
    t.join();
  }
  auditor.join();
  CHECK(failures == 0);
  CHECK(checked > std::uint64_t{ops_per_thread} / 5);
  CHECK(sparse > checked / 4);  // most steps attend a real subset, not the whole sequence
  CHECK(cache.audit() > 0);
  const cache_stats st = cache.stats();
  CHECK(st.resident_blocks <= 48);
  MESSAGE("steps " << st.sequence_steps << ", hit rate " << st.hit_rate() << ", evicted "
                   << st.blocks_evicted << " blocks, " << sparse << " of " << checked
                   << " attends sparse");
}

namespace {
// A summary that hides `grow`: the cache falls back to one entry per capacity slot.
template <class S>
struct slot_indexed : S {
  using S::S;
  void grow(std::uint32_t) = delete;
};
}  // namespace

TEST_CASE_TEMPLATE("tiered_kv_cache: summary entries only for the slots in use, same selections", S,
                   minmax_summary<>, mean_summary, int8_key_summary) {
  using compact =
      tiered_kv_cache<bundle<lookahead_prefetcher<lru_eviction>, lookahead_predictor<S>>>;
  using indexed = tiered_kv_cache<
      bundle<lookahead_prefetcher<lru_eviction>, lookahead_predictor<slot_indexed<S>>>>;
  static_assert(compact::compact_summaries && !indexed::compact_summaries);
  // A capacity tier far larger than the sequences: the compact store grows with the blocks in
  // use; both caches run the same operations and must select (and attend) identically, through
  // forks, copy-on-write, removals and entry reuse.
  const kv_layout l{2, 4, 2, 8, 4, dtype::f16};
  const cache_options opt{.budget_tokens = 16};
  compact a(host_tier(l, 4096), host_tier(l, 64), opt);
  indexed b(host_tier(l, 4096), host_tier(l, 64), opt);
  std::mt19937 rng(31);
  std::vector<sequence_id> seqs;  // the same ids in both caches
  std::vector<float> out_a, out_b, lse_a(l.num_q_heads), lse_b(l.num_q_heads);
  auto append_both = [&](sequence_id s, std::uint32_t n) {
    for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
      const auto k = random_rows(l, n, rng), v = random_rows(l, n, rng);
      a.append(s, layer, k.data(), v.data(), n);
      b.append(s, layer, k.data(), v.data(), n);
    }
  };
  std::size_t attends = 0;
  for (int op = 0; op < 3000; ++op) {
    const unsigned r = rng() % 100;
    if (seqs.empty() || (r < 4 && seqs.size() < 6)) {
      const sequence_id s = a.add_sequence();
      REQUIRE(b.add_sequence() == s);
      seqs.push_back(s);
      append_both(s, 1 + rng() % 40);
      continue;
    }
    const sequence_id s = seqs[rng() % seqs.size()];
    const std::uint32_t layer = rng() % l.num_layers;
    if (r < 7 && seqs.size() > 1) {
      a.remove(s);
      b.remove(s);
      seqs.erase(std::find(seqs.begin(), seqs.end(), s));
    } else if (r < 10 && seqs.size() < 6) {
      const sequence_id child = a.fork(s);
      REQUIRE(b.fork(s) == child);
      seqs.push_back(child);
    } else if (r < 45) {
      append_both(s, 1 + rng() % 3);
    } else if (r < 70) {
      const auto draft = random_queries(l, 1 + rng() % 4, rng);
      const query_view qv{draft.data(), nullptr,
                          static_cast<std::uint32_t>(draft.size() / (l.num_q_heads * l.head_dim))};
      a.lookahead(s, layer, qv);
      b.lookahead(s, layer, qv);
    } else {
      const auto q = random_queries(l, 1, rng);
      out_a.assign(q.size(), 0.0f);
      out_b.assign(q.size(), 1.0f);
      const sequence_id one[1] = {s};
      a.attend(one, layer, q.data(), 1, out_a.data(), lse_a.data());
      b.attend(one, layer, q.data(), 1, out_b.data(), lse_b.data());
      CHECK(std::memcmp(out_a.data(), out_b.data(), out_a.size() * sizeof(float)) == 0);
      CHECK(std::memcmp(lse_a.data(), lse_b.data(), lse_a.size() * sizeof(float)) == 0);
      ++attends;
    }
    if (op % 100 == 0) {
      a.audit();  // one entry per slot in use, none for a free slot, none lost
      b.audit();
    }
  }
  CHECK(attends > 500);
  const cache_stats sa = a.stats(), sb = b.stats();
  CHECK(sa.selected_blocks == sb.selected_blocks);
  CHECK(sa.step.hits == sb.step.hits);
  CHECK(sa.step.misses == sb.step.misses);
  CHECK(sa.selected_blocks < sa.sequence_steps * 8);  // the budget bit: not every block
  // The slot-indexed store covers all 4096 slots; the compact one what the sequences held.
  MESSAGE("summary bytes: compact " << a.summary_bytes() << ", one per slot " << b.summary_bytes());
  CHECK(a.summary_bytes() * 4 < b.summary_bytes());
}

namespace {
// A summary that remembers the entry ids of its last `score_rows` call (the predictor scores
// one (sequence, layer) at a time, on the calling thread).
template <class S>
struct recording : S {
  using S::S;
  static inline thread_local std::vector<std::uint32_t> last;
  void score_rows(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
                  std::uint32_t n, float* out) const {
    last.assign(entries.begin(), entries.end());
    S::score_rows(h, entries, q, n, out);
  }
};

std::size_t tiles_touched(const std::vector<std::uint32_t>& ids) {
  std::vector<std::uint32_t> t;
  for (const std::uint32_t e : ids) {
    t.push_back(e / 16);
  }
  std::sort(t.begin(), t.end());
  return static_cast<std::size_t>(std::unique(t.begin(), t.end()) - t.begin());
}
}  // namespace

TEST_CASE("tiered_kv_cache: a layer's decoded blocks keep consecutive summary entries") {
  // Decoding appends one token to every layer in turn, so with 20 layers the blocks of all
  // layers are allocated interleaved. A layer's entries must still run consecutively within
  // tiles of 16, which a summary scores with one pass each; interleaved, every block would
  // cost a tile of its own. Also after a sequence is removed and its entries are reused.
  using S = recording<minmax_summary<>>;
  static_assert(row_scoring_summary<S> && growable_summary<S>);
  using cache_type =
      tiered_kv_cache<bundle<lookahead_prefetcher<lru_eviction>, lookahead_predictor<S>>>;
  static_assert(cache_type::compact_summaries);
  const kv_layout l{20, 2, 1, 8, 4, dtype::f16};
  cache_type cache(host_tier(l, 20 * 256), host_tier(l, 20 * 8), cache_options{.budget_tokens = 8});
  std::mt19937 rng(5);
  std::vector<float> q(std::size_t{l.num_q_heads} * l.head_dim, 0.5f);
  for (int round = 0; round < 3; ++round) {
    CAPTURE(round);
    const sequence_id a = cache.add_sequence(), b = cache.add_sequence();
    for (std::uint32_t t = 0; t < 4 * 50; ++t) {  // 50 blocks per layer, two sequences
      for (const sequence_id s : {a, b}) {
        for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
          const auto k = random_rows(l, 1, rng), v = random_rows(l, 1, rng);
          cache.append(s, layer, k.data(), v.data(), 1);
        }
      }
    }
    cache.audit();
    for (const sequence_id s : {a, b}) {
      for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
        cache.lookahead(s, layer, {q.data(), nullptr, 1});
        const std::vector<std::uint32_t>& ids = S::last;
        REQUIRE(ids.size() == 50);
        CAPTURE(layer);
        MESSAGE("tiles " << tiles_touched(ids));
        // 50 blocks fit 4 tiles; one more when a run had to start mid-tile.
        CHECK(tiles_touched(ids) <= 5);
      }
    }
    cache.remove(a);  // its runs return to the free list, for the next round
    if (round == 2) {
      cache.remove(b);
    }
    cache.audit();
  }
}

namespace {
struct file_bundle {
  using allocator = free_list_allocator;
  using fast_tier = host_tier;
  using slow_tier = file_tier;
  using transfer = cpu_copy_engine;
  using predictor = lookahead_predictor<minmax_summary<>>;
  using scheduler = lookahead_prefetcher<lru_eviction>;
  using kernel = cpu::sparse_decode;
};
}  // namespace

TEST_CASE("tiered_kv_cache over a file capacity tier: appends, forks, attention as dense") {
  // The capacity tier is a file read with O_DIRECT: appends go through the tail buffer of each
  // partial block, forks copy it on write, and staged copies must equal the file's blocks.
  // With write-behind, the file lags the appends and reads of the newest blocks come from the
  // tier's copies.
  const kv_layout l{2, 4, 2, 16, 4, dtype::f32};
  for (const bool behind : {false, true}) {
    CAPTURE(behind);
    tiered_kv_cache<file_bundle> cache(file_tier(l, 256, {.path = "/tmp", .write_behind = behind}),
                                       host_tier(l, 96), {.budget_tokens = 256, .scale = 0.25f});
    std::mt19937 rng(12);
    const sequence_id a = cache.add_sequence();
    append_random(cache, a, 23, rng);
    const sequence_id b = cache.fork(a);
    append_random(cache, b, 6, rng);
    append_random(cache, a, 2, rng);
    for (sequence_id s : {a, b}) {
      for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
        auto draft = random_queries(l, 1, rng);
        cache.lookahead(s, layer, {draft.data(), nullptr, 1});
        auto q = random_queries(l, 1, rng);
        std::vector<float> out(q.size()), lse(l.num_q_heads), ref(q.size()), ref_lse(lse.size());
        const sequence_id one[1] = {s};
        cache.attend(one, layer, q.data(), 1, out.data(), lse.data());
        // Dense reference over a host copy of the file's blocks.
        const auto slots = cache.block_slots(s, layer);
        host_tier copy(l, static_cast<std::uint32_t>(slots.size()));
        std::vector<block_ref> refs;
        for (std::uint32_t i = 0; i < slots.size(); ++i) {
          cache.capacity_tier().read_block(slots[i], copy.slot_data(i));
          refs.push_back({i, i});
        }
        const std::uint32_t offsets[2] = {0, static_cast<std::uint32_t>(refs.size())};
        const std::uint32_t len = cache.length(s, layer);
        reference_decode{}.decode({q.data(),
                                   copy.view(),
                                   {refs.data(), offsets, 1, 1},
                                   &len,
                                   ref.data(),
                                   ref_lse.data(),
                                   1,
                                   1,
                                   0.25f});
        REQUIRE(oasiskv::testing::max_rel_error(out, ref) < 1e-5);
      }
    }
    CHECK(cache.length(a) == 25);
    CHECK(cache.length(b) == 29);
    CHECK(cache.audit() > 0);  // staged copies equal the file's blocks
    for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
      auto draft = random_queries(l, 1, rng);
      cache.lookahead(a, layer, {draft.data(), nullptr, 1});
    }
    cache.drain();  // the prefetches staged and the writes behind on the device
    CHECK(cache.capacity_tier().pending_writes() == 0);
    CHECK(cache.scheduler().stats().failed_transfers == 0);
    CHECK(cache.audit() > 0);
  }
}

TEST_CASE("tiered_kv_cache over a write-behind file: a device error surfaces at the next append") {
  // The device refuses a write the tier wrote behind (layer 0's block): the next append that
  // writes another block (layer 1's) fails with io_error and leaves that layer as it was; the
  // refused block stays readable from memory; once the device is back, appends go on, drain()
  // puts everything on it, and every staged block equals the file's.
  const kv_layout l{2, 4, 2, 16, 4, dtype::f32};
  tiered_kv_cache<file_bundle> cache(file_tier(l, 64, {.path = "/tmp", .write_behind = true}),
                                     host_tier(l, 32), {.budget_tokens = 64, .scale = 0.25f});
  std::mt19937 rng(21);
  const sequence_id a = cache.add_sequence();
  append_random(cache, a, 6, rng);
  cache.drain();
  file_tier& file = cache.capacity_tier();
  const int saved = ::dup(file.native_handle());
  const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  REQUIRE(saved >= 0);
  REQUIRE(null_fd >= 0);
  REQUIRE(::dup2(null_fd, file.native_handle()) == file.native_handle());
  ::close(null_fd);
  auto k = random_rows(l, 1, rng), v = random_rows(l, 1, rng);
  cache.append(a, 0, k.data(), v.data(), 1);  // written behind, refused in the background
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (file.failed_writes() == 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  REQUIRE(file.failed_writes() == 1);
  oasiskv::testing::expect_error([&] { cache.append(a, 1, k.data(), v.data(), 1); }, errc::io_error,
                                 "earlier write(s) failed and are held in memory");
  CHECK(cache.length(a, 0) == 7);
  CHECK(cache.length(a, 1) == 6);  // all or nothing
  REQUIRE(::dup2(saved, file.native_handle()) == file.native_handle());
  ::close(saved);
  cache.append(a, 1, k.data(), v.data(), 1);
  CHECK(cache.length(a, 1) == 7);
  cache.drain();
  CHECK(file.failed_writes() == 0);
  CHECK(file.pending_writes() == 0);
  CHECK(cache.audit() > 0);
}

TEST_CASE("tiered_kv_cache: a block created by append is staged from memory, not fetched") {
  // Budget covering the context: lookahead stages every block, so the only blocks a step could
  // miss are the ones its own appends create. Those are staged as they are created.
  const kv_layout l{2, 4, 2, 16, 4, dtype::f32};
  for (const bool behind : {false, true}) {
    CAPTURE(behind);
    tiered_kv_cache<file_bundle> cache(file_tier(l, 64, {.path = "/tmp", .write_behind = behind}),
                                       host_tier(l, 32), {.budget_tokens = 64, .scale = 0.25f});
    std::mt19937 rng(3);
    const sequence_id a = cache.add_sequence();
    append_random(cache, a, 8, rng);  // two full blocks
    for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
      auto draft = random_queries(l, 1, rng);
      cache.lookahead(a, layer, {draft.data(), nullptr, 1});
    }
    const cache_stats before = cache.stats();
    const sequence_id one[1] = {a};
    for (std::uint32_t step = 0; step < 9; ++step) {  // tokens 8..16: three new blocks
      for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
        auto k = random_rows(l, 1, rng), v = random_rows(l, 1, rng);
        cache.append(a, layer, k.data(), v.data(), 1);
        auto q = random_queries(l, 1, rng);
        std::vector<float> out(q.size());
        cache.attend(one, layer, q.data(), 1, out.data());
        auto draft = random_queries(l, 1, rng);
        cache.lookahead(a, layer, {draft.data(), nullptr, 1});
      }
    }
    const cache_stats after = cache.stats();
    CHECK(after.step.misses == before.step.misses);
    CHECK(after.step.hits > before.step.hits);
    CHECK(after.step.bytes_fetched == before.step.bytes_fetched);
    CHECK(cache.audit() > 0);  // the staged new blocks equal the capacity tier's
  }
}

namespace {
struct gated_bundle {  // a block-I/O capacity tier whose writes can be made to fail
  using allocator = free_list_allocator;
  using fast_tier = host_tier;
  using slow_tier = oasiskv::testing::gated_io_tier;
  using transfer = cpu_copy_engine;
  using predictor = lookahead_predictor<minmax_summary<>>;
  using scheduler = lookahead_prefetcher<lru_eviction>;
  using kernel = cpu::sparse_decode;
};

// attend over every layer of `s` equals dense attention over the capacity tier's blocks.
template <class Cache>
void check_attend_equals_dense(Cache& c, sequence_id s, std::mt19937& rng) {
  for (std::uint32_t layer = 0; layer < c.layout().num_layers; ++layer) {
    auto q = random_queries(c.layout(), 1, rng);
    std::vector<float> out(q.size()), lse(c.layout().num_q_heads), ref(q.size()),
        ref_lse(lse.size());
    const sequence_id one[1] = {s};
    c.attend(one, layer, q.data(), 1, out.data(), lse.data());
    dense_reference(c, s, layer, q.data(), 1, ref.data(), ref_lse.data());
    REQUIRE(oasiskv::testing::max_rel_error(out, ref) < 1e-5);
    REQUIRE(oasiskv::testing::max_rel_error(lse, ref_lse) < 1e-5);
  }
}
}  // namespace

TEST_CASE("tiered_kv_cache: an append whose capacity-tier write fails part-way changes nothing") {
  const kv_layout l{2, 4, 2, 16, 4, dtype::f32};
  // 6 tokens (a full block and a partial one), then 9 more: three writes per layer (the
  // partial block, a new full block, a new partial one); the n-th fails.
  for (const int ok_writes : {0, 1, 2}) {
    CAPTURE(ok_writes);
    tiered_kv_cache<gated_bundle> cache(oasiskv::testing::gated_io_tier(l, 64), host_tier(l, 32),
                                        {.budget_tokens = 64, .scale = 0.25f});
    std::mt19937 rng(21);
    const sequence_id a = cache.add_sequence();
    append_random(cache, a, 6, rng);
    const auto slots_before = cache.block_slots(a, 0);
    cache.capacity_tier().fail_writes_after(ok_writes);
    auto k = random_rows(l, 9, rng), v = random_rows(l, 9, rng);
    CHECK_THROWS_AS(cache.append(a, 0, k.data(), v.data(), 9), std::runtime_error);
    CHECK(cache.length(a, 0) == 6);
    CHECK(cache.block_slots(a, 0) == slots_before);
    cache.capacity_tier().cure();
    CHECK(cache.audit() > 0);  // staged copies equal the capacity tier's blocks
    check_attend_equals_dense(cache, a, rng);
    // The retry appends as if the failure had not happened.
    cache.append(a, 0, k.data(), v.data(), 9);
    auto k1 = random_rows(l, 9, rng), v1 = random_rows(l, 9, rng);
    cache.append(a, 1, k1.data(), v1.data(), 9);
    CHECK(cache.length(a, 0) == 15);
    CHECK(cache.block_slots(a, 0).size() == 4);
    CHECK(cache.audit() > 0);
    check_attend_equals_dense(cache, a, rng);
  }
}

TEST_CASE("tiered_kv_cache: an append that runs out of capacity slots part-way changes nothing") {
  const kv_layout l{1, 4, 2, 16, 4, dtype::f32};
  tiered_kv_cache<exact_lru> cache(host_tier(l, 3), host_tier(l, 8),
                                   {.budget_tokens = 16, .scale = 0.25f});
  std::mt19937 rng(22);
  const sequence_id a = cache.add_sequence();
  append_random(cache, a, 6, rng);  // 2 of the 3 slots
  const auto slots_before = cache.block_slots(a, 0);
  auto k = random_rows(l, 9, rng), v = random_rows(l, 9, rng);  // would need 2 more slots
  expect_error([&] { cache.append(a, 0, k.data(), v.data(), 9); }, errc::capacity_exceeded,
               "slots are all in use");
  CHECK(cache.length(a, 0) == 6);
  CHECK(cache.block_slots(a, 0) == slots_before);
  CHECK(cache.audit() > 0);
  check_attend_equals_dense(cache, a, rng);
  // The slot the failed append took is free again: 6 more tokens fill the 3 slots exactly.
  append_random(cache, a, 6, rng);
  CHECK(cache.length(a, 0) == 12);
  CHECK(cache.block_slots(a, 0).size() == 3);
  check_attend_equals_dense(cache, a, rng);
}

namespace {
// Records the scores of the last `select` (every KV head's, in order).
template <class S>
struct score_log : S {
  using S::S;
  static inline thread_local std::vector<float> last;
  void score_rows(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
                  std::uint32_t n, float* out) const {
    S::score_rows(h, entries, q, n, out);
    if (h == 0) {
      last.clear();
    }
    last.insert(last.end(), out, out + entries.size() * n);
  }
};
struct gated_scored_bundle : gated_bundle {
  using predictor = lookahead_predictor<score_log<minmax_summary<>>>;
};
}  // namespace

TEST_CASE("tiered_kv_cache: an append undone part-way leaves the partial block's summary exact") {
  // The undone append's first write widened the partial block's bounds with rows that are now
  // gone; the block's scores must be those of a cache that never saw them.
  using S = score_log<minmax_summary<>>;
  const kv_layout l{1, 4, 2, 16, 4, dtype::f32};
  std::mt19937 rng(23);
  const auto k6 = random_rows(l, 6, rng), v6 = random_rows(l, 6, rng);
  auto k9 = random_rows(l, 9, rng), v9 = random_rows(l, 9, rng);
  for (std::size_t i = 0; i < k9.size() / sizeof(float); ++i) {  // keys far outside the others
    reinterpret_cast<float*>(k9.data())[i] *= 8.0f;
  }
  const auto q = random_queries(l, 1, rng);
  auto scores_of = [&](bool fail) {
    // An adaptive budget: a fixed one covering both blocks would keep them unscored.
    tiered_kv_cache<gated_scored_bundle> cache(
        oasiskv::testing::gated_io_tier(l, 16), host_tier(l, 16),
        {.budget_tokens = 16, .scale = 0.25f, .target_mass = 0.9f});
    const sequence_id a = cache.add_sequence();
    cache.append(a, 0, k6.data(), v6.data(), 6);
    if (fail) {
      cache.capacity_tier().fail_writes_after(1);  // the partial block's rows land, then a failure
      CHECK_THROWS_AS(cache.append(a, 0, k9.data(), v9.data(), 9), std::runtime_error);
      cache.capacity_tier().cure();
    }
    cache.lookahead(a, 0, {q.data(), nullptr, 1});
    return S::last;
  };
  const auto clean = scores_of(false);
  const auto undone = scores_of(true);
  REQUIRE(clean.size() == 2 * l.num_kv_heads * l.group_size());
  CHECK(undone == clean);
}
