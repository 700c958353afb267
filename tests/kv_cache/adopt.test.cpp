// SPDX-License-Identifier: Apache-2.0
// tiered_kv_cache::adopt: sequences whose blocks already lie in the capacity tier. Over a plain
// host tier, and over a composite tier whose first part is read-only (the shape of a prefill
// node's memory, here an in-memory block-I/O tier), with the routing engine: decode steps match
// a cache that appended the same tokens, appends land in the local part, the read-only part is
// never written, and bad adoptions change nothing.
#include <doctest/doctest.h>

#include "support/expect_error.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "oasiskv/allocator/free_list_allocator.hpp"
#include "oasiskv/attention/reference_decode.hpp"
#include "oasiskv/disagg/wire_summary.hpp"
#include "oasiskv/kv_cache.hpp"
#include "oasiskv/predictor/lookahead_predictor.hpp"
#include "oasiskv/summary/mean_summary.hpp"
#include "oasiskv/summary/minmax_summary.hpp"
#include "oasiskv/summary/quantized_minmax_summary.hpp"
#include "oasiskv/tier/composite_tier.hpp"
#include "oasiskv/tier/host_tier.hpp"
#include "oasiskv/transfer/cpu_copy_engine.hpp"
#include "oasiskv/transfer/routing_engine.hpp"
#include "support/gated_io_tier.hpp"
#include "support/test_predictors.hpp"

using namespace oasiskv;
using oasiskv::testing::expect_error;
using oasiskv::testing::gated_io_tier;

namespace {

const kv_layout layout{2, 4, 2, 16, 8, dtype::f16};
using remote_part = composite_tier<gated_io_tier, host_tier>;

template <class Summary, class Slow, class Transfer, class Scheduler = lookahead_prefetcher<>,
          class Predictor = lookahead_predictor<Summary>>
struct bundle {
  using allocator = free_list_allocator;
  using fast_tier = host_tier;
  using slow_tier = Slow;
  using transfer = Transfer;
  using predictor = Predictor;
  using scheduler = Scheduler;
  using kernel = reference_decode;
};
template <class Summary>
using local_bundle_of = bundle<Summary, host_tier, cpu_copy_engine>;
template <class Summary>
using remote_bundle_of =
    bundle<Summary, remote_part, routing_engine<cpu_copy_engine, cpu_copy_engine>>;
using local_bundle = local_bundle_of<minmax_summary<>>;
using remote_bundle = remote_bundle_of<minmax_summary<>>;
using remote_mean_bundle =
    bundle<mean_summary, remote_part, routing_engine<cpu_copy_engine, cpu_copy_engine>>;
using remote_dense_bundle =
    bundle<minmax_summary<>, remote_part, routing_engine<cpu_copy_engine, cpu_copy_engine>,
           all_resident, oasiskv::testing::select_all_predictor>;

const cache_options options{.budget_tokens = 32, .sink_blocks = 1, .recent_blocks = 1};

std::vector<f16> random_rows(std::uint32_t n, std::mt19937& rng) {
  std::vector<f16> rows(std::size_t{n} * layout.num_kv_heads * layout.head_dim);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (f16& x : rows) {
    x = f16::from_float(u(rng));
  }
  return rows;
}

std::vector<float> random_queries(std::uint32_t n, std::mt19937& rng) {
  std::vector<float> q(std::size_t{n} * layout.num_q_heads * layout.head_dim);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (float& x : q) {
    x = u(rng);
  }
  return q;
}

// A prefill: `tokens` tokens appended to a plain cache, whose blocks are then shipped elsewhere.
template <class Summary = minmax_summary<>>
struct prefill {
  tiered_kv_cache<local_bundle_of<Summary>> cache{host_tier(layout, 512), host_tier(layout, 64),
                                                  options};
  sequence_id seq = cache.add_sequence();
  std::uint32_t tokens;

