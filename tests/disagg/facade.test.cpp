// SPDX-License-Identifier: Apache-2.0
// tiered_kv_cache over UCX: an exporter in another process, its request adopted into a cache
// whose capacity tier is the exporter's memory plus a local tail (remote_capacity_tier) and whose
// transfer engine routes remote blocks to UCX gets (remote_transfer). Decode steps (append,
// lookahead, attend) must give what a local cache holding the same bytes gives, staged blocks
// must equal the exporter's bytes, appends must land in the local tail.
#include <doctest/doctest.h>

#include "support/expect_error.hpp"

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "disagg/disagg_support.hpp"
#include "oasiskv/allocator/free_list_allocator.hpp"
#include "oasiskv/attention/reference_decode.hpp"
#include "oasiskv/disagg/remote_cache.hpp"
#include "oasiskv/kv_cache.hpp"
#include "oasiskv/predictor/lookahead_predictor.hpp"
#include "oasiskv/summary/minmax_summary.hpp"
#include "support/test_predictors.hpp"

using namespace oasiskv;
using namespace oasiskv::disagg;
using disagg_test::layout;
using oasiskv::testing::expect_error;

namespace {

constexpr std::uint32_t prompt = 1000;  // 62 full blocks and a partial one per layer
constexpr std::uint32_t blocks = (prompt + 15) / 16;

template <class Slow, class Transfer, class Predictor, class Scheduler>
struct bundle {
  using allocator = free_list_allocator;
  using fast_tier = host_tier;
  using slow_tier = Slow;
  using transfer = Transfer;
  using predictor = Predictor;
  using scheduler = Scheduler;
  using kernel = reference_decode;
};
using selective = lookahead_predictor<minmax_summary<>>;
using dense = oasiskv::testing::select_all_predictor;
using remote_selective =
    bundle<remote_capacity_tier<>, remote_transfer, selective, lookahead_prefetcher<>>;
using local_selective = bundle<host_tier, cpu_copy_engine, selective, lookahead_prefetcher<>>;
using remote_full = bundle<remote_capacity_tier<>, remote_transfer, dense, all_resident>;
using local_full = bundle<host_tier, cpu_copy_engine, dense, all_resident>;

std::uint16_t start(disagg_test::child& c) {
  disagg_test::spawn(
      c, {DISAGG_PROC, "export", "2", std::to_string(prompt), "30000", "60", "1", "kv"});
  const std::string l = c.line();
  REQUIRE_MESSAGE(l.rfind("port ", 0) == 0, "exporter said: ", l);
  return static_cast<std::uint16_t>(std::stoul(l.substr(5)));
}

std::unique_ptr<ucx_remote_tier> connect(ucx_engine& engine, std::uint16_t port) {
  remote_tier_options o;
  o.port = port;
  o.token = disagg_test::token();
  return std::make_unique<ucx_remote_tier>(engine, o);
}

std::vector<std::byte> expected_block(std::uint64_t seq, std::uint32_t l, std::uint32_t b) {
  std::vector<std::byte> v(layout.block_bytes());
  disagg_test::fill_kv_block(v.data(), seq, l, b, v.size());
  return v;
}

// The exporter's request `seq`, appended to a local cache token by token: the reference.
template <class Cache>
sequence_id append_prompt(Cache& c, std::uint64_t seq) {
  const sequence_id s = c.add_sequence();
  const std::size_t row = layout.row_bytes();
  for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
    std::vector<std::byte> k(std::size_t{prompt} * layout.num_kv_heads * row), v(k.size());
    for (std::uint32_t b = 0; b < blocks; ++b) {
      const auto blk = expected_block(seq, l, b);
      for (std::uint32_t t = 0; t < 16 && b * 16 + t < prompt; ++t) {
        for (std::uint32_t h = 0; h < layout.num_kv_heads; ++h) {
          const std::size_t at = ((std::size_t{b} * 16 + t) * layout.num_kv_heads + h) * row;
          std::memcpy(k.data() + at, blk.data() + layout.key_offset(h) + t * row, row);
          std::memcpy(v.data() + at, blk.data() + layout.value_offset(h) + t * row, row);
        }
      }
    }
    c.append(s, l, k.data(), v.data(), prompt);
  }
  return s;
}

