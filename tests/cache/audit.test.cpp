// SPDX-License-Identifier: Apache-2.0
// cache::audit, as tiered_kv_cache::audit runs it: a staged copy that no longer equals the
// capacity tier's block is found and named; an intact cache passes with every staged block
// compared.
#include <doctest/doctest.h>

#include <cstring>
#include <random>
#include <vector>

#include "oasiskv/oasiskv.hpp"
#include "support/expect_error.hpp"
#include "support/test_predictors.hpp"

using namespace oasiskv;
using oasiskv::testing::expect_error;

namespace {
struct exact_bundle {
  using allocator = free_list_allocator;
  using fast_tier = host_tier;
  using slow_tier = host_tier;
  using transfer = cpu_copy_engine;
  using predictor = oasiskv::testing::exact_max_predictor;
  using scheduler = lookahead_prefetcher<lru_eviction>;
  using kernel = reference_decode;
};
}  // namespace

TEST_CASE("cache::audit: compares every staged block and names one that differs") {
  const kv_layout l{2, 2, 1, 8, 4, dtype::f32};
  tiered_kv_cache<exact_bundle> cache(host_tier(l, 64), host_tier(l, 32), {.budget_tokens = 16});
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const sequence_id s = cache.add_sequence();
  const std::uint32_t n = 40;  // 10 blocks per layer
  std::vector<float> k(std::size_t{n} * l.num_kv_heads * l.head_dim);
  std::vector<float> v(k.size()), q(std::size_t{l.num_q_heads} * l.head_dim);
  for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
    for (float& x : k)
      x = u(rng);
    for (float& x : v)
      x = u(rng);
    cache.append(s, layer, k.data(), v.data(), n);
  }
  std::vector<float> out(q.size());
  for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
    for (float& x : q)
      x = u(rng);
    cache.lookahead(s, layer, {q.data(), nullptr, 1});
    cache.attend(std::span<const sequence_id>(&s, 1), layer, q.data(), 1, out.data());
  }
  cache.drain();
  const std::size_t compared = cache.audit();
  CHECK(compared >= 2 * 4);  // at least one selection of 4 blocks per layer is staged

  // One byte of a staged block changed behind the cache's back: the copies now differ.
  const std::vector<slot_id> slots = cache.block_slots(s, 1);
  slot_id changed = null_slot;
  for (const slot_id x : slots) {
    std::byte* p = cache.capacity_tier().slot_data(x);
    p[3] ^= std::byte{0x40};
    try {
      cache.audit();
      p[3] ^= std::byte{0x40};  // not staged: put it back and try the next block
    } catch (const error&) {
      p[3] ^= std::byte{0x40};
      changed = x;
      break;
    }
  }
  REQUIRE(changed != null_slot);
  std::byte* p = cache.capacity_tier().slot_data(changed);
  p[3] ^= std::byte{0x40};
  expect_error([&] { cache.audit(); }, errc::invalid_argument,
               "staged copy of capacity slot " + std::to_string(changed));
  p[3] ^= std::byte{0x40};
  CHECK(cache.audit() == compared);
}
