// SPDX-License-Identifier: Apache-2.0
// One decode-attention step assembled from OasisKV policies, printed as it goes:
//   a capacity tier holds a sequence's whole KV; the step scores the blocks against the query,
//   stages the best ones (within a budget, sinks and the recent window always kept) into a small
//   fast tier through the copy engine, and attends over the staged blocks only. It then compares
//   the result with dense attention over the whole sequence.
//
// usage: assemble_step [context_tokens=4096] [budget_tokens=512]
#include <oasiskv/oasiskv.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace {

struct policies {
  using allocator = oasiskv::free_list_allocator;
  using fast_tier = oasiskv::host_tier;
  using slow_tier = oasiskv::host_tier;
  using transfer = oasiskv::cpu_copy_engine;
  using kernel = oasiskv::reference_decode;
};
static_assert(oasiskv::check_policy_bundle<policies>);

using elem = oasiskv::f16;

std::uint32_t parse(const char* s, const char* name) {
  char* end = nullptr;
  const unsigned long v = std::strtoul(s, &end, 10);
  if (end == s || *end != '\0' || v == 0 || v > (1ul << 24)) {
    std::fprintf(stderr, "assemble_step: %s = '%s' must be an integer in [1, 16777216]\n", name, s);
    std::exit(2);
  }
  return static_cast<std::uint32_t>(v);
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc > 1 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    std::printf(
        "usage: assemble_step [context_tokens=4096] [budget_tokens=512]\n"
        "One decode-attention step assembled from OasisKV's policies, compared with dense.\n");
    return 0;
  }
  if (argc > 3) {
    std::fprintf(stderr, "assemble_step: unexpected argument '%s' (see --help)\n", argv[3]);
    return 2;
  }
  const std::uint32_t context = argc > 1 ? parse(argv[1], "context_tokens") : 4096;
  const std::uint32_t budget_tokens = argc > 2 ? parse(argv[2], "budget_tokens") : 512;
  // SmolLM2-135M's attention shape: 9 q heads sharing 3 KV heads, head_dim 64, f16 KV.
  const oasiskv::kv_layout layout{1, 9, 3, 64, 16, oasiskv::dtype::f16};
  layout.validate();
  const std::uint32_t blocks = layout.blocks_for(context);
  const std::uint32_t budget = std::min(blocks, layout.blocks_for(budget_tokens));
  const std::uint32_t sinks = 1, recent = 2;
  if (budget < sinks + recent) {
    std::fprintf(stderr, "assemble_step: budget of %u tokens is below sinks + recent window\n",
                 budget_tokens);
    return 2;
  }
  std::printf("layout: %u q heads / %u kv heads, head_dim %u, %u-token blocks, f16 (%zu B/block)\n",
              layout.num_q_heads, layout.num_kv_heads, layout.head_dim, layout.tokens_per_block,
              layout.block_bytes());

  // 1. The capacity tier holds every block. Keys are noise except a few "relevant" tokens that
  //    align with the query, the structure that makes real attention sparse.
  policies::slow_tier slow(layout, blocks);
  std::mt19937 rng(42);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  // The q heads of a GQA group look in similar directions (a shared one plus their own noise).
  std::vector<float> direction(layout.num_kv_heads * layout.head_dim);
  for (float& x : direction) {
    x = noise(rng);
  }
  std::vector<float> q(layout.num_q_heads * layout.head_dim);
  for (std::uint32_t h = 0; h < layout.num_q_heads; ++h) {
    for (std::uint32_t x = 0; x < layout.head_dim; ++x) {
      q[h * layout.head_dim + x] =
          direction[h / layout.group_size() * layout.head_dim + x] + 0.3f * noise(rng);
    }
  }
  for (oasiskv::slot_id b = 0; b < blocks; ++b) {
    auto* p = reinterpret_cast<elem*>(slow.slot_data(b));
    for (std::size_t i = 0; i < layout.block_bytes() / sizeof(elem); ++i) {
      p[i] = elem::from_float(0.5f * noise(rng));
    }
  }
  std::uniform_int_distribution<std::uint32_t> pick_token(0, context - 1);
  for (int i = 0; i < 24; ++i) {
    const std::uint32_t t = pick_token(rng);
    for (std::uint32_t h = 0; h < layout.num_kv_heads; ++h) {
      auto* k = reinterpret_cast<elem*>(slow.slot_data(t / 16) + layout.key_offset(h)) +
                (t % 16) * layout.head_dim;
      for (std::uint32_t x = 0; x < layout.head_dim; ++x) {
        k[x] = elem::from_float(1.2f * direction[h * layout.head_dim + x]);
      }
    }
  }
  std::printf("capacity tier: %u blocks (%u tokens), %.1f MiB\n", blocks, context,
              static_cast<double>(slow.bytes()) / (1 << 20));

  // 2. Score every block by its best key against the query's GQA group (exact keys: the block
  //    summaries of the pipeline approximate this), keep sinks + recent, take the top rest.
  std::vector<float> score(blocks, 0.0f);
  for (std::uint32_t b = 0; b < blocks; ++b) {
    const std::uint32_t fill = std::min<std::uint32_t>(16, context - b * 16);
    float best = -INFINITY;
    for (std::uint32_t h = 0; h < layout.num_q_heads; ++h) {
      const elem* k = slow.view().keys<elem>(b, h / layout.group_size());
      for (std::uint32_t t = 0; t < fill; ++t) {
        float dot = 0.0f;
        for (std::uint32_t x = 0; x < layout.head_dim; ++x) {
          dot += q[h * layout.head_dim + x] * k[t * layout.head_dim + x].to_float();
        }
        best = std::max(best, dot);
      }
    }
    score[b] = best;
  }
  std::vector<std::uint32_t> order(blocks);
  std::iota(order.begin(), order.end(), 0u);
  std::vector<std::uint32_t> chosen;
  for (std::uint32_t b = 0; b < blocks; ++b) {
    if (b < sinks || b + recent >= blocks) {
      chosen.push_back(b);
      score[b] = INFINITY;
    }
  }
  std::nth_element(order.begin(), order.begin() + (budget - 1), order.end(),
                   [&](auto a, auto b) { return score[a] > score[b]; });
  for (std::uint32_t i = 0; i < budget; ++i) {
    if (!std::isinf(score[order[i]])) {
      chosen.push_back(order[i]);
    }
  }
  std::printf("selected %zu of %u blocks (budget %u tokens): %u sink, %u recent, %zu by score\n",
              chosen.size(), blocks, budget * 16, sinks, recent, chosen.size() - sinks - recent);

  // 3. Stage the selection into the fast tier through the copy engine.
  policies::fast_tier fast(layout, budget);
  policies::allocator slots(fast.num_slots());
  std::vector<oasiskv::block_copy> copies;
  std::vector<oasiskv::block_ref> staged, dense;
  for (std::uint32_t b : chosen) {
    const oasiskv::slot_id s = slots.allocate().value();
    copies.push_back({b, s});
    staged.push_back({s, b});
  }
  for (std::uint32_t b = 0; b < blocks; ++b) {
    dense.push_back({b, b});
  }
  policies::transfer engine;
  engine.wait(engine.submit(slow, fast, copies));
  std::printf("staged %zu blocks, %.2f MiB (dense would hold %.2f MiB: %.1fx less)\n",
              copies.size(), static_cast<double>(engine.stats().bytes) / (1 << 20),
              static_cast<double>(slow.bytes()) / (1 << 20),
              static_cast<double>(slow.bytes()) / static_cast<double>(engine.stats().bytes));

  // 4. Sparse attention over the staged blocks, dense attention over everything, and compare.
  std::vector<float> out_sparse(q.size()), out_dense(q.size());
  std::vector<float> lse_sparse(layout.num_q_heads), lse_dense(layout.num_q_heads);
  const std::uint32_t sparse_offsets[2] = {0, static_cast<std::uint32_t>(staged.size())};
  const std::uint32_t dense_offsets[2] = {0, blocks};
  const float scale = 1.0f / std::sqrt(static_cast<float>(layout.head_dim));
  policies::kernel kernel;
  kernel.decode({q.data(),
                 fast.view(),
                 {staged.data(), sparse_offsets, 1, 1},
                 &context,
                 out_sparse.data(),
                 lse_sparse.data(),
                 1,
                 1,
                 scale});
  kernel.decode({q.data(),
                 slow.view(),
                 {dense.data(), dense_offsets, 1, 1},
                 &context,
                 out_dense.data(),
                 lse_dense.data(),
                 1,
                 1,
                 scale});
  double err = 0.0, ref = 0.0, mass = 0.0;
  for (std::size_t i = 0; i < q.size(); ++i) {
    err += (out_sparse[i] - out_dense[i]) * (out_sparse[i] - out_dense[i]);
    ref += out_dense[i] * out_dense[i];
  }
  for (std::uint32_t h = 0; h < layout.num_q_heads; ++h) {
    mass += std::exp(static_cast<double>(lse_sparse[h]) - lse_dense[h]) / layout.num_q_heads;
  }
  std::printf("sparse vs dense attention: relative L2 error %.4f, attention mass covered %.4f\n",
              std::sqrt(err / ref), mass);
  return 0;
} catch (const oasiskv::error& e) {
  std::fprintf(stderr, "assemble_step: %s\n", e.what());
  return 1;
}
