// Block prediction against the floor of dense attention.
//
// Dense decode attention reads every K and V byte of the (sequence, layer) once, so its floor is
// the time to read those bytes. Each predictor row times one select() (scoring every block's
// summary against the lookahead queries + aggregation + top-k) per (sequence, layer) and
// reports frac_of_dense_floor: that time divided by the time of one read of the dense K+V
// bytes, measured in this process, single-threaded like the predictor (median of 15 reads over
// a pool of exactly the sequence's blocks). Target: <= 0.08. It also reports the summary's
// bytes against the KV bytes it describes. Rows:
//   dense_read/<shape>                           the read probe itself
//   lookahead_minmax/<shape>/tokens:N            lookahead_predictor<minmax_summary<f16>>, max
//   lookahead_minmax_softmax/<shape>/tokens:N    ... with softmax_mass_aggregation
//   lookahead_mean/<shape>/tokens:N              lookahead_predictor<mean_summary>
// Shapes: llama32k (32 q / 8 kv heads, head dim 128) and smollm2 (9 q / 3 kv, head dim 64), both
// 32768 tokens of context in 16-token f16 blocks; budget 2048 tokens (128 blocks), 1 sink block,
// 8 recent blocks.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "oasiskv/predictor/lookahead_predictor.hpp"
#include "oasiskv/summary/mean_summary.hpp"
#include "oasiskv/summary/minmax_summary.hpp"
#include "oasiskv/tier/host_tier.hpp"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace {

using namespace oasiskv;

constexpr std::uint32_t context = 32768;
constexpr std::uint32_t tokens_per_block = 16;
constexpr std::uint32_t num_blocks = context / tokens_per_block;
constexpr selection_params params{2048 / tokens_per_block, 1, 8};

struct shape {
  const char* name;
  std::uint32_t q_heads, kv_heads, head_dim;
};
constexpr shape shapes[] = {{"llama32k", 32, 8, 128}, {"smollm2", 9, 3, 64}};

#if defined(__x86_64__) && defined(__GNUC__)
// Sums the buffer as 64-bit words with four independent AVX2 accumulators: as fast a read as
// one core makes (every x86 server this targets has AVX2).
__attribute__((target("avx2"))) std::uint64_t read_all(const std::byte* p, std::size_t bytes) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (std::size_t i = 0; i + 128 <= bytes; i += 128) {
    const auto* v = reinterpret_cast<const __m256i*>(p + i);
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(v));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(v + 1));
    a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(v + 2));
    a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(v + 3));
  }
  const __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
  alignas(32) std::uint64_t w[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(w), s);
  return w[0] + w[1] + w[2] + w[3];
}
#else
std::uint64_t read_all(const std::byte* p, std::size_t bytes) {
  std::uint64_t s = 0;
  for (std::size_t i = 0; i < bytes; ++i) {
    s += static_cast<std::uint64_t>(p[i]);
  }
  return s;
}
#endif

// One sequence of `context` tokens: its KV blocks, both summaries of them, and queries.
struct fixture {
  kv_layout layout;
  host_tier pool;
  minmax_summary<> minmax;
  mean_summary mean;
  std::vector<std::uint32_t> ids;
  std::vector<float> q;  // [8][num_q_heads][head_dim]
  double dense_read_s = 0.0;

