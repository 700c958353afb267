// SPDX-License-Identifier: Apache-2.0
// The facade assembled from every combination of the shipped predictors, schedulers and kernels
// runs one suite: with a budget covering the whole context, attend equals dense attention; at
// budgets of 1/8 to 1/2 of the context, the blocks each attend reports it read are the
// predictor's selection recomputed outside the cache (a summary built from the capacity tier's
// blocks, the same queries, the sinks and recent window added), and its output equals
// reference_decode over exactly those blocks read from the capacity tier. One translation unit per
// scheduler (combinations_*.test.cpp) includes this header, so the builds of the many
// instantiations run in parallel.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <random>
#include <type_traits>
#include <vector>

#include "oasiskv/oasiskv.hpp"
#include "support/kv_fixture.hpp"

namespace oasiskv::testing::combinations {

using namespace oasiskv;

template <class Predictor, class Scheduler, class Kernel>
struct bundle {
  using allocator = free_list_allocator;
  using fast_tier = host_tier;
  using slow_tier = host_tier;
  using transfer = cpu_copy_engine;
  using predictor = Predictor;
  using scheduler = Scheduler;
  using kernel = Kernel;
};

template <class... Ts>
struct type_list {};

// Every shipped predictor (each summary, aggregation and granularity at least once; the
// default aggregation is softmax mass).
using predictors =
    type_list<lookahead_predictor<minmax_summary<>>, lookahead_predictor<mean_summary>,
              lookahead_predictor<minmax_summary<>, max_aggregation>,
              lookahead_predictor<int8_key_summary>,
              lookahead_predictor<int4_key_summary, confidence_weighted_aggregation>,
              lookahead_predictor<qminmax_int4_cascade>, lookahead_predictor<qminmax_int2_summary>,
              lookahead_predictor<minmax_summary<>, max_aggregation, per_kv_head_selection>,
              current_query_predictor<minmax_summary<>>, recency_predictor, oracle_predictor<>>;

inline const kv_layout layout{2, 4, 2, 16, 4, dtype::f32};
inline constexpr float scale = 0.25f;

inline std::vector<std::byte> random_rows(std::uint32_t n, std::mt19937& rng) {
  std::vector<std::byte> rows(std::size_t{n} * layout.num_kv_heads * layout.row_bytes());
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  float* p = reinterpret_cast<float*>(rows.data());
  for (std::size_t i = 0; i < rows.size() / 4; ++i) {
    p[i] = u(rng);
  }
  return rows;
}
inline std::vector<float> random_queries(std::uint32_t n, std::mt19937& rng) {
  std::vector<float> q(std::size_t{n} * layout.num_q_heads * layout.head_dim);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (float& x : q) {
    x = u(rng);
  }
  return q;
}
template <class Cache>
void append_all_layers(Cache& c, sequence_id s, std::uint32_t n, std::mt19937& rng) {
  for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
    auto k = random_rows(n, rng), v = random_rows(n, rng);
    c.append(s, l, k.data(), v.data(), n);
  }
}
// Attention over `blocks` (indices) of (s, layer), read in place from the capacity tier.
template <class Cache>
void reference_over(Cache& c, sequence_id s, std::uint32_t layer,
                    const std::vector<std::uint32_t>& blocks, std::uint32_t tables,
                    const std::vector<std::uint32_t>& table_offsets, const float* q,
                    std::uint32_t q_len, float* out, float* lse) {
  const auto slots = c.block_slots(s, layer);
  std::vector<block_ref> refs;
  for (std::uint32_t b : blocks) {
    refs.push_back({slots[b], b});
  }
  const std::uint32_t len = c.length(s, layer);
  decode_params p{q,
                  c.capacity_tier().view(),
                  {refs.data(), table_offsets.data(), 1, tables},
                  &len,
                  out,
                  lse,
                  1,
                  q_len,
                  scale};
  reference_decode{}.decode(p);
}

