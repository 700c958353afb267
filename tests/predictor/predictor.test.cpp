// SPDX-License-Identifier: Apache-2.0
// Importance predictors: every model runs the same invariant cases (kept blocks, budget,
// ascending tables, per-head tables, determinism, no allocation in steady state, bad input);
// then what each one promises: exact top-k, the aggregations' documented difference, lookahead
// with the true query == Quest, the oracle maximises attention mass, planted blocks are found.
#include <doctest/doctest.h>

#include "support/expect_error.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <new>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "oasiskv/concepts/importance_predictor.hpp"
#include "oasiskv/cpu/loop_runner.hpp"
#include "oasiskv/cpu/thread_pool.hpp"
#include "oasiskv/predictor/current_query_predictor.hpp"
#include "oasiskv/predictor/lookahead_predictor.hpp"
#include "oasiskv/predictor/oracle_predictor.hpp"
#include "oasiskv/predictor/recency_predictor.hpp"
#include "oasiskv/summary/cascade_summary.hpp"
#include "oasiskv/summary/mean_summary.hpp"
#include "oasiskv/summary/minmax_summary.hpp"
#include "oasiskv/summary/qminmax_int2_summary.hpp"
#include "oasiskv/summary/quantized_key_summary.hpp"
#include "oasiskv/summary/quantized_minmax_summary.hpp"
#include "support/kv_fixture.hpp"

// Counts heap allocations, so a test can show that steady-state select() makes none.
namespace {
std::atomic<long> allocations{0};
}
// gcc 12 pairs the replaced operator delete's free() with operator new and warns; they match.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void* operator new(std::size_t n) {
  allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) {
    return p;
  }
  throw std::bad_alloc();
}
// Every form that std::free can release must come from here too (stable_sort's temporary
// buffer uses the nothrow one), or AddressSanitizer rightly reports a mismatch.
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  allocations.fetch_add(1, std::memory_order_relaxed);
  return std::malloc(n == 0 ? 1 : n);
}
void* operator new[](std::size_t n) {
  return operator new(n);
}
void* operator new[](std::size_t n, const std::nothrow_t& t) noexcept {
  return operator new(n, t);
}
void operator delete[](void* p) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}
#pragma GCC diagnostic pop

using namespace oasiskv;

namespace {

using oasiskv::testing::expect_error;

// One (sequence, layer): random keys with block i in a shuffled slot, a summary of type S (none
// for no_summary) whose entries are a shuffled subset of its capacity, and random queries.
template <class S>
struct world {
  kv_layout layout;
  std::uint32_t seq_len;
  host_tier pool;
  std::vector<slot_id> slots;
  std::vector<std::uint32_t> ids;
  std::optional<S> summary;
  std::vector<float> q;
  std::vector<float> weights;
  std::uint32_t tokens;

  world(const kv_layout& l, std::uint32_t len, std::uint32_t n, std::uint32_t seed)
      : layout(l), seq_len(len), pool(l, l.blocks_for(len) + 2), tokens(n) {
    std::mt19937 rng(seed);
    testing::fill_random(pool, seed + 1);
    const std::uint32_t blocks = l.blocks_for(len);
    slots.resize(pool.num_slots());
    std::iota(slots.begin(), slots.end(), 0u);
    std::shuffle(slots.begin(), slots.end(), rng);
    slots.resize(blocks);
    ids.resize(blocks + 3);
    std::iota(ids.begin(), ids.end(), 0u);
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(blocks);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f), conf(0.1f, 1.0f);
    q.resize(std::size_t{n} * l.num_q_heads * l.head_dim);
    for (float& x : q) {
      x = dist(rng);
    }
    weights.resize(n);
    for (float& x : weights) {
      x = conf(rng);
    }
    rebuild();
  }

  // (Re)folds every block's keys into a fresh summary.
  void rebuild() {
    if constexpr (!std::is_same_v<S, no_summary>) {
      const std::uint32_t blocks = layout.blocks_for(seq_len);
      summary.emplace(layout, blocks + 3);
      for (std::uint32_t i = 0; i < blocks; ++i) {
        const std::uint32_t fill =
            std::min(layout.tokens_per_block, seq_len - i * layout.tokens_per_block);
        summary->update(ids[i], pool.slot_data(slots[i]), 0, fill);
      }
    }
  }

  prediction_input<S> input() const {
    prediction_input<S> in;
    in.layout = layout;
    in.seq_len = seq_len;
    if constexpr (!std::is_same_v<S, no_summary>) {
      in.summaries = &*summary;
    }
    in.summary_ids = ids;
    in.queries = {q.data(), weights.data(), tokens};
    in.keys = pool.view();
    in.key_slots = slots;
    return in;
  }
};

// Every invariant of importance_predictor::select.
void check_selection(const selection& s, std::uint32_t blocks, const selection_params& sp,
                     std::uint32_t tables) {
  REQUIRE(s.tables == tables);
  REQUIRE(s.offsets.size() == tables + 1);
  CHECK(s.offsets.front() == 0);
  CHECK(s.offsets.back() == s.blocks.size());
  for (std::uint32_t t = 0; t < tables; ++t) {
    const auto tab = s.table(t);
    CHECK(tab.size() == std::min(sp.budget_blocks, blocks));
    CHECK(std::adjacent_find(tab.begin(), tab.end(), std::greater_equal<>()) == tab.end());
    CHECK(tab.back() == blocks - 1);  // the newest token's (possibly partial) block
    for (std::uint32_t i = 0; i < std::min(sp.sink_blocks, blocks); ++i) {
      CHECK(std::binary_search(tab.begin(), tab.end(), i));
    }
    for (std::uint32_t i = 0; i < std::min(sp.recent_blocks, blocks); ++i) {
      CHECK(std::binary_search(tab.begin(), tab.end(), blocks - 1 - i));
    }
  }
}

template <class P>
constexpr bool reads_queries = !std::is_same_v<P, recency_predictor> &&
                               !std::is_same_v<P, basic_recency_predictor<per_kv_head_selection>>;
template <class P>
constexpr bool is_oracle = std::is_same_v<typename P::summary_type, no_summary>&& reads_queries<P>;
template <class P>
constexpr bool per_head = P::granularity_type::per_kv_head;

}  // namespace

