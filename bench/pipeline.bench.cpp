// The OasisKV decode loop end to end: sequences of 32k tokens whose capacity tier is a file read
// with O_DIRECT, a fast tier holding a budget of blocks, and per layer append -> attend ->
// lookahead, as an engine's speculative decoder drives it. One row per scheduler:
//   lookahead     the next step's blocks predicted from its (drafted) query and prefetched
//   on_demand     the same selection, fetched when attention asks for it
//   all_resident  every block staged in the fast tier (the upper bound: no transfer at all)
// plus dense attention over the whole context in the same binary, for the predictor's share.
// Queries drift from step to step and keys cluster by block, so selections change gradually,
// as real attention does; `fetched_per_step` reports how much each step had to move.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "oasiskv/oasiskv.hpp"

namespace {

using namespace oasiskv;

constexpr std::uint32_t context = 32768;
constexpr std::uint32_t budget_tokens = 2048;
const kv_layout layout{4, 9, 3, 64, 16, dtype::f16};  // SmolLM2's attention, 4 layers

template <class Scheduler>
struct bundle {
  using allocator = free_list_allocator;
  using fast_tier = host_tier;
  using slow_tier = file_tier;
  using transfer = cpu_copy_engine;
  using predictor = lookahead_predictor<minmax_summary<>>;
  using scheduler = Scheduler;
  using kernel = cpu::sparse_decode;
};

// Keys of block b are a block centre plus noise: blocks differ in relevance the way real
// attention's do, so a slowly drifting query changes the selection gradually.
struct kv_source {
  std::uint64_t state = 0x9e3779b97f4a7c15ull;
  std::vector<float> centres;  // [blocks][kv_heads][head_dim]

  // Uniform in [-1.7, 1.7) (unit variance) from xorshift64*: the prefill draws hundreds of
  // millions of values, and std::normal_distribution would make setup dominate the run.
  float noise() {
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    const auto bits = static_cast<std::uint32_t>((state * 0x2545f4914f6cdd1dull) >> 40);
    return (static_cast<float>(bits) / 16777216.0f - 0.5f) * 3.4641f;
  }

  kv_source() {
    centres.resize(std::size_t{layout.blocks_for(context + 4096)} * layout.num_kv_heads *
                   layout.head_dim);
    for (float& c : centres) {
      c = 1.5f * noise();
    }
  }
  // Rows for tokens [first, first + n): [n][kv_heads][head_dim] f16.
  void rows(std::uint32_t first, std::uint32_t n, std::vector<f16>& k, std::vector<f16>& v) {
    const std::size_t width = std::size_t{layout.num_kv_heads} * layout.head_dim;
    k.resize(n * width);
    v.resize(n * width);
    for (std::uint32_t t = 0; t < n; ++t) {
      const float* c = centres.data() + ((first + t) / layout.tokens_per_block) * width;
      for (std::size_t i = 0; i < width; ++i) {
        k[t * width + i] = f16::from_float(c[i] + 0.5f * noise());
        v[t * width + i] = f16::from_float(noise());
      }
    }
  }
};

struct query_walk {
  std::mt19937 rng{11};
  std::normal_distribution<float> noise{0.0f, 1.0f};
  std::vector<float> q = std::vector<float>(layout.num_q_heads * layout.head_dim);
  explicit query_walk() {
    for (float& x : q) {
      x = noise(rng);
    }
  }
  // A small random step: the next token's query is close to this one's.
  void step(float drift) {
    for (float& x : q) {
      x = (x + drift * noise(rng)) / std::sqrt(1.0f + drift * drift);
    }
  }
};

template <class Scheduler>
std::unique_ptr<tiered_kv_cache<bundle<Scheduler>>> make_cache(std::uint32_t fast_slots,
                                                               kv_source& src, sequence_id& seq) {
  const std::uint32_t capacity = layout.num_layers * layout.blocks_for(context + 4096);
  auto cache = std::make_unique<tiered_kv_cache<bundle<Scheduler>>>(
      file_tier(layout, capacity, {.path = "/tmp"}),
      host_tier(layout, fast_slots, {.prefault = true}),
      cache_options{.budget_tokens = budget_tokens, .sink_blocks = 1, .recent_blocks = 2});
  seq = cache->add_sequence();
  std::vector<f16> k, v;
  for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
    for (std::uint32_t t = 0; t < context; t += 4096) {
      src.rows(t, 4096, k, v);
      cache->append(seq, l, k.data(), v.data(), 4096);
    }
  }
  return cache;
}