template <class Predictor, class Scheduler, class Kernel>
void full_budget_equals_dense() {
  using B = bundle<Predictor, Scheduler, Kernel>;
  std::mt19937 rng(21);
  tiered_kv_cache<B> cache(host_tier(layout, 128), host_tier(layout, 96),
                           {.budget_tokens = 256, .scale = scale});
  const sequence_id s = cache.add_sequence();
  append_all_layers(cache, s, 29, rng);
  for (int step = 0; step < 4; ++step) {
    const std::uint32_t q_len = 1 + static_cast<std::uint32_t>(step % 3);
    append_all_layers(cache, s, q_len, rng);
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      auto draft = random_queries(2, rng);
      cache.lookahead(s, l, {draft.data(), nullptr, 2});
      auto q = random_queries(q_len, rng);
      std::vector<float> out(q.size()), lse(q_len * layout.num_q_heads);
      std::vector<float> ref(q.size()), ref_lse(lse.size());
      const sequence_id one[1] = {s};
      cache.attend(one, l, q.data(), q_len, out.data(), lse.data());
      const std::uint32_t n = layout.blocks_for(cache.length(s, l));
      std::vector<std::uint32_t> all(n);
      for (std::uint32_t b = 0; b < n; ++b) {
        all[b] = b;
      }
      reference_over(cache, s, l, all, 1, {0, n}, q.data(), q_len, ref.data(), ref_lse.data());
      REQUIRE(oasiskv::testing::max_rel_error(out, ref) < 1e-5);
      REQUIRE(oasiskv::testing::max_rel_error(lse, ref_lse) < 1e-5);
    }
  }
  CHECK(cache.audit() > 0);
}

// The table the cache should attend for (s, layer), computed without it: a fresh summary of
// every block from the capacity tier, the test's own predictor `p` (its only state is an
// adaptive budget's ledger, which sees the same calls in the same order as the cache's), the
// same queries and selection_params `sp`, then the sinks and the recent window of the current
// length added to each table (sorted, unique).
template <class Predictor, class Cache>
selection expected_selection(Cache& c, sequence_id s, std::uint32_t layer, query_view queries,
                             const cache_options& o, Predictor& p, const selection_params& sp) {
  using summary = typename Predictor::summary_type;
  const auto slots = c.block_slots(s, layer);
  const std::uint32_t len = c.length(s, layer);
  const std::uint32_t n = static_cast<std::uint32_t>(slots.size());
  prediction_input<summary> in;
  in.layout = layout;
  in.seq_len = len;
  std::vector<std::uint32_t> ids(slots.begin(), slots.end());
  std::optional<summary> sum;
  if constexpr (!std::is_same_v<summary, no_summary>) {
    sum.emplace(layout, c.capacity_tier().num_slots());
    for (std::uint32_t b = 0; b < n; ++b) {
      const std::uint32_t filled =
          std::min(layout.tokens_per_block, len - b * layout.tokens_per_block);
      sum->reset(slots[b]);
      sum->update(slots[b], c.capacity_tier().slot_data(slots[b]), 0, filled);
    }
    in.summaries = &*sum;
  }
  in.summary_ids = ids;
  in.queries = queries;
  in.keys = c.capacity_tier().view();
  in.key_slots = slots;
  selection sel;
  p.select(in, sp, sel);
  selection full;
  full.tables = sel.tables;
  full.offsets.assign(1, 0);
  for (std::uint32_t t = 0; t < sel.tables; ++t) {
    std::vector<std::uint32_t> table(sel.table(t).begin(), sel.table(t).end());
    for (std::uint32_t b = 0; b < std::min(o.sink_blocks, n); ++b) {
      table.push_back(b);
    }
    for (std::uint32_t b = n > o.recent_blocks ? n - o.recent_blocks : 0; b < n; ++b) {
      table.push_back(b);
    }
    std::sort(table.begin(), table.end());
    table.erase(std::unique(table.begin(), table.end()), table.end());
    full.blocks.insert(full.blocks.end(), table.begin(), table.end());
    full.offsets.push_back(static_cast<std::uint32_t>(full.blocks.size()));
  }
  return full;
}