#define OASISKV_PREDICTORS                                                                    \
  lookahead_predictor<minmax_summary<>, max_aggregation>, lookahead_predictor<mean_summary>,  \
      lookahead_predictor<minmax_summary<>>, lookahead_predictor<int8_key_summary>,           \
      lookahead_predictor<int4_key_summary, max_aggregation, per_kv_head_selection>,          \
      lookahead_predictor<int8_key_summary, confidence_weighted_aggregation>,                 \
      lookahead_predictor<minmax_summary<bf16>, confidence_weighted_aggregation,              \
                          per_kv_head_selection>,                                             \
      lookahead_predictor<minmax_summary<float>, max_aggregation, per_kv_head_selection>,     \
      current_query_predictor<minmax_summary<>>,                                              \
      current_query_predictor<mean_summary, per_kv_head_selection>, recency_predictor,        \
      basic_recency_predictor<per_kv_head_selection>, oracle_predictor<>,                     \
      oracle_predictor<per_kv_head_selection>, lookahead_predictor<quantized_minmax_summary>, \
      lookahead_predictor<quantized_minmax_summary, softmax_mass_aggregation,                 \
                          per_kv_head_selection>

TEST_CASE_TEMPLATE("importance predictor: selection invariants", P, OASISKV_PREDICTORS) {
  static_assert(importance_predictor<P>);
  using S = typename P::summary_type;
  const kv_layout l{1, 8, 2, 16, 4, dtype::f16};
  const selection_params params[] = {{2, 1, 1}, {5, 1, 2}, {8, 2, 3},  {3, 0, 0},
                                     {1, 0, 0}, {7, 3, 1}, {100, 1, 1}};
  for (const std::uint32_t len : {1u, 3u, 4u, 17u, 64u, 203u}) {
    for (const std::uint32_t n : {1u, 3u}) {
      world<S> w(l, len, n, len * 7 + n);
      for (const selection_params& sp : params) {
        CAPTURE(len);
        CAPTURE(n);
        CAPTURE(sp.budget_blocks);
        CAPTURE(sp.sink_blocks);
        CAPTURE(sp.recent_blocks);
        P p;
        selection s;
        const long first_call = allocations.load();
        p.select(w.input(), sp, s);
        CHECK(allocations.load() > first_call);  // the counter sees this binary's allocations
        check_selection(s, l.blocks_for(len), sp, per_head<P> ? l.num_kv_heads : 1);
        // Deterministic: again with the same object, and with a fresh one.
        selection again, fresh;
        p.select(w.input(), sp, again);
        P{}.select(w.input(), sp, fresh);
        CHECK(again.blocks == s.blocks);
        CHECK(fresh.blocks == s.blocks);
        // Steady state: the predictor and the selection reuse their buffers.
        const long before = allocations.load();
        p.select(w.input(), sp, s);
        CHECK(allocations.load() - before == 0);
      }
    }
  }
}

TEST_CASE_TEMPLATE("importance predictor: bad input names the value", P, OASISKV_PREDICTORS) {
  using S = typename P::summary_type;
  const kv_layout l{1, 8, 2, 16, 4, dtype::f16};
  world<S> w(l, 40, 2, 3);
  P p;
  selection s;
  const selection_params ok{4, 1, 1};
  auto in = w.input();
  expect_error([&] { p.select(in, {2, 2, 1}, s); }, errc::invalid_argument, "budget_blocks = 2");
  expect_error([&] { p.select(in, {2, 2, 0}, s); }, errc::invalid_argument, "budget_blocks = 2");
  // Adaptive budgets: a target share in (0, 1], a cap of at least the budget.
  expect_error(
      [&] {
        p.select(in, {4, 1, 1, 1.5f}, s);
      },
      errc::invalid_argument, "target_mass = 1.5 must be 0");
  expect_error(
      [&] {
        p.select(in, {4, 1, 1, -0.25f}, s);
      },
      errc::invalid_argument, "target_mass = -0.25");
  expect_error(
      [&] {
        p.select(in, {4, 1, 1, std::numeric_limits<float>::quiet_NaN()}, s);
      },
      errc::invalid_argument, "target_mass = nan");
  expect_error(
      [&] {
        p.select(in, {4, 1, 1, 0.9f, 3}, s);
      },
      errc::invalid_argument, "max_blocks = 3 is below budget_blocks = 4");
  in.seq_len = 0;
  expect_error([&] { p.select(in, ok, s); }, errc::invalid_argument, "seq_len is 0");
  in = w.input();
  in.layout.num_kv_heads = 3;
  expect_error([&] { p.select(in, ok, s); }, errc::invalid_layout, "num_kv_heads = 3");
  if constexpr (reads_queries<P>) {
    in = w.input();
    in.queries.data = nullptr;
    expect_error([&] { p.select(in, ok, s); }, errc::invalid_argument, "data is null");
    in = w.input();
    in.queries.num_tokens = 0;
    expect_error([&] { p.select(in, ok, s); }, errc::invalid_argument, "num_tokens = 0");
    in.queries.num_tokens = 17;
    expect_error([&] { p.select(in, ok, s); }, errc::invalid_argument, "num_tokens = 17");
    in = w.input();
    const float bad_weights[2] = {1.0f, -0.5f};
    in.queries.weights = bad_weights;
    expect_error([&] { p.select(in, ok, s); }, errc::invalid_argument, "weights[1] = -0.5");
  }
  if constexpr (!std::is_same_v<S, no_summary>) {
    in = w.input();
    in.summary_ids = std::span(w.ids).first(9);
    expect_error([&] { p.select(in, ok, s); }, errc::invalid_argument,
                 "summary_ids.size() = 9 but seq_len = 40 needs 10 blocks");
    std::vector<std::uint32_t> ids = w.ids;
    ids[4] = w.summary->capacity();
    in.summary_ids = ids;
    expect_error([&] { p.select(in, ok, s); }, errc::out_of_range, "summary_ids[4] = 13");
    in = w.input();
    in.summaries = nullptr;
    expect_error([&] { p.select(in, ok, s); }, errc::invalid_argument, "summaries is null");
  }
  if constexpr (is_oracle<P>) {
    in = w.input();
    in.key_slots = {};
    expect_error([&] { p.select(in, ok, s); }, errc::unsupported, "exact keys");
    in = w.input();
    in.keys = {};
    expect_error([&] { p.select(in, ok, s); }, errc::unsupported, "exact keys");
    in = w.input();
    in.key_slots = std::span(w.slots).first(3);
    expect_error([&] { p.select(in, ok, s); }, errc::invalid_argument, "key_slots.size() = 3");
  }
}