  prefill(std::uint32_t n, std::mt19937& rng) : tokens(n) {
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      const auto k = random_rows(n, rng), v = random_rows(n, rng);
      cache.append(seq, l, k.data(), v.data(), n);
    }
  }
  std::uint32_t blocks() const { return layout.blocks_for(tokens); }
  const std::byte* block(std::uint32_t l, std::uint32_t b) {
    return std::as_const(cache.capacity_tier()).slot_data(cache.block_slots(seq, l)[b]);
  }
  std::uint32_t filled(std::uint32_t b) const {
    return b + 1 < blocks() ? layout.tokens_per_block : tokens - b * layout.tokens_per_block;
  }
  // Copies every block into `slots` (layer-major) of the exporter's memory; returns the wire
  // summaries in the same order.
  std::vector<std::byte> ship(gated_io_tier& to, const std::vector<slot_id>& slots) {
    const std::size_t sb = disagg::summary_bytes(layout);
    std::vector<std::byte> summaries(slots.size() * sb);
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      for (std::uint32_t b = 0; b < blocks(); ++b) {
        const std::size_t i = std::size_t{l} * blocks() + b;
        std::memcpy(to.raw(slots[i]), block(l, b), layout.block_bytes());
        disagg::summarize_block(layout, block(l, b), filled(b), summaries.data() + i * sb);
      }
    }
    return summaries;
  }
};

template <class Bundle>
tiered_kv_cache<Bundle> remote_cache(std::uint32_t exporter_slots, std::uint32_t local_slots) {
  return tiered_kv_cache<Bundle>(
      remote_part(std::make_unique<gated_io_tier>(layout, exporter_slots),
                  std::make_unique<host_tier>(layout, local_slots), true),
      host_tier(layout, 64), options);
}

// Scattered exporter slots for `n` blocks.
std::vector<slot_id> scattered(std::uint32_t n, std::uint32_t of, std::mt19937& rng) {
  std::vector<slot_id> all(of);
  std::iota(all.begin(), all.end(), 0u);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(n);
  return all;
}

// Runs `steps` decode steps on both caches with the same tokens and queries; every output must
// be equal (same summaries, so the same selection over the same bytes).
template <class A, class B>
void decode_both(A& a, sequence_id sa, B& b, sequence_id sb, int steps, std::mt19937& rng) {
  for (int step = 0; step < steps; ++step) {
    const std::uint32_t q_len = 1 + static_cast<std::uint32_t>(step % 2);
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      const auto k = random_rows(q_len, rng), v = random_rows(q_len, rng);
      a.append(sa, l, k.data(), v.data(), q_len);
      b.append(sb, l, k.data(), v.data(), q_len);
      const auto draft = random_queries(2, rng);
      a.lookahead(sa, l, {draft.data(), nullptr, 2});
      b.lookahead(sb, l, {draft.data(), nullptr, 2});
      const auto q = random_queries(q_len, rng);
      std::vector<float> oa(q.size()), ob(q.size()), la(q_len * layout.num_q_heads), lb(la.size());
      const sequence_id one_a[1] = {sa}, one_b[1] = {sb};
      a.attend(one_a, l, q.data(), q_len, oa.data(), la.data());
      b.attend(one_b, l, q.data(), q_len, ob.data(), lb.data());
      for (std::size_t i = 0; i < oa.size(); ++i) {
        REQUIRE(oa[i] == doctest::Approx(ob[i]).epsilon(1e-6));
      }
      for (std::size_t i = 0; i < la.size(); ++i) {
        REQUIRE(la[i] == doctest::Approx(lb[i]).epsilon(1e-6));
      }
    }
  }
}

}  // namespace

static_assert(tiered_kv_cache<remote_bundle>::loads_summaries);
static_assert(tiered_kv_cache<remote_bundle_of<quantized_minmax_summary>>::loads_summaries);
static_assert(!tiered_kv_cache<remote_mean_bundle>::loads_summaries);