// `target_mass` > 0: an adaptive budget, its cap the cache's default (twice the budget: the
// fast tier's 64 slots hold it), the expected selections from one predictor whose ledger
// follows the cache's.
template <class Predictor, class Scheduler, class Kernel>
void small_budget_equals_reference_over_selection(float target_mass = 0.0f) {
  using B = bundle<Predictor, Scheduler, Kernel>;
  CAPTURE(target_mass);
  for (const std::uint32_t budget_blocks : {3u, 6u, 12u}) {  // 1/8, 1/4, 1/2 of ~24 blocks
    CAPTURE(budget_blocks);
    std::mt19937 rng(55 + budget_blocks);
    const cache_options o{.budget_tokens = budget_blocks * layout.tokens_per_block,
                          .sink_blocks = 1,
                          .recent_blocks = 1,
                          .scale = scale,
                          .target_mass = target_mass};
    const selection_params sp{budget_blocks, o.sink_blocks, o.recent_blocks, target_mass,
                              target_mass != 0.0f ? 2 * budget_blocks : 0};
    const std::uint32_t cap = target_mass != 0.0f ? 2 * budget_blocks : budget_blocks;
    Predictor expect;
    std::uint64_t taken = 0, tables = 0;
    tiered_kv_cache<B> cache(host_tier(layout, 128), host_tier(layout, 64), o);
    const sequence_id s = cache.add_sequence();
    append_all_layers(cache, s, 90, rng);  // 23 blocks
    for (int step = 0; step < 4; ++step) {
      const std::uint32_t q_len = 1 + static_cast<std::uint32_t>(step % 3);
      append_all_layers(cache, s, q_len, rng);
      for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
        CAPTURE(step);
        CAPTURE(l);
        auto draft = random_queries(2, rng);
        const query_view lookahead_q{draft.data(), nullptr, 2};
        cache.lookahead(s, l, lookahead_q);
        auto q = random_queries(q_len, rng);
        const query_view step_q{q.data(), nullptr, q_len};
        const selection want = expected_selection<Predictor>(
            cache, s, l, Predictor::timing == prediction_timing::lookahead ? lookahead_q : step_q,
            o, expect, sp);
        std::vector<float> out(q.size()), lse(q_len * layout.num_q_heads);
        const sequence_id one[1] = {s};
        attended_blocks got;
        cache.attend(one, l, q.data(), q_len, out.data(), lse.data(), &got);
        REQUIRE(got.sequences() == 1);
        REQUIRE(got.tables_per_seq == want.tables);
        const std::uint32_t n = layout.blocks_for(cache.length(s, l));
        for (std::uint32_t t = 0; t < want.tables; ++t) {
          CAPTURE(t);
          std::vector<std::uint32_t> table(got.table(0, t).begin(), got.table(0, t).end());
          std::sort(table.begin(), table.end());
          const std::vector<std::uint32_t> expected(want.table(t).begin(), want.table(t).end());
          CHECK(table == expected);
          CHECK(table.size() <= std::size_t{cap} + o.sink_blocks + o.recent_blocks);
          if (target_mass == 0.0f) {
            CHECK(table.size() < n);  // a real selection, not the whole context
          }
          taken += table.size();
          ++tables;
        }
        std::vector<float> ref(q.size()), ref_lse(lse.size());
        reference_over(cache, s, l, got.blocks, got.tables_per_seq, got.offsets, q.data(), q_len,
                       ref.data(), ref_lse.data());
        REQUIRE(oasiskv::testing::max_rel_error(out, ref) < 1e-5);
        REQUIRE(oasiskv::testing::max_rel_error(lse, ref_lse) < 1e-5);
      }
    }
    CHECK(cache.audit() > 0);
    // On average within the budget (plus the window a late lookahead adds: one block here).
    CHECK(taken <= tables * (std::uint64_t{budget_blocks} + 1));
  }
}