namespace {
void check_selector_against_sort(block_selector& sel, std::mt19937& rng) {
  for (int trial = 0; trial < 360; ++trial) {
    // Every sixth trial a long sequence with a small budget: the chunk-maxima prefilter and
    // the vector loops' tails.
    const bool large = trial % 6 == 0;
    const std::uint32_t n = large ? 1000 + rng() % 4000 : 1 + rng() % 300;
    const selection_params sp{
        static_cast<std::uint32_t>((large ? rng() % (n / 4) : 1 + rng() % (n + 5)) + 2),
        static_cast<std::uint32_t>(rng() % 3), static_cast<std::uint32_t>(rng() % 3)};
    if (sp.budget_blocks < sp.sink_blocks + std::max(sp.recent_blocks, 1u)) {
      continue;
    }
    std::vector<float> scores(n);
    // Few distinct values (many ties) in two trials of three, else continuous ones (the
    // prefilter's bound then matters); now and then NaN or infinity.
    const bool continuous = trial % 3 == 2;
    std::normal_distribution<float> normal(0.0f, 3.0f);
    for (float& s : scores) {
      const auto v = rng() % 40;
      s = v == 0   ? std::numeric_limits<float>::quiet_NaN()
          : v == 1 ? std::numeric_limits<float>::infinity()
          : v == 2 ? -std::numeric_limits<float>::infinity()
                   : (continuous ? normal(rng) : static_cast<float>(v % 6));
    }
    std::vector<std::uint32_t> got;
    sel.append_table(scores.data(), n, sp, got);
    // Reference: keep sinks and recent, fully sort the rest by (score desc, index asc).
    std::vector<std::uint32_t> want;
    if (sp.budget_blocks >= n) {
      want.resize(n);
      std::iota(want.begin(), want.end(), 0u);
    } else {
      const std::uint32_t sinks = std::min(sp.sink_blocks, n);
      const std::uint32_t recent = std::min(std::max(sp.recent_blocks, 1u), n - sinks);
      std::vector<std::uint32_t> cand(n - sinks - recent);
      std::iota(cand.begin(), cand.end(), sinks);
      auto key = [&](std::uint32_t i) {
        return std::isnan(scores[i]) ? std::numeric_limits<float>::infinity() : scores[i];
      };
      std::stable_sort(cand.begin(), cand.end(),
                       [&](std::uint32_t a, std::uint32_t b) { return key(a) > key(b); });
      cand.resize(sp.budget_blocks - sinks - recent);
      for (std::uint32_t i = 0; i < sinks; ++i) {
        want.push_back(i);
      }
      for (std::uint32_t i = n - recent; i < n; ++i) {
        want.push_back(i);
      }
      want.insert(want.end(), cand.begin(), cand.end());
      std::sort(want.begin(), want.end());
    }
    CHECK(got == want);
  }
}
}  // namespace

TEST_CASE("block_selector: the top-k is the top of a full sort, ties to the lower index") {
  // Every code path the machine runs sees the same inputs.
  for (const cpu_isa isa : {cpu_isa::scalar, cpu_isa::avx2, cpu_isa::avx512}) {
    if (!isa_supported(isa)) {
      MESSAGE("cpu_isa ", to_string(isa), " not supported here");
      continue;
    }
    CAPTURE(to_string(isa));
    std::mt19937 rng(9);
    block_selector sel{isa};
    CHECK(sel.isa() == isa);
    check_selector_against_sort(sel, rng);
  }
}

namespace {
// A summary written outside the library, which returns scripted scores: block_summary models
// drop into the predictors unchanged, and the aggregations can be shown a constructed case.
struct scripted_summary {
  std::vector<float> table;  // [entries][rows]
  std::uint32_t rows = 1, entries = 0;
  scripted_summary(const kv_layout&, std::uint32_t capacity) : entries(capacity) {}
  std::uint32_t capacity() const { return entries; }
  void reset(std::uint32_t) {}
  void update(std::uint32_t, const std::byte*, std::uint32_t, std::uint32_t) {}
  void score(std::uint32_t, std::span<const std::uint32_t> ids, const float*, std::uint32_t n,
             float* out) const {
    for (std::size_t i = 0; i < ids.size(); ++i) {
      for (std::uint32_t r = 0; r < n; ++r) {
        out[i * n + r] = table[ids[i] * rows + r];
      }
    }
  }
  std::size_t bytes_per_block() const { return 0; }
};
static_assert(block_summary<scripted_summary>);
}  // namespace

TEST_CASE("softmax mass aggregation equals a double-precision softmax over blocks") {
  // Block counts on both sides of the vector widths (the AVX2 exponentials take 16 and 8 at a
  // time), 1 to 12 rows, two KV heads folded into one table, draft weights, and scores that
  // overflowed (+inf) or describe an empty entry (-inf).
  std::mt19937 rng(5);
  std::normal_distribution<float> score(0.0f, 6.0f);
  for (const std::uint32_t blocks : {1u, 7u, 8u, 23u, 64u, 2049u}) {
    for (const std::uint32_t rows : {1u, 3u, 12u}) {
      CAPTURE(blocks);
      CAPTURE(rows);
      const std::uint32_t group = rows % 3 == 0 ? 3 : 1, tokens = rows / group;
      std::vector<float> weights(tokens);
      for (float& w : weights) {
        w = 0.25f + static_cast<float>(rng() % 4);
      }
      const aggregation_context ctx{blocks, rows, group, 0.125f, weights.data()};
      std::vector<std::vector<float>> raw(2, std::vector<float>(std::size_t{blocks} * rows));
      for (auto& head : raw) {
        for (float& x : head) {
          x = score(rng);
        }
      }
      // raw is [row][block], as the aggregations read it.
      raw[0][0] = std::numeric_limits<float>::infinity();
      if (blocks > 2) {
        raw[1][2] = -std::numeric_limits<float>::infinity();
      }
      if (blocks > 3) {
        raw[0][std::size_t{rows - 1} * blocks + 3] = std::numeric_limits<float>::quiet_NaN();
      }
      std::vector<float> acc(blocks);
      confidence_weighted_aggregation agg;
      agg.combine(ctx, raw[0].data(), acc.data(), true);
      agg.combine(ctx, raw[1].data(), acc.data(), false);
      std::vector<double> want(blocks, 0.0);
      constexpr double lim = std::numeric_limits<float>::max();
      for (const auto& head : raw) {
        for (std::uint32_t r = 0; r < rows; ++r) {
          double top = -lim, sum = 0.0;
          auto clamped = [&](std::uint32_t i) {
            const double v = head[std::size_t{r} * blocks + i];
            return v != v ? lim : std::clamp(v, -lim, lim);  // NaN counts as an overflow
          };
          for (std::uint32_t i = 0; i < blocks; ++i) {
            top = std::max(top, clamped(i));
          }
          for (std::uint32_t i = 0; i < blocks; ++i) {
            sum += std::exp(0.125 * (clamped(i) - top));
          }
          for (std::uint32_t i = 0; i < blocks; ++i) {
            want[i] += weights[r / group] * std::exp(0.125 * (clamped(i) - top)) / sum;
          }
        }
      }
      for (std::uint32_t i = 0; i < blocks; ++i) {
        CHECK(acc[i] == doctest::Approx(want[i]).epsilon(1e-4).scale(1e-6));
      }
    }
  }
}