template <class Scheduler>
void bm_decode_step(benchmark::State& state, std::uint32_t fast_slots) {
  kv_source src;
  sequence_id seq{};
  auto cache = make_cache<Scheduler>(fast_slots, src, seq);
  query_walk walk;
  const float drift = static_cast<float>(state.range(0)) / 100.0f;
  std::vector<float> out(walk.q.size());
  std::vector<f16> k, v;
  const sequence_id seqs[1] = {seq};
  // Warm up: one step predicts, later steps find their blocks staged.
  for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
    cache->lookahead(seq, l, {walk.q.data(), nullptr, 1});
  }
  double lookahead_seconds = 0.0;
  std::uint64_t steps = 0;
  const cache_stats before = cache->stats();
  for (auto _ : state) {
    const std::uint32_t pos = cache->length(seq);
    src.rows(pos, 1, k, v);
    const std::vector<float> q_now = walk.q;
    walk.step(drift);  // the next token's query: what the drafts predict it to be
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      cache->append(seq, l, k.data(), v.data(), 1);
      cache->attend(seqs, l, q_now.data(), 1, out.data());
      const auto t0 = std::chrono::steady_clock::now();
      cache->lookahead(seq, l, {walk.q.data(), nullptr, 1});
      lookahead_seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    benchmark::DoNotOptimize(out.data());
    ++steps;
  }
  const cache_stats after = cache->stats();
  const double n = static_cast<double>(steps);
  const std::uint64_t fetched = (after.bytes_prefetched - before.bytes_prefetched) +
                                (after.step.bytes_fetched - before.step.bytes_fetched);
  state.counters["hit_rate"] =
      static_cast<double>(after.step.hits - before.step.hits) /
      std::max(1.0, static_cast<double>(after.step.hits - before.step.hits + after.step.misses -
                                        before.step.misses));
  state.counters["fetched_per_step_KiB"] = static_cast<double>(fetched) / n / 1024.0;
  state.counters["stall_ms_per_step"] =
      (after.step.stall_seconds - before.step.stall_seconds) / n * 1e3;
  state.counters["lookahead_ms_per_step"] = lookahead_seconds / n * 1e3;
  state.counters["fast_MiB"] = static_cast<double>(fast_slots) * layout.block_bytes() / (1 << 20);
}

void bm_lookahead(benchmark::State& s) {
  bm_decode_step<lookahead_prefetcher<lru_eviction>>(
      s, layout.num_layers * 3 * layout.blocks_for(budget_tokens));
}
void bm_on_demand(benchmark::State& s) {
  bm_decode_step<on_demand_fetcher<lru_eviction>>(
      s, layout.num_layers * 3 * layout.blocks_for(budget_tokens));
}
void bm_all_resident(benchmark::State& s) {
  bm_decode_step<all_resident>(s, layout.num_layers * layout.blocks_for(context + 4096));
}

// Dense attention of one step over every block of every layer, read from host memory: the
// denominator of the predictor's share.
void bm_dense_attention(benchmark::State& state) {
  const std::uint32_t blocks = layout.blocks_for(context);
  host_tier pool(layout, blocks, {.prefault = true});
  std::vector<block_ref> refs;
  for (std::uint32_t b = 0; b < blocks; ++b) {
    refs.push_back({b, b});
  }
  query_walk walk;
  std::vector<float> out(walk.q.size()), lse(layout.num_q_heads);
  const std::uint32_t offsets[2] = {0, blocks};
  const std::uint32_t len = context;
  cpu::sparse_decode kernel;
  const decode_params p{
      walk.q.data(), pool.view(), {refs.data(), offsets, 1, 1}, &len, out.data(), lse.data(), 1, 1,
      0.125f};
  for (auto _ : state) {
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      kernel.decode(p);  // the same pool for every layer: the bytes read are what counts
    }
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * layout.num_layers *
                                                    std::size_t{blocks} * layout.block_bytes()));
}

}  // namespace

// Arg: query drift per step, in percent of the query's norm.
BENCHMARK(bm_lookahead)->Arg(5)->Arg(20)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(bm_on_demand)->Arg(5)->Arg(20)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(bm_all_resident)->Arg(5)->Arg(20)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(bm_dense_attention)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_MAIN();