template <class Scheduler, class Kernel>
void oracle_equals_sparse_over_its_selection() {
  using B = bundle<oracle_predictor<>, Scheduler, Kernel>;
  std::mt19937 rng(34);
  const cache_options o{.budget_tokens = 24, .sink_blocks = 1, .recent_blocks = 1, .scale = scale};
  tiered_kv_cache<B> cache(host_tier(layout, 128), host_tier(layout, 64), o);
  const sequence_id s = cache.add_sequence();
  append_all_layers(cache, s, 90, rng);  // 23 blocks, 6 selected
  oracle_predictor<> oracle;
  for (int step = 0; step < 5; ++step) {
    append_all_layers(cache, s, 1, rng);
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      auto q = random_queries(1, rng);
      std::vector<float> out(q.size()), lse(layout.num_q_heads);
      const sequence_id one[1] = {s};
      cache.attend(one, l, q.data(), 1, out.data(), lse.data());
      // The oracle's selection, computed independently over the capacity tier's keys.
      const auto slots = cache.block_slots(s, l);
      prediction_input<no_summary> in;
      in.layout = layout;
      in.seq_len = cache.length(s, l);
      in.summary_ids = slots;
      in.queries = {q.data(), nullptr, 1};
      in.keys = cache.capacity_tier().view();
      in.key_slots = slots;
      selection sel;
      oracle.select(in, {o.budget_tokens / layout.tokens_per_block, 1, 1}, sel);
      REQUIRE(sel.blocks.size() == 6);
      std::vector<float> ref(q.size()), ref_lse(lse.size());
      reference_over(cache, s, l, sel.blocks, sel.tables, sel.offsets, q.data(), 1, ref.data(),
                     ref_lse.data());
      REQUIRE(oasiskv::testing::max_rel_error(out, ref) < 1e-5);
      REQUIRE(oasiskv::testing::max_rel_error(lse, ref_lse) < 1e-5);
    }
  }
  CHECK(cache.stats().step.misses > 0);  // fetch-on-miss did fetch
}

// Every predictor with scheduler `S` and kernel `Kernel`: a full budget equals dense attention,
// and small budgets attend the predictor's own selection, exactly.
template <class S, class Kernel, class... Ps>
void full_budget_equals_dense_for_all(type_list<Ps...>) {
  (full_budget_equals_dense<Ps, S, Kernel>(), ...);
  (small_budget_equals_reference_over_selection<Ps, S, Kernel>(), ...);
}

// Sanitizer builds define OASISKV_COMBINATIONS_SUBSET: under ASan+UBSan every instantiation of
// the facade costs several seconds to compile, so there the small-budget check (which runs the
// predictor, the scheduler's staging and the kernel through the facade) covers every predictor
// with one scheduler and the default lookahead predictor with the others, with the sparse kernel
// (reference_decode is tested on its own), while the -Werror build runs the whole cross
// product, full budgets and both kernels.
#if OASISKV_COMBINATIONS_SUBSET
inline constexpr bool full_cross = false;
#else
inline constexpr bool full_cross = true;
#endif

// The suite for one scheduler: every predictor with both kernels, full and small budgets; in
// the subset, the small budget with the sparse kernel, for every predictor (`EveryPredictor`)
// or the default lookahead predictor.
template <class S, class... Ps>
void small_budget_for_all(type_list<Ps...>) {
  (small_budget_equals_reference_over_selection<Ps, S, cpu::sparse_decode>(), ...);
}

template <class S, bool EveryPredictor = full_cross>
void run_scheduler_suite() {
  using default_lookahead = lookahead_predictor<minmax_summary<>>;
  // Adaptive budgets through every scheduler: softmax mass, and max aggregation per KV head
  // (its logits' softmax), and the oracle's exact mass.
  small_budget_equals_reference_over_selection<default_lookahead, S, cpu::sparse_decode>(0.9f);
  small_budget_equals_reference_over_selection<
      lookahead_predictor<int8_key_summary, max_aggregation, per_kv_head_selection>, S,
      cpu::sparse_decode>(0.95f);
  small_budget_equals_reference_over_selection<oracle_predictor<>, S, cpu::sparse_decode>(0.8f);
  if constexpr (full_cross) {
    full_budget_equals_dense_for_all<S, cpu::sparse_decode>(predictors{});
    full_budget_equals_dense_for_all<S, reference_decode>(predictors{});
  } else if constexpr (EveryPredictor) {
    small_budget_for_all<S>(predictors{});
  } else {
    small_budget_equals_reference_over_selection<default_lookahead, S, cpu::sparse_decode>();
  }
}

}  // namespace oasiskv::testing::combinations