TEST_CASE("aggregation: max follows one draft's spike, softmax mass follows the consensus") {
  // Eight drafts, six blocks, room for one block besides the sink and the last block. Draft 0
  // wants block 1 strongly (score 40); all eight want block 3 a little less (30).
  const kv_layout l{1, 1, 1, 8, 16, dtype::f32};
  const std::uint32_t drafts = 8, blocks = 6;
  scripted_summary sum(l, blocks);
  sum.rows = drafts;
  sum.table.assign(blocks * drafts, 0.0f);
  sum.table[1 * drafts + 0] = 40.0f;
  for (std::uint32_t r = 0; r < drafts; ++r) {
    sum.table[3 * drafts + r] = 30.0f;
  }
  std::vector<float> q(drafts * 8, 0.0f);
  std::vector<std::uint32_t> ids(blocks);
  std::iota(ids.begin(), ids.end(), 0u);
  prediction_input<scripted_summary> in{l, blocks * 16, &sum, ids, {q.data(), nullptr, drafts}};
  const selection_params sp{3, 1, 1};
  selection s;

  lookahead_predictor<scripted_summary, max_aggregation>{}.select(in, sp, s);
  CHECK(s.blocks == std::vector<std::uint32_t>{0, 1, 5});
  lookahead_predictor<scripted_summary, softmax_mass_aggregation>{}.select(in, sp, s);
  CHECK(s.blocks == std::vector<std::uint32_t>{0, 3, 5});
  // Unweighted, confidence weighting is softmax mass; trusting draft 0 restores its choice.
  lookahead_predictor<scripted_summary, confidence_weighted_aggregation>{}.select(in, sp, s);
  CHECK(s.blocks == std::vector<std::uint32_t>{0, 3, 5});
  const float w[drafts] = {1.0f, 0.01f, 0.01f, 0.01f, 0.01f, 0.01f, 0.01f, 0.01f};
  in.queries.weights = w;
  lookahead_predictor<scripted_summary, confidence_weighted_aggregation>{}.select(in, sp, s);
  CHECK(s.blocks == std::vector<std::uint32_t>{0, 1, 5});
}

TEST_CASE_TEMPLATE("lookahead with the true next query reproduces Quest", G, shared_selection,
                   per_kv_head_selection) {
  const kv_layout l{1, 8, 2, 64, 16, dtype::f16};
  world<minmax_summary<>> w(l, 2000, 1, 17);
  const selection_params sp{20, 1, 2};
  selection a, b;
  lookahead_predictor<minmax_summary<>, max_aggregation, G>{}.select(w.input(), sp, a);
  current_query_predictor<minmax_summary<>, G>{}.select(w.input(), sp, b);
  CHECK(a.tables == b.tables);
  CHECK(a.offsets == b.offsets);
  CHECK(a.blocks == b.blocks);
}

namespace {
// Attention mass of each block, summed over every query row (and KV heads when h < 0).
std::vector<double> exact_mass(const world<no_summary>& w, int head) {
  const kv_layout& l = w.layout;
  const std::uint32_t blocks = l.blocks_for(w.seq_len), d = l.head_dim;
  std::vector<double> mass(blocks, 0.0);
  for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
    if (head >= 0 && static_cast<std::uint32_t>(head) != h) {
      continue;
    }
    for (std::uint32_t t = 0; t < w.tokens; ++t) {
      for (std::uint32_t g = 0; g < l.group_size(); ++g) {
        const float* q = w.q.data() + (std::size_t{t} * l.num_q_heads + h * l.group_size() + g) * d;
        std::vector<double> logit(w.seq_len);
        for (std::uint32_t p = 0; p < w.seq_len; ++p) {
          const auto* k = reinterpret_cast<const float*>(
                              w.pool.slot_data(w.slots[p / l.tokens_per_block]) + l.key_offset(h)) +
                          std::size_t{p % l.tokens_per_block} * d;
          double dot = 0.0;
          for (std::uint32_t x = 0; x < d; ++x) {
            dot += double{q[x]} * k[x];
          }
          logit[p] = dot / std::sqrt(double(d));
        }
        const double m = *std::max_element(logit.begin(), logit.end());
        double z = 0.0;
        for (double v : logit) {
          z += std::exp(v - m);
        }
        for (std::uint32_t p = 0; p < w.seq_len; ++p) {
          mass[p / l.tokens_per_block] += std::exp(logit[p] - m) / z;
        }
      }
    }
  }
  return mass;
}
}  // namespace

TEST_CASE("oracle_predictor: its selection carries the most attention mass") {
  const kv_layout l{1, 4, 2, 8, 4, dtype::f32};
  for (std::uint32_t seed = 0; seed < 10; ++seed) {
    world<no_summary> w(l, 30, 2, seed);  // 8 blocks, the last holds 2 tokens
    for (float& x : w.q) {
      x *= 4.0f;  // sharper attention: distinct masses
    }
    const selection_params sp{5, 1, 1};  // 3 of the 6 middle blocks
    for (int head = -1; head < 2; ++head) {
      const auto mass = exact_mass(w, head);
      double best = -1.0;
      for (std::uint32_t a = 1; a < 7; ++a) {  // brute force over every choice
        for (std::uint32_t b = a + 1; b < 7; ++b) {
          for (std::uint32_t c = b + 1; c < 7; ++c) {
            best = std::max(best, mass[a] + mass[b] + mass[c]);
          }
        }
      }
      selection s;
      if (head < 0) {
        oracle_predictor<>{}.select(w.input(), sp, s);
      } else {
        oracle_predictor<per_kv_head_selection>{}.select(w.input(), sp, s);
      }
      const auto tab = s.table(head < 0 ? 0 : static_cast<std::uint32_t>(head));
      double got = 0.0;
      for (const std::uint32_t i : tab) {
        got += (i == 0 || i == 7) ? 0.0 : mass[i];
      }
      CHECK(got == doctest::Approx(best).epsilon(1e-6));
    }
  }
}