  explicit fixture(const shape& s)
      : layout{1, s.q_heads, s.kv_heads, s.head_dim, tokens_per_block, dtype::f16},
        pool(layout, num_blocks, {.prefault = true}),
        minmax(layout, num_blocks),
        mean(layout, num_blocks),
        ids(num_blocks) {
    std::mt19937 rng(42);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    const std::size_t elems = layout.block_bytes() / 2;
    for (slot_id b = 0; b < num_blocks; ++b) {
      auto* p = reinterpret_cast<f16*>(pool.slot_data(b));
      for (std::size_t i = 0; i < elems; ++i) {
        p[i] = f16::from_float(dist(rng));
      }
      minmax.update(b, pool.slot_data(b), 0, tokens_per_block);
      mean.update(b, pool.slot_data(b), 0, tokens_per_block);
    }
    std::iota(ids.begin(), ids.end(), 0u);
    q.resize(std::size_t{8} * layout.num_q_heads * layout.head_dim);
    for (float& x : q) {
      x = dist(rng);
    }
    std::vector<double> times;
    std::uint64_t sink = 0;
    for (int i = 0; i < 15; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      sink += read_all(pool.slot_data(0), kv_bytes());
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    benchmark::DoNotOptimize(sink);
    std::nth_element(times.begin(), times.begin() + 7, times.end());
    dense_read_s = times[7];
  }
  std::size_t kv_bytes() const { return std::size_t{num_blocks} * layout.block_bytes(); }
};

fixture& get(int shape_index) {
  static std::map<int, std::unique_ptr<fixture>> cache;
  auto& f = cache[shape_index];
  if (!f) {
    f = std::make_unique<fixture>(shapes[shape_index]);
  }
  return *f;
}

void bm_dense_read(benchmark::State& state) {
  fixture& f = get(static_cast<int>(state.range(0)));
  std::uint64_t sink = 0;
  for (auto _ : state) {
    sink += read_all(f.pool.slot_data(0), f.kv_bytes());
  }
  benchmark::DoNotOptimize(sink);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * f.kv_bytes()));
}

template <class Predictor, class Summary>
void run_predictor(benchmark::State& state, Summary fixture::*summary) {
  fixture& f = get(static_cast<int>(state.range(0)));
  const auto tokens = static_cast<std::uint32_t>(state.range(1));
  prediction_input<Summary> in;
  in.layout = f.layout;
  in.seq_len = context;
  in.summaries = &(f.*summary);
  in.summary_ids = f.ids;
  in.queries = {f.q.data(), nullptr, tokens};
  Predictor p;
  selection sel;
  p.select(in, params, sel);  // warm the scratch buffers: steady state
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    p.select(in, params, sel);
    benchmark::DoNotOptimize(sel.blocks.data());
  }
  const double per_call =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
      static_cast<double>(state.iterations());
  state.counters["frac_of_dense_floor"] = per_call / f.dense_read_s;
  state.counters["dense_read_us"] = f.dense_read_s * 1e6;
  state.counters["summary_MiB"] = (f.*summary).bytes_per_block() * double{num_blocks} / (1 << 20);
  state.counters["kv_MiB"] = static_cast<double>(f.kv_bytes()) / (1 << 20);
  state.counters["summary_over_kv"] =
      static_cast<double>((f.*summary).bytes_per_block()) / f.layout.block_bytes();
}

void bm_lookahead_minmax(benchmark::State& state) {
  run_predictor<lookahead_predictor<minmax_summary<>>>(state, &fixture::minmax);
}
void bm_lookahead_minmax_softmax(benchmark::State& state) {
  run_predictor<lookahead_predictor<minmax_summary<>, softmax_mass_aggregation>>(state,
                                                                                 &fixture::minmax);
}
void bm_lookahead_mean(benchmark::State& state) {
  run_predictor<lookahead_predictor<mean_summary>>(state, &fixture::mean);
}

void shape_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"shape", "tokens"});
  for (int s = 0; s < 2; ++s) {
    for (int n : {1, 2, 4}) {
      b->Args({s, n});
    }
  }
}

}  // namespace

BENCHMARK(bm_dense_read)->ArgName("shape")->Arg(0)->Arg(1)->UseRealTime();
BENCHMARK(bm_lookahead_minmax)->Apply(shape_args)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_lookahead_minmax_softmax)
    ->ArgNames({"shape", "tokens"})
    ->Args({0, 4})
    ->Args({1, 4})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_lookahead_mean)
    ->ArgNames({"shape", "tokens"})
    ->Args({0, 4})
    ->Args({1, 4})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_MAIN();
