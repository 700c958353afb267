// SPDX-License-Identifier: Apache-2.0
// The facade assembled from CUDA policies: blocks staged from pinned host memory into device
// memory by cuda::copy_engine, attention by cuda::sparse_decode over tables the cache builds on
// the host. With a budget covering the context it must equal dense attention; with a small one
// the bookkeeping must hold and every output stay finite.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <vector>

#include "cuda/cuda_support.cuh"
#include "oasiskv/allocator/free_list_allocator.hpp"
#include "oasiskv/attention/reference_decode.hpp"
#include "oasiskv/cuda/cuda.cuh"
// The predictor's host scoring loops carry `#pragma GCC unroll`, unknown to nvcc's front end.
#pragma nv_diag_suppress 1675
#include "oasiskv/kv_cache.hpp"
#include "oasiskv/predictor/lookahead_predictor.hpp"
#include "oasiskv/summary/minmax_summary.hpp"
#pragma nv_diag_default 1675

namespace {

using namespace oasiskv;
using oasiskv::testing::device_buffer;

struct gpu_policies {
  using allocator = free_list_allocator;
  using fast_tier = oasiskv::cuda::device_tier;
  using slow_tier = oasiskv::cuda::pinned_host_tier;
  using transfer = oasiskv::cuda::copy_engine;
  using predictor = lookahead_predictor<minmax_summary<>>;
  using scheduler = lookahead_prefetcher<lru_eviction>;
  using kernel = oasiskv::cuda::sparse_decode;
};
static_assert(check_policy_bundle<gpu_policies>);
static_assert(tiered_kv_cache<gpu_policies>::host_table_kernel);

const kv_layout layout{2, 8, 2, 64, 16, dtype::bf16};

std::vector<bf16> random_rows(std::uint32_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<bf16> rows(std::size_t{n} * layout.num_kv_heads * layout.head_dim);
  for (bf16& x : rows) {
    x = bf16::from_float(u(rng));
  }
  return rows;
}

void run(std::uint32_t budget_tokens, bool expect_dense) {
  std::mt19937 rng(9);
  tiered_kv_cache<gpu_policies> cache(oasiskv::cuda::pinned_host_tier(layout, 256),
                                      oasiskv::cuda::device_tier(layout, 96),
                                      {.budget_tokens = budget_tokens, .scale = 0.125f});
  const sequence_id s = cache.add_sequence();
  for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
    auto k = random_rows(300, rng), v = random_rows(300, rng);
    cache.append(s, l, k.data(), v.data(), 300);
  }
  const std::size_t row = std::size_t{layout.num_q_heads} * layout.head_dim;
  for (int step = 0; step < 3; ++step) {
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      auto k = random_rows(1, rng), v = random_rows(1, rng);
      cache.append(s, l, k.data(), v.data(), 1);
      const std::vector<float> q = oasiskv::testing::random_floats(row, rng, -2.0f, 2.0f);
      cache.lookahead(s, l, {q.data(), nullptr, 1});
      device_buffer<float> dq(q), dout(row);
      const sequence_id seqs[1] = {s};
      cache.attend(seqs, l, dq.get(), 1, dout.get());
      const std::vector<float> out = dout.download();
      for (float x : out) {
        REQUIRE(std::isfinite(x));
      }
      if (expect_dense) {
        const auto slots = cache.block_slots(s, l);
        std::vector<block_ref> refs;
        for (std::uint32_t b = 0; b < slots.size(); ++b) {
          refs.push_back({slots[b], b});
        }
        const std::uint32_t offsets[2] = {0, static_cast<std::uint32_t>(refs.size())};
        const std::uint32_t len = cache.length(s, l);
        std::vector<float> ref(row), lse(layout.num_q_heads);
        reference_decode{}.decode({q.data(),
                                   cache.capacity_tier().view(),
                                   {refs.data(), offsets, 1, 1},
                                   &len,
                                   ref.data(),
                                   lse.data(),
                                   1,
                                   1,
                                   0.125f});
        for (std::size_t i = 0; i < row; ++i) {
          REQUIRE(out[i] == doctest::Approx(ref[i]).epsilon(2e-3));
        }
      }
    }
  }
  cache.audit();
  CHECK(cache.stats().sequence_steps == 3 * layout.num_layers);
}

}  // namespace

TEST_CASE("tiered_kv_cache on the GPU: a budget covering the context equals dense attention") {
  oasiskv::testing::require_cuda_device_or_skip();
  run(1024, true);
}

TEST_CASE("tiered_kv_cache on the GPU: a small budget stages, evicts and stays consistent") {
  oasiskv::testing::require_cuda_device_or_skip();
  run(64, false);
}