TEST_CASE("lookahead_predictor<minmax_summary>: finds blocks with planted high-scoring tokens") {
  const kv_layout l{1, 8, 2, 64, 16, dtype::f16};
  world<minmax_summary<>> w(l, 4096, 2, 23);  // 256 blocks of keys uniform in [-1, 1]
  const std::uint32_t planted[] = {17, 60, 111, 150, 233};
  for (std::uint32_t i = 0; i < 5; ++i) {
    // A key along one query row of one KV head's group, outside the random keys' range.
    const std::uint32_t h = i % 2, tok = (i / 2) % 2, g = i % 4;
    const float* q = w.q.data() + (std::size_t{tok} * l.num_q_heads + h * l.group_size() + g) * 64;
    auto* k =
        reinterpret_cast<f16*>(w.pool.slot_data(w.slots[planted[i]]) + l.key_offset(h)) + 5 * 64;
    for (std::uint32_t x = 0; x < 64; ++x) {
      k[x] = f16::from_float(q[x] >= 0.0f ? 2.0f : -2.0f);
    }
  }
  w.rebuild();
  const selection_params sp{16, 1, 1};
  selection shared, heads;
  lookahead_predictor<minmax_summary<>, max_aggregation>{}.select(w.input(), sp, shared);
  lookahead_predictor<minmax_summary<>, max_aggregation, per_kv_head_selection>{}.select(w.input(),
                                                                                         sp, heads);
  for (std::uint32_t i = 0; i < 5; ++i) {
    CAPTURE(planted[i]);
    const auto t = shared.table(0);
    CHECK(std::binary_search(t.begin(), t.end(), planted[i]));
    const auto th = heads.table(i % 2);
    CHECK(std::binary_search(th.begin(), th.end(), planted[i]));
  }
}

namespace {
// Plants, in five blocks, a key along one query row of one KV head's group, outside the random
// keys' range (as the test above), into the pool of `w`.
template <class S>
void plant(world<S>& w, const std::uint32_t (&planted)[5]) {
  const kv_layout& l = w.layout;
  for (std::uint32_t i = 0; i < 5; ++i) {
    const std::uint32_t h = i % 2, tok = (i / 2) % 2, g = i % 4;
    const float* q =
        w.q.data() + (std::size_t{tok} * l.num_q_heads + h * l.group_size() + g) * l.head_dim;
    auto* k = reinterpret_cast<f16*>(w.pool.slot_data(w.slots[planted[i]]) + l.key_offset(h)) +
              5 * l.head_dim;
    for (std::uint32_t x = 0; x < l.head_dim; ++x) {
      k[x] = f16::from_float(q[x] >= 0.0f ? 2.0f : -2.0f);
    }
  }
  w.rebuild();
}

// The share of `exact`'s chosen candidates (neither sink nor recent) that `got` also chose.
double agreement(std::span<const std::uint32_t> got, std::span<const std::uint32_t> exact,
                 std::uint32_t blocks, const selection_params& sp) {
  std::uint32_t chosen = 0, shared = 0;
  for (const std::uint32_t b : exact) {
    if (b < sp.sink_blocks || b + std::max(sp.recent_blocks, 1u) >= blocks) {
      continue;
    }
    ++chosen;
    shared += std::binary_search(got.begin(), got.end(), b) ? 1u : 0u;
  }
  return chosen == 0 ? 1.0 : static_cast<double>(shared) / chosen;
}
}  // namespace

// Keys of each block (all heads) as a random centre plus noise, as real attention's cluster, so
// blocks differ in relevance by more than a summary's rounding (uniform keys make the top-k a
// near-tie among hundreds of blocks).
template <class S>
void cluster_keys(world<S>& w, std::uint32_t seed) {
  const kv_layout& l = w.layout;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> centre(-1.5f, 1.5f), noise(-0.5f, 0.5f);
  std::vector<float> c(l.head_dim);
  for (std::uint32_t i = 0; i < l.blocks_for(w.seq_len); ++i) {
    for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
      for (float& x : c) {
        x = centre(rng);
      }
      auto* k = reinterpret_cast<f16*>(w.pool.slot_data(w.slots[i]) + l.key_offset(h));
      for (std::uint32_t t = 0; t < l.tokens_per_block; ++t) {
        for (std::uint32_t x = 0; x < l.head_dim; ++x) {
          k[t * l.head_dim + x] = f16::from_float(c[x] + noise(rng));
        }
      }
    }
  }
}

TEST_CASE_TEMPLATE("faster summaries select what the exact f32 min/max bound selects", S,
                   minmax_summary<f16>, minmax_summary<bf16>, quantized_minmax_summary) {
  // 1024 blocks, a 1/16 budget (64 blocks), two lookahead tokens; five blocks hold a planted
  // high-scoring key. The exact reference is minmax_summary<float>. Uniform random keys (a
  // near-tie: the share agreeing is what the summary's rounding costs at worst) and clustered
  // keys (blocks that differ, as in real attention).
  constexpr bool exact = std::is_same_v<S, minmax_summary<f16>>;  // f16 keys stored exactly
  // Measured (seeds below): bf16 0.984 / 1.0 uniform / clustered; int8 0.918-0.984 / 0.984-1.0.
  constexpr bool int8 = std::is_same_v<S, quantized_minmax_summary>;
  constexpr double uniform_floor = exact ? 1.0 : (int8 ? 0.9 : 0.97);
  constexpr double clustered_floor = exact ? 1.0 : (int8 ? 0.98 : 0.99);
  const kv_layout l{1, 8, 2, 64, 16, dtype::f16};
  const std::uint32_t len = 16384, blocks = len / 16;
  const std::uint32_t planted[] = {17, 260, 511, 700, 1001};
  const selection_params sp{blocks / 16, 1, 2};
  for (const bool clustered : {false, true}) {
    CAPTURE(clustered);
    world<minmax_summary<float>> ref(l, len, 2, 31);
    world<S> fast(l, len, 2, 31);  // the same seed: the same keys, slots, ids and queries
    if (clustered) {
      cluster_keys(ref, 5);
      cluster_keys(fast, 5);
    }
    plant(ref, planted);
    plant(fast, planted);
    selection want_shared, got_shared, want_heads, got_heads;
    lookahead_predictor<minmax_summary<float>, max_aggregation>{}.select(ref.input(), sp,
                                                                         want_shared);
    lookahead_predictor<S, max_aggregation>{}.select(fast.input(), sp, got_shared);
    lookahead_predictor<minmax_summary<float>, max_aggregation, per_kv_head_selection>{}.select(
        ref.input(), sp, want_heads);
    lookahead_predictor<S, max_aggregation, per_kv_head_selection>{}.select(fast.input(), sp,
                                                                            got_heads);
    for (std::uint32_t i = 0; i < 5; ++i) {
      CAPTURE(planted[i]);
      const auto t = got_shared.table(0);
      CHECK(std::binary_search(t.begin(), t.end(), planted[i]));
      const auto th = got_heads.table(i % 2);
      CHECK(std::binary_search(th.begin(), th.end(), planted[i]));
    }
    const double agree[3] = {agreement(got_shared.table(0), want_shared.table(0), blocks, sp),
                             agreement(got_heads.table(0), want_heads.table(0), blocks, sp),
                             agreement(got_heads.table(1), want_heads.table(1), blocks, sp)};
    MESSAGE(std::string(clustered ? "clustered" : "uniform"),
            " keys, agreement with the exact bound: shared ", agree[0], ", kv head 0 ", agree[1],
            ", kv head 1 ", agree[2]);
    for (const double a : agree) {
      CHECK(a >= (clustered ? clustered_floor : uniform_floor));
    }
  }
}