std::vector<float> random_floats(std::size_t n, std::mt19937& rng, float r) {
  std::uniform_real_distribution<float> u(-r, r);
  std::vector<float> x(n);
  for (float& e : x) {
    e = u(rng);
  }
  return x;
}

// `steps` decode steps on both caches with the same tokens and queries; outputs must agree.
template <class A, class B>
void decode_both(A& a, sequence_id sa, B& b, sequence_id sb, int steps, std::mt19937& rng) {
  const std::size_t qn = std::size_t{layout.num_q_heads} * layout.head_dim;
  for (int step = 0; step < steps; ++step) {
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      std::vector<f16> k(std::size_t{layout.num_kv_heads} * layout.head_dim), v(k.size());
      for (std::size_t i = 0; i < k.size(); ++i) {
        k[i] = f16::from_float(random_floats(1, rng, 1.0f)[0]);
        v[i] = f16::from_float(random_floats(1, rng, 1.0f)[0]);
      }
      a.append(sa, l, k.data(), v.data(), 1);
      b.append(sb, l, k.data(), v.data(), 1);
      const auto draft = random_floats(2 * qn, rng, 2.0f);
      a.lookahead(sa, l, {draft.data(), nullptr, 2});
      b.lookahead(sb, l, {draft.data(), nullptr, 2});
      const auto q = random_floats(qn, rng, 2.0f);
      std::vector<float> oa(qn), ob(qn);
      const sequence_id one_a[1] = {sa}, one_b[1] = {sb};
      a.attend(one_a, l, q.data(), 1, oa.data());
      b.attend(one_b, l, q.data(), 1, ob.data());
      for (std::size_t i = 0; i < qn; ++i) {
        REQUIRE(oa[i] == doctest::Approx(ob[i]).epsilon(1e-6));
      }
    }
  }
}

// Every staged (landed) block of the adopted prompt compared with the exporter's bytes.
template <class Cache>
std::size_t check_staged(Cache& c, sequence_id s, std::uint64_t seq, std::size_t& bad) {
  std::size_t compared = 0;
  for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
    const auto slots = c.block_slots(s, l);
    for (std::uint32_t b = 0; b < prompt / 16; ++b) {
      const auto f = c.scheduler().resident_slot(slots[b]);
      if (!f || !c.scheduler().is_ready(slots[b])) {
        continue;
      }
      bad += std::memcmp(c.fast_tier().slot_data(*f), expected_block(seq, l, b).data(),
                         layout.block_bytes()) != 0;
      ++compared;
    }
  }
  return compared;
}

}  // namespace