// Every shipped summary the cache loads: the f16 bounds as they are, and quantized to int8.
TEST_CASE_TEMPLATE(
    "adopt over a read-only part: decode equals appending, appends go to the local part", Summary,
    minmax_summary<>, quantized_minmax_summary) {
  std::mt19937 rng(21);
  for (const std::uint32_t prompt : {77u, 80u, 5u}) {  // a partial last block, full blocks, one
    CAPTURE(prompt);
    prefill<Summary> p(prompt, rng);
    auto cache = remote_cache<remote_bundle_of<Summary>>(200, 96);
    CHECK(cache.read_only_slots() == 200);
    gated_io_tier& exporter = cache.capacity_tier().first();
    const auto slots = scattered(layout.num_layers * p.blocks(), 200, rng);
    const auto summaries = p.ship(exporter, slots);
    std::vector<std::byte> before(std::size_t{200} * layout.block_bytes());
    std::memcpy(before.data(), exporter.raw(0), before.size());

    const sequence_id s = cache.adopt(prompt, slots, summaries);
    CHECK(cache.length(s, 1) == prompt);
    // Staged at adoption: the sink block and the recent window's full block, per layer.
    const std::uint32_t full = prompt / layout.tokens_per_block;
    const std::uint32_t expect = std::min(full, 1u) + (full > 1 && full == p.blocks() ? 1 : 0);
    CHECK(cache.stats().resident_blocks == layout.num_layers * expect);
    CHECK(cache.block_slots(s, 1) == std::vector<slot_id>(slots.begin() + p.blocks(), slots.end()));
    decode_both(cache, s, p.cache, p.seq, 12, rng);
    CHECK(cache.audit() > 0);  // staged copies equal the capacity tier's, read back through it

    // The exporter's memory was never written; the blocks from the first append on are local.
    CHECK(std::memcmp(before.data(), exporter.raw(0), before.size()) == 0);
    const std::uint32_t kept = prompt / layout.tokens_per_block;  // full adopted blocks
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      const auto now = cache.block_slots(s, l);
      CHECK(now.size() == layout.blocks_for(prompt + 18));
      for (std::uint32_t b = 0; b < now.size(); ++b) {
        if (b < kept) {
          CHECK(now[b] == slots[std::size_t{l} * p.blocks() + b]);
        } else {
          CHECK(now[b] >= 200);
        }
      }
    }
    const auto st = cache.stats();
    CHECK(st.bytes_prefetched > 0);
    CHECK(st.unpredicted == 0);
    // Removing gives the exporter's slots back to the reserve: they can be adopted again.
    cache.remove(s);
    const sequence_id again = cache.adopt(prompt, slots, summaries);
    CHECK(cache.length(again, 0) == prompt);
  }
}

TEST_CASE("adopt without loadable summaries reads the blocks; forks share adopted blocks") {
  std::mt19937 rng(8);
  prefill<> p(45, rng);
  auto cache = remote_cache<remote_mean_bundle>(64, 64);
  const auto slots = scattered(layout.num_layers * p.blocks(), 64, rng);
  const auto summaries = p.ship(cache.capacity_tier().first(), slots);
  // The shipped bytes are ignored by a summary that cannot load them.
  const sequence_id s = cache.adopt(45, slots, summaries);
  tiered_kv_cache<bundle<mean_summary, host_tier, cpu_copy_engine>> local(
      host_tier(layout, 512), host_tier(layout, 64), options);
  const sequence_id ls = local.add_sequence();
  for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
    for (std::uint32_t b = 0; b < p.blocks(); ++b) {
      // Re-append the prompt token by token from the shipped blocks.
      const std::byte* blk = p.block(l, b);
      for (std::uint32_t t = 0; t < p.filled(b); ++t) {
        std::vector<std::byte> k(layout.num_kv_heads * layout.row_bytes()), v(k.size());
        for (std::uint32_t h = 0; h < layout.num_kv_heads; ++h) {
          std::memcpy(k.data() + h * layout.row_bytes(),
                      blk + layout.key_offset(h) + t * layout.row_bytes(), layout.row_bytes());
          std::memcpy(v.data() + h * layout.row_bytes(),
                      blk + layout.value_offset(h) + t * layout.row_bytes(), layout.row_bytes());
        }
        local.append(ls, l, k.data(), v.data(), 1);
      }
    }
  }
  decode_both(cache, s, local, ls, 6, rng);
  // A fork shares the adopted blocks; each side's appends get their own local blocks.
  const sequence_id f = cache.fork(s);
  const auto k = random_rows(1, rng);
  for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
    cache.append(f, l, k.data(), k.data(), 1);
  }
  CHECK(cache.block_slots(f, 0)[0] == cache.block_slots(s, 0)[0]);
  CHECK(cache.block_slots(f, 0).back() != cache.block_slots(s, 0).back());
  cache.remove(s);
  CHECK(cache.length(f, 0) == cache.length(f, 1));
  (void)cache.audit();  // throws on a staged copy that differs from the capacity tier
}