namespace {

// The adaptive budget's model, independent of block_selector: masses sorted in full, the
// ledger kept here.
struct adaptive_model {
  std::uint64_t credit = 0;

  std::vector<std::uint32_t> select(const std::vector<float>& mass, const selection_params& sp) {
    const auto n = static_cast<std::uint32_t>(mass.size());
    const std::uint32_t sinks = std::min(sp.sink_blocks, n);
    const std::uint32_t recent = std::min(std::max(sp.recent_blocks, 1u), n - sinks);
    const std::uint32_t cap = sp.max_blocks != 0 ? sp.max_blocks : 2 * sp.budget_blocks;
    const std::uint64_t limit =
        std::min<std::uint64_t>({cap, std::uint64_t{sp.budget_blocks} + credit, n});
    std::vector<std::uint32_t> chosen;
    double total = 0.0, covered = 0.0;
    std::vector<std::uint32_t> cand;
    for (std::uint32_t i = 0; i < n; ++i) {
      const bool kept = i < sinks || i >= n - recent;
      const double m = std::isnan(mass[i]) ? 0.0 : std::max(0.0, double{mass[i]});
      total += m;
      if (kept) {
        chosen.push_back(i);
        covered += m;
      } else {
        cand.push_back(i);
      }
    }
    // NaN first, then by mass, ties to the lower index.
    auto key = [&](std::uint32_t i) {
      return std::isnan(mass[i]) ? std::numeric_limits<double>::infinity() : double{mass[i]};
    };
    std::stable_sort(cand.begin(), cand.end(),
                     [&](std::uint32_t a, std::uint32_t b) { return key(a) > key(b); });
    const double goal = double{sp.target_mass} * total;
    for (std::uint32_t i : cand) {
      if (chosen.size() >= limit) {
        break;
      }
      const bool needed = std::isnan(mass[i]) || (covered < goal && mass[i] > 0.0f);
      if (!needed) {
        break;
      }
      chosen.push_back(i);
      covered += std::isnan(mass[i]) ? 0.0 : double{mass[i]};
    }
    std::sort(chosen.begin(), chosen.end());
    credit = std::min<std::uint64_t>(
        credit + sp.budget_blocks - chosen.size(),
        std::uint64_t{block_selector::max_credit_budgets} * sp.budget_blocks);
    return chosen;
  }
};

// A table whose mass sits in one block (peaked) or spreads evenly (diffuse), with noise.
std::vector<float> mass_table(std::uint32_t n, bool peaked, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(0.5f, 1.0f);
  std::vector<float> m(n);
  for (float& x : m) {
    x = peaked ? 1e-4f * u(rng) : u(rng);
  }
  if (peaked) {
    m[std::uniform_int_distribution<std::uint32_t>(0, n - 1)(rng)] = 1.0f;
  }
  return m;
}

}  // namespace

TEST_CASE("adaptive budget: the fewest blocks covering the target share, as a full sort says") {
  for (const cpu_isa isa : {cpu_isa::scalar, cpu_isa::avx2, cpu_isa::avx512}) {
    if (!isa_supported(isa)) {
      continue;
    }
    CAPTURE(to_string(isa));
    std::mt19937 rng(31);
    for (const float target : {0.5f, 0.9f, 0.98f, 1.0f}) {
      for (const selection_params base :
           {selection_params{4, 1, 1}, selection_params{8, 2, 3}, selection_params{6, 0, 1},
            selection_params{5, 1, 1, 0.0f, 7}}) {
        selection_params sp = base;
        sp.target_mass = target;
        CAPTURE(target);
        CAPTURE(sp.budget_blocks);
        CAPTURE(sp.max_blocks);
        block_selector sel{isa};
        adaptive_model model;
        std::uint64_t taken = 0, calls = 0;
        for (int call = 0; call < 60; ++call) {
          const std::uint32_t n = std::uniform_int_distribution<std::uint32_t>(1, 90)(rng);
          std::vector<float> mass;
          const int kind = call % 4;
          if (kind < 2) {
            mass = mass_table(n, kind == 0, rng);
          } else {  // random, with zeros, negatives (no mass), ties and the odd NaN
            std::uniform_int_distribution<int> pick(0, 40);
            mass.resize(n);
            for (float& x : mass) {
              const int r = pick(rng);
              x = r == 0   ? std::numeric_limits<float>::quiet_NaN()
                  : r < 4  ? 0.0f
                  : r < 6  ? -1.0f
                  : r < 10 ? 0.25f
                           : std::exponential_distribution<float>(2.0f)(rng);
            }
          }
          CAPTURE(call);
          CAPTURE(n);
          std::vector<std::uint32_t> got;
          sel.append_table(mass.data(), n, sp, got);
          const std::vector<std::uint32_t> want = model.select(mass, sp);
          CHECK(got == want);
          CHECK(sel.credit() == model.credit);
          CHECK(got.size() <= sp.block_cap());
          taken += got.size();
          ++calls;
        }
        // The ledger: the mean never exceeds the budget.
        CHECK(taken <= calls * sp.budget_blocks);
      }
    }
  }
}

TEST_CASE("adaptive budget: peaked tables take fewer blocks than the budget, diffuse ones more") {
  std::mt19937 rng(5);
  const selection_params sp{8, 1, 1, 0.9f};
  block_selector sel;
  const std::vector<float> peaked = mass_table(64, true, rng);
  std::vector<std::uint32_t> out;
  sel.append_table(peaked.data(), 64, sp, out);
  CHECK(out.size() < sp.budget_blocks);
  CHECK(out.size() <= 3);  // the sink, the recent block and the peak
  CHECK(sel.credit() == sp.budget_blocks - out.size());
  // The credit lets a diffuse table take more than the budget, up to the cap.
  const std::vector<float> diffuse = mass_table(64, false, rng);
  std::uint32_t more = 0;
  for (int i = 0; i < 3; ++i) {
    out.clear();
    sel.append_table(peaked.data(), 64, sp, out);
  }
  out.clear();
  sel.append_table(diffuse.data(), 64, sp, out);
  more = static_cast<std::uint32_t>(out.size());
  CHECK(more > sp.budget_blocks);
  CHECK(more == sp.block_cap());  // 90% of an even spread needs far more than 16 blocks
  // Without credit a diffuse table takes the budget, never more.
  block_selector fresh;
  out.clear();
  fresh.append_table(diffuse.data(), 64, sp, out);
  CHECK(out.size() == sp.budget_blocks);
  CHECK(fresh.credit() == 0);
}

