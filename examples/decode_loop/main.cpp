// SPDX-License-Identifier: Apache-2.0
// The decode loop an engine writes against `tiered_kv_cache`: add_sequence, append (prefill and
// one token per step), lookahead with the drafted token's query, attend, remove. The "model" is
// synthetic: each step's query points at the keys of a few earlier tokens, and the draft is that
// query plus noise. Every step's output is checked against dense attention over the whole
// sequence, computed here in double precision from the example's own copy of K and V.
//
// usage: decode_loop [context_tokens=4096] [budget_tokens=512] [steps=64]
#include <oasiskv/oasiskv.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace {

struct policies {
  using allocator = oasiskv::free_list_allocator;
  using fast_tier = oasiskv::host_tier;
  using slow_tier = oasiskv::host_tier;
  using transfer = oasiskv::cpu_copy_engine;
  using predictor = oasiskv::lookahead_predictor<oasiskv::minmax_summary<>>;
  using scheduler = oasiskv::lookahead_prefetcher<>;
  using kernel = oasiskv::cpu::sparse_decode;
};

std::uint32_t parse(const char* s, const char* name) {
  char* end = nullptr;
  const unsigned long v = std::strtoul(s, &end, 10);
  if (end == s || *end != '\0' || v == 0 || v > (1ul << 20)) {
    std::fprintf(stderr, "decode_loop: %s = '%s' must be an integer in [1, 1048576]\n", name, s);
    std::exit(2);
  }
  return static_cast<std::uint32_t>(v);
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc > 1 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    std::printf("usage: decode_loop [context_tokens=4096] [budget_tokens=512] [steps=64]\n");
    return 0;
  }
  if (argc > 4) {
    std::fprintf(stderr, "decode_loop: unexpected argument '%s' (see --help)\n", argv[4]);
    return 2;
  }
  const std::uint32_t context = argc > 1 ? parse(argv[1], "context_tokens") : 4096;
  const std::uint32_t budget = argc > 2 ? parse(argv[2], "budget_tokens") : 512;
  const std::uint32_t steps = argc > 3 ? parse(argv[3], "steps") : 64;
  // Two layers, 8 q heads sharing 2 KV heads, head_dim 64, f16 KV, 16 tokens per block.
  const oasiskv::kv_layout L{2, 8, 2, 64, 16, oasiskv::dtype::f16};
  const std::uint32_t D = L.head_dim, H = L.num_kv_heads, Q = L.num_q_heads,
                      total = context + steps;
  const std::uint32_t blocks = (total + L.tokens_per_block - 1) / L.tokens_per_block;
  const std::uint32_t budget_blocks = (budget + L.tokens_per_block - 1) / L.tokens_per_block;

  oasiskv::tiered_kv_cache<policies> cache(
      oasiskv::host_tier(L, L.num_layers * blocks),               // capacity: every block
      oasiskv::host_tier(L, L.num_layers * (budget_blocks + 2)),  // fast: the budget, per layer
      {.budget_tokens = budget}, {}, oasiskv::cpu::sparse_decode(1));

  // The engine's own copy of K and V ([layer][token][kv head][d], f16) and its queries.
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // Keys of one block share a direction (neighbouring tokens' keys are alike in real models),
  // which is what a min/max summary bounds tightly.
  std::vector<oasiskv::f16> k(std::size_t{L.num_layers} * total * H * D), v(k.size());
  std::vector<float> topic(std::size_t{H} * D);
  for (std::size_t i = 0; i < k.size(); ++i) {
    const std::size_t token = i / (H * D);
    if (i % (H * D) == 0 && token % L.tokens_per_block == 0) {
      for (float& x : topic)
        x = normal(rng);
    }
    k[i] = oasiskv::f16::from_float(topic[i % (H * D)] + 0.25f * normal(rng));
    v[i] = oasiskv::f16::from_float(normal(rng));
  }
  auto kv_at = [&](std::vector<oasiskv::f16>& x, std::uint32_t l, std::uint32_t t) {
    return x.data() + (std::size_t{l} * total + t) * H * D;
  };
  // A query for position `t`: aimed at the keys of 4 earlier tokens (real attention heads
  // concentrate on a few), which drift: one is replaced every 8 steps on average.
  std::vector<std::vector<std::uint32_t>> focus(L.num_layers);
  auto query = [&](std::uint32_t l, std::uint32_t t, std::vector<float>& q) {
    auto pick = [&] {
      return std::uniform_int_distribution<std::uint32_t>(0, t)(rng);
    };
    if (focus[l].empty()) {
      focus[l] = {pick(), pick(), pick(), pick()};
    } else if (rng() % 8 == 0) {
      focus[l][rng() % 4] = pick();
    }
    q.assign(std::size_t{Q} * D, 0.0f);
    for (const std::uint32_t src : focus[l]) {
      for (std::uint32_t h = 0; h < Q; ++h) {
        const oasiskv::f16* key = kv_at(k, l, src) + std::size_t{h / (Q / H)} * D;
        double norm = 0.0;
        for (std::uint32_t d = 0; d < D; ++d)
          norm += double{key[d].to_float()} * key[d].to_float();
        for (std::uint32_t d = 0; d < D; ++d) {
          q[h * D + d] += static_cast<float>(16.0 * key[d].to_float() / std::sqrt(norm));
        }
      }
    }
  };

  const oasiskv::sequence_id seq = cache.add_sequence();
  for (std::uint32_t l = 0; l < L.num_layers; ++l) {  // prefill: the prompt's K and V
    cache.append(seq, l, kv_at(k, l, 0), kv_at(v, l, 0), context);
  }
  std::vector<std::vector<float>> next_q(L.num_layers);
  std::vector<float> draft, out(std::size_t{Q} * D);
  double worst = 0.0;
  for (std::uint32_t s = 0; s < steps; ++s) {
    const std::uint32_t t = context + s;  // the new token's position
    for (std::uint32_t l = 0; l < L.num_layers; ++l) {
      if (next_q[l].empty()) {
        query(l, t, next_q[l]);
      }
      cache.append(seq, l, kv_at(k, l, t), kv_at(v, l, t), 1);
      cache.attend({&seq, 1}, l, next_q[l].data(), 1, out.data());
      // Dense attention over all t + 1 tokens, in double, one q head at a time.
      for (std::uint32_t h = 0; h < Q; ++h) {
        const std::size_t kh = std::size_t{h / (Q / H)} * D;
        std::vector<double> w(t + 1);
        double top = -INFINITY, sum = 0.0, err = 0.0, ref_norm = 0.0;
        for (std::uint32_t j = 0; j <= t; ++j) {
          double dot = 0.0;
          for (std::uint32_t d = 0; d < D; ++d) {
            dot += double{next_q[l][h * D + d]} * kv_at(k, l, j)[kh + d].to_float();
          }
          w[j] = dot / std::sqrt(static_cast<double>(D));
          top = std::max(top, w[j]);
        }
        for (double& x : w)
          sum += (x = std::exp(x - top));
        for (std::uint32_t d = 0; d < D; ++d) {
          double ref = 0.0;
          for (std::uint32_t j = 0; j <= t; ++j)
            ref += w[j] / sum * kv_at(v, l, j)[kh + d].to_float();
          err += (out[h * D + d] - ref) * (out[h * D + d] - ref);
          ref_norm += ref * ref;
        }
        const double rel = std::sqrt(err / ref_norm);
        worst = rel > worst || std::isnan(rel) ? rel : worst;
      }
      // The draft of the next step's query arrives early: predict and prefetch with it.
      query(l, t + 1, next_q[l]);
      draft = next_q[l];
      for (float& x : draft)
        x += 0.3f * normal(rng);
      cache.lookahead(seq, l, {draft.data(), nullptr, 1});
    }
  }
  cache.remove(seq);
  const oasiskv::cache_stats st = cache.stats();
  std::printf("decode_loop: %u tokens of context, budget %u tokens, %u steps x %u layers\n",
              context, budget, steps, L.num_layers);
  std::printf("  hit rate %.3f (%llu hits, %llu misses), %.1f MiB prefetched\n", st.hit_rate(),
              static_cast<unsigned long long>(st.step.hits),
              static_cast<unsigned long long>(st.step.misses), st.bytes_prefetched / 1048576.0);
  std::printf("  worst relative L2 error against dense attention: %.2e\n", worst);
  if (!(worst < 0.05)) {
    std::fprintf(stderr, "decode_loop: sparse attention strayed from dense (%.3g)\n", worst);
    return 1;
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "decode_loop: %s\n", e.what());
  return 1;
}