TEST_CASE("tiered_kv_cache over UCX: selective admission, decode, byte-exact staging, errors") {
  disagg_test::child ex;
  const std::uint16_t port = start(ex);
  ucx_engine engine({std::chrono::milliseconds(10000), 128});
  const cache_options opt{.budget_tokens = 256, .sink_blocks = 1, .recent_blocks = 2};
  tiered_kv_cache<remote_selective> cache(
      remote_capacity_tier<>(connect(engine, port), std::make_unique<host_tier>(layout, 64)),
      host_tier(layout, 64), opt);
  const std::uint32_t n = cache.capacity_tier().first_slots();
  CHECK(cache.read_only_slots() == n);
  tiered_kv_cache<local_selective> local(host_tier(layout, 256), host_tier(layout, 64), opt);
  const sequence_id ls = append_prompt(local, 1);
  std::mt19937 rng(77);
  {
    adopted_request<tiered_kv_cache<remote_selective>> req(cache, 1);
    const sequence_id s = req.sequence();
    // Admission: the summaries, the sink block and the recent window's full block (61) per
    // layer; the partial block 62 waits for the first append.
    CHECK(req.prompt_tokens() == prompt);
    CHECK(req.admitted_bytes() == std::uint64_t{layout.num_layers} *
                                      (blocks * summary_bytes(layout) + 2 * layout.block_bytes()));
    CHECK(cache.stats().resident_blocks == 2 * layout.num_layers);
    CHECK(cache.length(s, 1) == prompt);

    decode_both(cache, s, local, ls, 8, rng);

    const auto st = cache.stats();
    CHECK(st.unpredicted == 0);
    CHECK(engine.stats().gets > 0);
    CHECK(engine.stats().failed_batches == 0);
    std::size_t bad = 0;
    CHECK(check_staged(cache, s, 1, bad) > 0);
    CHECK(bad == 0);
    CHECK(cache.audit() > 0);  // staged copies equal the capacity tier's, read back over UCX
    // Appends went to the local tail: the partial prompt block was copied there, then grew.
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      const auto slots = cache.block_slots(s, l);
      REQUIRE(slots.size() == blocks);  // 1000 + 8 tokens: still 63 blocks
      for (std::uint32_t b = 0; b < prompt / 16; ++b) {
        CHECK(slots[b] < n);
      }
      CHECK(slots.back() >= n);
    }

    // Errors: a slot another sequence holds, a summary of the wrong size. Nothing changes.
    ucx_remote_tier& tier = cache.capacity_tier().first();
    const opened_msg o2 = tier.open(2, true);
    std::vector<slot_id> slots2;
    for (const block_entry& b : o2.blocks) {
      slots2.push_back(b.slot);
    }
    auto clash = slots2;
    const slot_id held = cache.block_slots(s, 0)[5];
    clash[7] = held;
    expect_error([&] { cache.adopt(o2.tokens, clash, o2.summaries); }, errc::invalid_argument,
                 "adopt(slot " + std::to_string(held) + "): slot is already in use");
    const std::span<const std::byte> sums(o2.summaries);
    expect_error([&] { cache.adopt(o2.tokens, slots2, sums.first(sums.size() - 2)); },
                 errc::invalid_argument, "summary bytes for 126 blocks");
    CHECK(cache.num_sequences() == 1);
    const sequence_id s2 = cache.adopt(o2.tokens, slots2, o2.summaries);
    CHECK(cache.length(s2, 0) == prompt);
    cache.remove(s2);
    tier.release(2);
  }
  CHECK(cache.num_sequences() == 0);  // the request was removed, and its lease released
}

TEST_CASE("tiered_kv_cache over UCX: full admission stages the whole prompt at adoption") {
  disagg_test::child ex;
  const std::uint16_t port = start(ex);
  ucx_engine engine({std::chrono::milliseconds(10000), 128});
  const cache_options opt{.budget_tokens = 2048, .sink_blocks = 1, .recent_blocks = 1};
  tiered_kv_cache<remote_full> cache(
      remote_capacity_tier<>(connect(engine, port), std::make_unique<host_tier>(layout, 16)),
      host_tier(layout, 160), opt);
  tiered_kv_cache<local_full> local(host_tier(layout, 256), host_tier(layout, 160), opt);
  const sequence_id ls = append_prompt(local, 2);
  adopted_request<tiered_kv_cache<remote_full>> req(cache, 2);
  const sequence_id s = req.sequence();
  // This bundle keeps no summaries: admission is the full blocks.
  CHECK(req.admitted_bytes() ==
        std::uint64_t{layout.num_layers} * (prompt / 16) * layout.block_bytes());
  CHECK(cache.stats().resident_blocks == layout.num_layers * (prompt / 16));
  std::mt19937 rng(3);
  decode_both(cache, s, local, ls, 3, rng);
  // The full blocks came at admission, in one batch; the partial ones were copied on append.
  CHECK(engine.stats().gets >= layout.num_layers * (prompt / 16));
  CHECK(cache.stats().step.misses <= layout.num_layers);
  std::size_t bad = 0;
  CHECK(check_staged(cache, s, 2, bad) == layout.num_layers * (prompt / 16));
  CHECK(bad == 0);
}