TEST_CASE("adaptive budget: the ledger's mean tracks the budget over many tables") {
  std::mt19937 rng(77);
  const selection_params sp{16, 1, 2, 0.95f, 64};  // a diffuse table spends a pair's credit
  block_selector sel;
  std::uint64_t taken = 0;
  const int calls = 2000;
  for (int i = 0; i < calls; ++i) {
    const std::vector<float> m = mass_table(200, (i % 3) != 0, rng);  // 2 peaked : 1 diffuse
    std::vector<std::uint32_t> out;
    sel.append_table(m.data(), 200, sp, out);
    taken += out.size();
    REQUIRE(sel.credit() <= std::uint64_t{block_selector::max_credit_budgets} * sp.budget_blocks);
  }
  // Never above the budget on average, and the credit left is all that was not spent.
  CHECK(taken <= std::uint64_t{calls} * sp.budget_blocks);
  CHECK(taken + sel.credit() == std::uint64_t{calls} * sp.budget_blocks);
  sel.reset_credit();
  CHECK(sel.credit() == 0);
}

TEST_CASE("adaptive budget with max aggregation: the mass is a softmax of the logits") {
  std::mt19937 rng(8);
  std::normal_distribution<float> logit(0.0f, 4.0f);
  const float scale = 0.125f;
  for (const float target : {0.6f, 0.9f, 0.99f}) {
    const selection_params sp{6, 1, 1, target};
    block_selector by_logits, by_mass;
    for (int call = 0; call < 40; ++call) {
      const std::uint32_t n = 50;
      std::vector<float> lg(n), mass(n);
      for (float& x : lg) {
        x = logit(rng);
      }
      const float top = *std::max_element(lg.begin(), lg.end());
      for (std::uint32_t i = 0; i < n; ++i) {
        mass[i] = std::exp(scale * (lg[i] - top));  // as the selector computes it
      }
      std::vector<std::uint32_t> a, b;
      by_logits.append_table(lg.data(), n, sp, a, scale);
      by_mass.append_table(mass.data(), n, sp, b);
      CHECK(a == b);
    }
  }
}

TEST_CASE_TEMPLATE("importance predictor: target_mass 0 is the fixed budget; adaptive invariants",
                   P, OASISKV_PREDICTORS) {
  using S = typename P::summary_type;
  const kv_layout l{1, 8, 2, 16, 4, dtype::f16};
  for (const std::uint32_t len : {3u, 64u, 203u}) {
    world<S> w(l, len, 3, len + 11);
    const std::uint32_t blocks = l.blocks_for(len);
    const std::uint32_t tables = per_head<P> ? l.num_kv_heads : 1;
    CAPTURE(len);
    // target 0 with any cap: the same selection as without the new fields.
    P fixed, capped;
    selection a, b;
    fixed.select(w.input(), {5, 1, 2}, a);
    capped.select(w.input(), {5, 1, 2, 0.0f, 9}, b);
    CHECK(a.blocks == b.blocks);
    CHECK(a.offsets == b.offsets);
    // Adaptive: ascending tables holding the kept blocks, never above the cap, the sum over
    // the calls never above the budget's; no allocation in steady state.
    for (const float target : {0.5f, 0.9f, 1.0f}) {
      const selection_params sp{5, 1, 2, target, 8};
      P p;
      selection s;
      std::uint64_t taken = 0, counted = 0;
      for (int call = 0; call < 4; ++call) {
        const long before = allocations.load();
        p.select(w.input(), sp, s);
        if (call >= 2) {
          CHECK(allocations.load() - before == 0);
        }
        REQUIRE(s.tables == tables);
        for (std::uint32_t t = 0; t < tables; ++t) {
          const auto tab = s.table(t);
          CHECK(tab.size() <= std::min(sp.block_cap(), blocks));
          CHECK(tab.size() >= std::min(3u, blocks));
          CHECK(std::adjacent_find(tab.begin(), tab.end(), std::greater_equal<>()) == tab.end());
          CHECK(tab.front() == 0);
          CHECK(tab.back() == blocks - 1);
          taken += tab.size();
          ++counted;
        }
      }
      if constexpr (reads_queries<P>) {
        CHECK(taken <= counted * sp.budget_blocks);
      }
    }
  }
}

// Predictor P on `runner` selects what P alone selects from `in`; returns the selection.
template <class P, class S>
selection same_on_pool(cpu::loop_runner& runner, const prediction_input<S>& in,
                       const selection_params& sp) {
  P serial, parallel;
  parallel.set_thread_pool(&runner);
  selection a, b;
  serial.select(in, sp, a);
  parallel.select(in, sp, b);
  CHECK(a.tables == b.tables);
  CHECK(a.offsets == b.offsets);
  CHECK(a.blocks == b.blocks);
  return a;
}

TEST_CASE_TEMPLATE("summary-scoring predictors: KV heads scored on a pool select the same blocks",
                   S, minmax_summary<>, qminmax_int2_summary) {
  // 4 KV heads (more than the pool's threads), both granularities, 1 and 4 lookahead tokens:
  // the heads are scored concurrently and folded in order, so the tables are identical.
  const kv_layout l{1, 8, 4, 64, 16, dtype::f16};
  cpu::thread_pool pool(2);
  for (const std::uint32_t tokens : {1u, 4u}) {
    world<S> w(l, 3000, tokens, 31 + tokens);
    const selection_params sp{24, 1, 2};
    CAPTURE(tokens);
    {
      lookahead_predictor<S> serial, parallel;
      parallel.set_thread_pool(&pool);
      CHECK(parallel.thread_pool() == &pool);
      selection a, b;
      for (int round = 0; round < 3; ++round) {  // scratch reused across calls
        serial.select(w.input(), sp, a);
        parallel.select(w.input(), sp, b);
        CHECK(a.offsets == b.offsets);
        CHECK(a.blocks == b.blocks);
      }
    }
    CHECK(same_on_pool<lookahead_predictor<S, softmax_mass_aggregation, per_kv_head_selection>>(
              pool, w.input(), sp)
              .tables == l.num_kv_heads);
  }
}

// A `cpu::loop_runner` of someone else's threads, as an engine lends them: it claims 3 threads
// and runs the items on the caller, last to first (the order a loop's items run in must not
// matter).
class reversed_runner final : public cpu::loop_runner {
 public:
  unsigned size() const noexcept override { return 3; }
  void run(std::size_t n, void (*fn)(void* ctx, std::size_t i), void* ctx) override {
    ++loops;
    for (std::size_t i = n; i-- > 0;) {
      fn(ctx, i);
    }
  }
  int loops = 0;
};