TEST_CASE("adopt with the all_resident scheduler stages every full block (dense admission)") {
  std::mt19937 rng(4);
  prefill<> p(61, rng);
  auto cache = remote_cache<remote_dense_bundle>(64, 32);
  const auto slots = scattered(layout.num_layers * p.blocks(), 64, rng);
  const auto summaries = p.ship(cache.capacity_tier().first(), slots);
  const sequence_id s = cache.adopt(61, slots, summaries);
  CHECK(cache.stats().resident_blocks == layout.num_layers * (61 / layout.tokens_per_block));
  CHECK(cache.stats().bytes_prefetched ==
        std::uint64_t{layout.num_layers} * (61 / 8) * layout.block_bytes());
  const auto q = random_queries(1, rng);
  std::vector<float> out(q.size());
  const sequence_id one[1] = {s};
  cache.attend(one, 0, q.data(), 1, out.data());
  CHECK(cache.stats().step.misses == 1);  // only the partial block was not staged
  CHECK(cache.audit() == layout.num_layers * (61 / 8) + 1);
}

TEST_CASE("adopt over a plain host tier: slots of the pool, appends in place") {
  std::mt19937 rng(13);
  prefill<> p(30, rng);
  tiered_kv_cache<local_bundle> cache(host_tier(layout, 64), host_tier(layout, 64), options);
  CHECK(cache.read_only_slots() == 0);
  const std::vector<slot_id> slots{9, 3, 40, 41, 0, 7, 8, 63};  // 2 layers x 4 blocks
  for (std::uint32_t l = 0; l < 2; ++l) {
    for (std::uint32_t b = 0; b < 4; ++b) {
      std::memcpy(cache.capacity_tier().slot_data(slots[l * 4 + b]), p.block(l, b),
                  layout.block_bytes());
    }
  }
  const sequence_id s = cache.adopt(30, slots);  // summaries computed from the blocks
  decode_both(cache, s, p.cache, p.seq, 6, rng);
  CHECK(cache.block_slots(s, 0)[3] == 41);  // the partial block was appended to in place
  const auto fresh = cache.add_sequence();
  const auto k = random_rows(1, rng);
  cache.append(fresh, 0, k.data(), k.data(), 1);
  const slot_id got = cache.block_slots(fresh, 0)[0];
  CHECK(std::find(slots.begin(), slots.end(), got) == slots.end());  // never an adopted slot
}

TEST_CASE("adopt: bad adoptions name what is wrong and change nothing") {
  std::mt19937 rng(2);
  prefill<> p(20, rng);  // 3 blocks per layer
  auto cache = remote_cache<remote_bundle>(32, 16);
  std::vector<slot_id> slots{0, 1, 2, 3, 4, 5};
  const auto summaries = p.ship(cache.capacity_tier().first(), slots);
  expect_error([&] { cache.adopt(20, std::span(slots).first(5), summaries); },
               errc::invalid_argument, "5 slots for 20 tokens; expected 2 layers x 3 blocks = 6");
  expect_error([&] { cache.adopt(20, slots, std::span(summaries).first(summaries.size() - 1)); },
               errc::invalid_argument, "summary bytes for 6 blocks");
  auto twice = slots;
  twice[4] = 2;
  expect_error([&] { cache.adopt(20, twice, summaries); }, errc::invalid_argument,
               "adopt(slot 2): slot is already in use");
  auto outside = slots;
  outside[5] = 48;
  expect_error([&] { cache.adopt(20, outside, summaries); }, errc::invalid_slot, "adopt(slot 48)");
  expect_error([&] { cache.adopt(std::uint32_t{3} << 20, {}, {}); }, errc::out_of_range,
               "max_tokens_per_sequence");
  CHECK(cache.num_sequences() == 0);
  const sequence_id s = cache.adopt(20, slots, summaries);  // the failed calls held nothing
  expect_error([&] { cache.adopt(20, slots, summaries); }, errc::invalid_argument,
               "adopt(slot 0): slot is already in use (1 holder)");
  // A local slot already allocated by an append cannot be adopted either.
  const auto k = random_rows(1, rng);
  cache.append(s, 0, k.data(), k.data(), 1);
  const slot_id local = cache.block_slots(s, 0).back();
  CHECK(local >= 32);
  std::vector<slot_id> clash{10, 11, 12, 13, 14, local};
  expect_error([&] { cache.adopt(20, clash, summaries); }, errc::invalid_argument,
               "adopt(slot " + std::to_string(local) + ")");
  CHECK(cache.num_sequences() == 1);
}