TEST_CASE_TEMPLATE("summary-scoring predictors: any loop_runner selects the same blocks", S,
                   minmax_summary<>, qminmax_int2_summary, qminmax_int4_cascade) {
  // 1 and 4 KV heads (a two-stage summary's single head is scored in ranges), 4 lookahead tokens.
  for (const std::uint32_t kv : {1u, 4u}) {
    const kv_layout l{1, 2 * kv, kv, 64, 16, dtype::f16};
    world<S> w(l, 3000, 4, 71 + kv);
    const selection_params sp{12, 1, 2};
    reversed_runner runner;
    CAPTURE(kv);
    same_on_pool<lookahead_predictor<S>>(runner, w.input(), sp);
    const bool used = runner.loops > 0;
    CHECK(used == (kv > 1 || split_two_stage_summary<S>));
  }
}

TEST_CASE_TEMPLATE("two-stage summaries: a head's blocks scored in ranges select the same blocks",
                   S, qminmax_int2_summary, qminmax_int4_cascade) {
  static_assert(split_two_stage_summary<S>);
  // Fewer (input, KV head) pairs than twice the pool's threads: each head's bounds and fine
  // scores run in ranges of blocks on the pool, with one top-k per head in between. 1 and 3 KV
  // heads, pools of 2 and 3 threads, 1 and 4 lookahead tokens, a budget whose contenders are a
  // part of the blocks and one (a short sequence) whose contenders are all of them; both
  // granularities; select and select_many.
  for (const std::uint32_t kv : {1u, 3u}) {
    const kv_layout l{1, 3 * kv, kv, 64, 16, dtype::f16};
    for (const unsigned threads : {2u, 3u}) {
      cpu::thread_pool pool(threads);
      for (const std::uint32_t tokens : {1u, 4u}) {
        for (const std::uint32_t len : {3000u, 400u}) {
          CAPTURE(kv);
          CAPTURE(threads);
          CAPTURE(tokens);
          CAPTURE(len);
          world<S> w(l, len, tokens, 57 + tokens + kv);
          const selection_params sp{12, 1, 2};
          const std::uint32_t blocks = l.blocks_for(len);
          REQUIRE((w.summary->contenders(blocks, sp.budget_blocks) < blocks) == (len == 3000));
          {
            lookahead_predictor<S> serial, parallel;
            parallel.set_thread_pool(&pool);
            selection a, b;
            for (int round = 0; round < 2; ++round) {
              serial.select(w.input(), sp, a);
              parallel.select(w.input(), sp, b);
              REQUIRE(!a.blocks.empty());
              CHECK(a.offsets == b.offsets);
              CHECK(a.blocks == b.blocks);
            }
            // select_many of one input takes the same path.
            const std::vector<prediction_input<S>> ins{w.input()};
            selection c;
            std::vector<selection*> outs{&c};
            parallel.select_many(std::span<const prediction_input<S>>(ins), sp,
                                 std::span<selection* const>(outs));
            CHECK(c.blocks == a.blocks);
          }
          CHECK(
              same_on_pool<lookahead_predictor<S, softmax_mass_aggregation, per_kv_head_selection>>(
                  pool, w.input(), sp)
                  .tables == kv);
          same_on_pool<lookahead_predictor<S, max_aggregation>>(pool, w.input(), sp);
        }
      }
    }
  }
}

TEST_CASE_TEMPLATE("summary-scoring predictors: select_many equals one select per input", S,
                   minmax_summary<>, qminmax_int2_summary) {
  // Three sequences of different lengths and lookahead tokens, each with its own summary: the
  // batch's (input, KV head) pairs are scored together on a pool, or in turn without one, and
  // every selection must equal what `select` gives for its input alone (independent predictor).
  const kv_layout l{1, 8, 4, 64, 16, dtype::f16};
  cpu::thread_pool pool(2);
  world<S> w0(l, 3000, 1, 41), w1(l, 1100, 4, 42), w2(l, 2500, 2, 43);
  const selection_params sp{24, 1, 2};
  const std::vector<prediction_input<S>> ins{w0.input(), w1.input(), w2.input()};
  const auto check_batch = [&](auto& batched, auto& alone) {
    std::vector<selection> got(3), want(3);
    std::vector<selection*> outs{&got[0], &got[1], &got[2]};
    for (int round = 0; round < 2; ++round) {  // scratch reused across calls
      batched.select_many(std::span<const prediction_input<S>>(ins), sp,
                          std::span<selection* const>(outs));
      for (std::size_t i = 0; i < ins.size(); ++i) {
        CAPTURE(i);
        alone.select(ins[i], sp, want[i]);
        REQUIRE(!want[i].blocks.empty());
        CHECK(got[i].tables == want[i].tables);
        CHECK(got[i].offsets == want[i].offsets);
        CHECK(got[i].blocks == want[i].blocks);
      }
    }
  };
  SUBCASE("shared tables, on a pool") {
    lookahead_predictor<S> batched, alone;
    batched.set_thread_pool(&pool);
    check_batch(batched, alone);
  }
  SUBCASE("shared tables, no pool") {
    lookahead_predictor<S> batched, alone;
    check_batch(batched, alone);
  }
  SUBCASE("a table per KV head, on a pool") {
    lookahead_predictor<S, softmax_mass_aggregation, per_kv_head_selection> batched, alone;
    batched.set_thread_pool(&pool);
    check_batch(batched, alone);
  }
  SUBCASE("bad input: nothing is written") {
    lookahead_predictor<S> p;
    p.set_thread_pool(&pool);
    selection a, b;
    a.blocks = {7};
    b.blocks = {9};
    std::vector<selection*> outs{&a, &b};
    std::vector<prediction_input<S>> bad{w0.input(), w1.input()};
    std::vector<std::uint32_t> short_ids(w1.ids.begin(), w1.ids.end() - 1);
    bad[1].summary_ids = short_ids;
    CHECK_THROWS_WITH_AS(p.select_many(std::span<const prediction_input<S>>(bad), sp,
                                       std::span<selection* const>(outs)),
                         doctest::Contains("summary_ids.size()"), oasiskv::error);
    CHECK(a.blocks == std::vector<std::uint32_t>{7});
    CHECK(b.blocks == std::vector<std::uint32_t>{9});
    CHECK_THROWS_WITH_AS(p.select_many(std::span<const prediction_input<S>>(ins), sp,
                                       std::span<selection* const>(outs)),
                         doctest::Contains("3 inputs but 2 outputs"), oasiskv::error);
    outs[1] = nullptr;
    CHECK_THROWS_WITH_AS(p.select_many(std::span<const prediction_input<S>>(ins.data(), 2), sp,
                                       std::span<selection* const>(outs)),
                         doctest::Contains("outs[1] is null"), oasiskv::error);
    CHECK(a.blocks == std::vector<std::uint32_t>{7});
  }
}
