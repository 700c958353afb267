// SPDX-License-Identifier: Apache-2.0
// Block prediction against the floor of dense attention.
//
// Dense decode attention reads every K and V byte of the (sequence, layer) once, so its floor is
// the time to read those bytes. Each predictor row times one select() (scoring every block's
// summary against the lookahead queries + aggregation + top-k) per (sequence, layer) and
// reports frac_of_dense_floor: that time divided by the time of one read of the dense K+V
// bytes (a pool of exactly the sequence's blocks), single-threaded like the predictor, the two
// measured in alternating batches in the same row (thread CPU time, median of 7 ratios). Target: <=
// 0.08. It also reports the summary's bytes against the KV bytes it describes, and speedup_vs_f16:
// the time of the same select() with the f16 min/max scoring as it was before the tiled layout
// (`legacy_minmax_f16` below: row-major entries, per-entry dot products with horizontal sums) over
// this row's time, both timed back to back in alternating batches inside the row (thread CPU time,
// median of 7), so that load changes hit both alike. Rows:
//   dense_read/<shape>                           the read probe itself
//   lookahead_minmax/<shape>/tokens:N            lookahead_predictor<minmax_summary<f16>>, max
//   lookahead_minmax_bf16/<shape>/tokens:N       ... minmax_summary<bf16>, exact f32 scoring
//   lookahead_quantized/<shape>/tokens:N         ... quantized_minmax_summary (int8, VNNI)
//   lookahead_legacy_f16/<shape>/tokens:N        ... legacy_minmax_f16 (speedup_vs_f16 == 1)
//   lookahead_minmax_softmax/<shape>/tokens:N    ... f16 with softmax_mass_aggregation
//   lookahead_mean/<shape>/tokens:N              lookahead_predictor<mean_summary>
//   lookahead_int8_keys/<shape>/tokens:N         ... int8_key_summary, max (exact block max)
//   lookahead_int8_keys_mass/<shape>/tokens:N    ... int8_key_summary, softmax mass (exact mass)
//   lookahead_quantized_mass/<shape>/tokens:N    ... quantized_minmax_summary, softmax mass
//   lookahead_int4_keys_mass/<shape>/tokens:N    ... int4_key_summary, softmax mass (exact mass)
//   lookahead_cascade_mass/<shape>/tokens:N/factor:F  ... qminmax_int4_cascade, softmax mass:
//                                                the int8 bounds keep ceil(F x budget) contenders
//                                                per KV head, int4 keys give their exact mass
//   lookahead_int2_mass/<shape>/tokens:N/factor:F     ... qminmax_int2_summary, softmax mass:
//                                                the same bounds and contenders, scored from
//                                                2-bit codes between the bounds
//   lookahead_int2_pool/<shape>/threads:T        ... the same (factor 4, 4 tokens) on a pool of T
//                                                threads: speedup_vs_1thread
// (Every row names its aggregation: max unless said, as measured before softmax mass became
// lookahead_predictor's default.)
// Shapes (the `shape` argument): 0 llama32k (32 q / 8 kv heads, head dim 128) and 1 smollm2 (9 q /
// 3 kv, head dim 64), both 32768 tokens of context, budget 2048 tokens (128 blocks); 2 llama8k
// and 3 smollm2_8k, the same heads at 8192 tokens, budget 1024 (64 blocks); 16-token f16 blocks,
// 1 sink block, 8 recent blocks. The 8k shapes run the softmax-mass rows at 4 tokens.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <ctime>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "oasiskv/concepts/block_summary.hpp"
#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/cpu/thread_pool.hpp"
#include "oasiskv/predictor/lookahead_predictor.hpp"
#include "oasiskv/summary/cascade_summary.hpp"
#include "oasiskv/summary/mean_summary.hpp"
#include "oasiskv/summary/minmax_summary.hpp"
#include "oasiskv/summary/qminmax_int2_summary.hpp"
#include "oasiskv/summary/quantized_key_summary.hpp"
#include "oasiskv/summary/quantized_minmax_summary.hpp"
#include "oasiskv/tier/host_tier.hpp"

namespace {

using namespace oasiskv;

constexpr std::uint32_t tokens_per_block = 16;

// A model shape at one context length, and the budget a deployment gives it there (the
// mini-decoder's default at 8k is 1,024 tokens).
struct shape {
  const char* name;
  std::uint32_t q_heads, kv_heads, head_dim;
  std::uint32_t context, budget_tokens;
  std::uint32_t blocks() const { return context / tokens_per_block; }
  selection_params params() const { return {budget_tokens / tokens_per_block, 1, 8}; }
};
constexpr shape shapes[] = {{"llama32k", 32, 8, 128, 32768, 2048},
                            {"smollm2", 9, 3, 64, 32768, 2048},
                            {"llama8k", 32, 8, 128, 8192, 1024},
                            {"smollm2_8k", 9, 3, 64, 8192, 1024}};

#if OASISKV_X86_KERNELS
// Sums the buffer as 64-bit words with four independent AVX2 accumulators: as fast a read as
// one core makes (every x86 server this targets has AVX2).
OASISKV_TARGET_AVX2 std::uint64_t read_all(const std::byte* p, std::size_t bytes) {
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

// minmax_summary<f16> as it was before the tiled layout, the baseline of speedup_vs_f16:
// [kv head][entry][max (d) | min (d)] rows scored by cpu::detail::dot_entries (per entry, tiles of
// up to 8 query rows against the row, then horizontal sums). The same bounds, the same f32 math.
class legacy_minmax_f16 {
 public:
  legacy_minmax_f16(const kv_layout& l, std::uint32_t capacity)
      : l_(l),
        capacity_(capacity),
        isa_(resolve_isa(cpu_isa::best)),
        bounds_(std::size_t{l.num_kv_heads} * capacity * 2 * l.head_dim),
        tokens_(capacity) {
    for (std::uint32_t b = 0; b < capacity; ++b) {
      reset(b);
    }
  }
  std::uint32_t capacity() const { return capacity_; }
  std::size_t bytes_per_block() const {
    return std::size_t{l_.num_kv_heads} * 2 * l_.head_dim * sizeof(f16) + 2;
  }
  void reset(std::uint32_t b) {
    const std::uint32_t d = l_.head_dim;
    for (std::uint32_t h = 0; h < l_.num_kv_heads; ++h) {
      for (std::uint32_t x = 0; x < d; ++x) {
        entry(h, b)[x] = f16::from_float(-std::numeric_limits<float>::infinity());
        entry(h, b)[d + x] = f16::from_float(std::numeric_limits<float>::infinity());
      }
    }
    tokens_[b] = 0;
  }
  void update(std::uint32_t b, const std::byte* block, std::uint32_t first, std::uint32_t count) {
    const std::uint32_t d = l_.head_dim;
    for (std::uint32_t h = 0; h < l_.num_kv_heads; ++h) {  // f16 keys only (the fixture's)
      const f16* keys = reinterpret_cast<const f16*>(block + l_.key_offset(h));
      f16* e = entry(h, b);
      for (std::uint32_t t = first; t < first + count; ++t) {
        for (std::uint32_t x = 0; x < d; ++x) {
          const f16 v = keys[std::size_t{t} * d + x];
          e[x] = v.to_float() > e[x].to_float() ? v : e[x];
          e[d + x] = v.to_float() < e[d + x].to_float() ? v : e[d + x];
        }
      }
    }
    tokens_[b] = static_cast<std::uint16_t>(tokens_[b] + count);
  }
  void score(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
             std::uint32_t n, float* out) const {
    const std::uint32_t d = l_.head_dim, stride = 2 * d;
    thread_local std::vector<float> split;
    split.resize(std::size_t{n} * stride);
    for (std::uint32_t r = 0; r < n; ++r) {
      for (std::uint32_t x = 0; x < d; ++x) {
        const float v = q[std::size_t{r} * d + x];
        split[std::size_t{r} * stride + x] = v > 0.0f ? v : 0.0f;
        split[std::size_t{r} * stride + d + x] = v < 0.0f ? v : 0.0f;
      }
    }
    cpu::detail::dot_entries(isa_, bounds_.data() + std::size_t{h} * capacity_ * stride, stride,
                             entries, split.data(), n, stride, out);
    for (std::size_t i = 0; i < entries.size(); ++i) {
      if (tokens_[entries[i]] == 0) {
        std::fill(out + i * n, out + (i + 1) * n, -std::numeric_limits<float>::infinity());
      }
    }
  }

 private:
  f16* entry(std::uint32_t h, std::uint32_t b) {
    return bounds_.data() + (std::size_t{h} * capacity_ + b) * 2 * l_.head_dim;
  }
  kv_layout l_;
  std::uint32_t capacity_;
  cpu_isa isa_;
  std::vector<f16> bounds_;
  std::vector<std::uint16_t> tokens_;
};
static_assert(block_summary<legacy_minmax_f16>);

// One sequence of `context` tokens: its KV blocks, every summary of them, and queries.
struct fixture {
  shape sh;
  std::uint32_t num_blocks;
  selection_params params;
  kv_layout layout;
  host_tier pool;
  minmax_summary<> minmax;
  minmax_summary<bf16> minmax_bf16;
  quantized_minmax_summary quantized;
  legacy_minmax_f16 legacy;
  mean_summary mean;
  int8_key_summary int8_keys;
  int4_key_summary int4_keys;
  std::vector<std::uint32_t> ids;
  std::vector<float> q;                                           // [8][num_q_heads][head_dim]
  std::map<int, std::unique_ptr<qminmax_int4_cascade>> cascades;  // by contender factor
  std::map<int, std::unique_ptr<qminmax_int2_summary>> int2s;     // by contender factor

  explicit fixture(const shape& s)
      : sh(s),
        num_blocks(s.blocks()),
        params(s.params()),
        layout{1, s.q_heads, s.kv_heads, s.head_dim, tokens_per_block, dtype::f16},
        pool(layout, num_blocks, {.prefault = true}),
        minmax(layout, num_blocks),
        minmax_bf16(layout, num_blocks),
        quantized(layout, num_blocks),
        legacy(layout, num_blocks),
        mean(layout, num_blocks),
        int8_keys(layout, num_blocks),
        int4_keys(layout, num_blocks),
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
      minmax_bf16.update(b, pool.slot_data(b), 0, tokens_per_block);
      quantized.update(b, pool.slot_data(b), 0, tokens_per_block);
      legacy.update(b, pool.slot_data(b), 0, tokens_per_block);
      mean.update(b, pool.slot_data(b), 0, tokens_per_block);
      int8_keys.update(b, pool.slot_data(b), 0, tokens_per_block);
      int4_keys.update(b, pool.slot_data(b), 0, tokens_per_block);
    }
    for (const float factor : {2.0f, 4.0f, 8.0f}) {  // copies of the parts built above
      cascades.emplace(static_cast<int>(factor), std::make_unique<qminmax_int4_cascade>(
                                                     quantized, int4_keys, cascade_params{factor}));
      auto int2 =
          std::make_unique<qminmax_int2_summary>(layout, num_blocks, cascade_params{factor});
      for (slot_id b = 0; b < num_blocks; ++b) {
        int2->update(b, pool.slot_data(b), 0, tokens_per_block);
      }
      int2s.emplace(static_cast<int>(factor), std::move(int2));
    }
    std::iota(ids.begin(), ids.end(), 0u);
    q.resize(std::size_t{8} * layout.num_q_heads * layout.head_dim);
    for (float& x : q) {
      x = dist(rng);
    }
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

template <class Summary>
prediction_input<Summary> input_of(fixture& f, Summary& s, std::uint32_t tokens) {
  prediction_input<Summary> in;
  in.layout = f.layout;
  in.seq_len = f.sh.context;
  in.summaries = &s;
  in.summary_ids = f.ids;
  in.queries = {f.q.data(), nullptr, tokens};
  return in;
}

// This thread's CPU seconds: on a shared machine, less disturbed by other processes than the
// wall clock (time slices taken away do not count).
double thread_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// Thread CPU seconds per select() of `p` over `calls` calls.
template <class Predictor, class Summary>
double time_calls(Predictor& p, const prediction_input<Summary>& in, const selection_params& sp,
                  selection& sel, int calls) {
  const double t0 = thread_seconds();
  for (int i = 0; i < calls; ++i) {
    p.select(in, sp, sel);
    benchmark::DoNotOptimize(sel.blocks.data());
  }
  return (thread_seconds() - t0) / calls;
}

// The legacy f16 predictor's time over this row's, in alternating batches: median of 7 ratios.
template <class Predictor, class Summary>
double speedup_vs_f16(fixture& f, Summary& s, std::uint32_t tokens) {
  using legacy_predictor = lookahead_predictor<legacy_minmax_f16, max_aggregation>;
  const auto in = input_of(f, s, tokens);
  const auto legacy_in = input_of(f, f.legacy, tokens);
  Predictor p;
  legacy_predictor lp;
  selection sel;
  const double probe = time_calls(lp, legacy_in, f.params, sel, 1);
  const int calls = std::max(1, static_cast<int>(0.01 / probe));  // ~10 ms batches
  std::vector<double> ratios;
  for (int i = 0; i < 7; ++i) {
    const double mine = time_calls(p, in, f.params, sel, calls);
    ratios.push_back(time_calls(lp, legacy_in, f.params, sel, calls) / mine);
  }
  std::nth_element(ratios.begin(), ratios.begin() + 3, ratios.end());
  return ratios[3];
}

// select()'s time over one read of the dense K+V bytes, both thread CPU time, measured in
// alternating batches after the row's timed loop (a batch of ~10 ms of select() calls, then three
// reads of the pool): median of 7 ratios, and the median read time.
template <class Predictor, class Summary>
std::pair<double, double> frac_of_dense_floor(fixture& f, Predictor& p,
                                              const prediction_input<Summary>& in, selection& sel,
                                              double per_call) {
  const int calls = std::max(1, static_cast<int>(0.01 / per_call));
  std::vector<double> ratios, reads;
  std::uint64_t sink = 0;
  for (int i = 0; i < 7; ++i) {
    const double mine = time_calls(p, in, f.params, sel, calls);
    const double t0 = thread_seconds();
    for (int r = 0; r < 3; ++r) {
      sink += read_all(f.pool.slot_data(0), f.kv_bytes());
    }
    const double read = (thread_seconds() - t0) / 3;
    ratios.push_back(mine / read);
    reads.push_back(read);
  }
  benchmark::DoNotOptimize(sink);
  std::nth_element(ratios.begin(), ratios.begin() + 3, ratios.end());
  std::nth_element(reads.begin(), reads.begin() + 3, reads.end());
  return {ratios[3], reads[3]};
}

// One predictor row over `summary`: the timed loop, then the counters described above.
template <class Predictor, class Summary>
void run_predictor_on(benchmark::State& state, fixture& f, Summary& summary) {
  const auto tokens = static_cast<std::uint32_t>(state.range(1));
  const prediction_input<Summary> in = input_of(f, summary, tokens);
  Predictor p;
  selection sel;
  p.select(in, f.params, sel);  // warm the scratch buffers: steady state
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    p.select(in, f.params, sel);
    benchmark::DoNotOptimize(sel.blocks.data());
  }
  const double per_call =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
      static_cast<double>(state.iterations());
  const auto [frac, read_s] = frac_of_dense_floor(f, p, in, sel, per_call);
  state.counters["frac_of_dense_floor"] = frac;
  state.counters["dense_read_us"] = read_s * 1e6;
  state.counters["summary_MiB"] =
      summary.bytes_per_block() * static_cast<double>(f.num_blocks) / (1 << 20);
  state.counters["kv_MiB"] = static_cast<double>(f.kv_bytes()) / (1 << 20);
  state.counters["summary_over_kv"] =
      static_cast<double>(summary.bytes_per_block()) / f.layout.block_bytes();
  state.counters["speedup_vs_f16"] = speedup_vs_f16<Predictor>(f, summary, tokens);
}

template <class Predictor, class Summary>
void run_predictor(benchmark::State& state, Summary fixture::*summary) {
  fixture& f = get(static_cast<int>(state.range(0)));
  run_predictor_on<Predictor>(state, f, f.*summary);
}

void bm_lookahead_minmax(benchmark::State& state) {
  run_predictor<lookahead_predictor<minmax_summary<>, max_aggregation>>(state, &fixture::minmax);
}
void bm_lookahead_minmax_bf16(benchmark::State& state) {
  run_predictor<lookahead_predictor<minmax_summary<bf16>, max_aggregation>>(state,
                                                                            &fixture::minmax_bf16);
}
void bm_lookahead_quantized(benchmark::State& state) {
  run_predictor<lookahead_predictor<quantized_minmax_summary, max_aggregation>>(
      state, &fixture::quantized);
}
void bm_lookahead_legacy_f16(benchmark::State& state) {
  run_predictor<lookahead_predictor<legacy_minmax_f16, max_aggregation>>(state, &fixture::legacy);
}
void bm_lookahead_minmax_softmax(benchmark::State& state) {
  run_predictor<lookahead_predictor<minmax_summary<>, softmax_mass_aggregation>>(state,
                                                                                 &fixture::minmax);
}
void bm_lookahead_mean(benchmark::State& state) {
  run_predictor<lookahead_predictor<mean_summary, max_aggregation>>(state, &fixture::mean);
}

void bm_lookahead_int8_keys(benchmark::State& state) {
  run_predictor<lookahead_predictor<int8_key_summary, max_aggregation>>(state, &fixture::int8_keys);
}
void bm_lookahead_int8_keys_mass(benchmark::State& state) {
  run_predictor<lookahead_predictor<int8_key_summary, softmax_mass_aggregation>>(
      state, &fixture::int8_keys);
}

void bm_lookahead_quantized_mass(benchmark::State& state) {
  run_predictor<lookahead_predictor<quantized_minmax_summary>>(state, &fixture::quantized);
}
void bm_lookahead_int4_keys_mass(benchmark::State& state) {
  run_predictor<lookahead_predictor<int4_key_summary>>(state, &fixture::int4_keys);
}
void bm_lookahead_cascade_mass(benchmark::State& state) {
  fixture& f = get(static_cast<int>(state.range(0)));
  run_predictor_on<lookahead_predictor<qminmax_int4_cascade>>(
      state, f, *f.cascades.at(static_cast<int>(state.range(2))));
}

void bm_lookahead_int2_mass(benchmark::State& state) {
  fixture& f = get(static_cast<int>(state.range(0)));
  run_predictor_on<lookahead_predictor<qminmax_int2_summary>>(
      state, f, *f.int2s.at(static_cast<int>(state.range(2))));
}

void shape_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"shape", "tokens"});
  for (int s = 0; s < 2; ++s) {
    for (int n : {1, 2, 4}) {
      b->Args({s, n});
    }
  }
}

// qminmax_int2_summary (factor 4), 4 lookahead tokens, its KV heads' scoring on a pool of
// `threads` threads (`set_thread_pool`): wall time per select(), and `speedup_vs_1thread`, the
// time of the same select() without a pool over this one's, in alternating ~10 ms batches of
// wall time (median of 7 ratios; a pool's threads are not this thread's CPU time).
void bm_lookahead_int2_pool(benchmark::State& state) {
  fixture& f = get(static_cast<int>(state.range(0)));
  const auto threads = static_cast<unsigned>(state.range(1));
  qminmax_int2_summary& s = *f.int2s.at(4);
  const auto in = input_of(f, s, 4);
  cpu::thread_pool pool(threads);
  lookahead_predictor<qminmax_int2_summary> pooled, alone;
  pooled.set_thread_pool(&pool);
  selection sel;
  pooled.select(in, f.params, sel);
  alone.select(in, f.params, sel);
  for (auto _ : state) {
    pooled.select(in, f.params, sel);
    benchmark::DoNotOptimize(sel.blocks.data());
  }
  const auto wall = [&](auto& p, int calls) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) {
      p.select(in, f.params, sel);
      benchmark::DoNotOptimize(sel.blocks.data());
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / calls;
  };
  const int calls = std::max(1, static_cast<int>(0.01 / wall(alone, 1)));
  std::vector<double> ratios;
  for (int i = 0; i < 7; ++i) {
    const double one = wall(alone, calls);
    ratios.push_back(one / wall(pooled, calls));
  }
  std::nth_element(ratios.begin(), ratios.begin() + 3, ratios.end());
  state.counters["speedup_vs_1thread"] = ratios[3];
}

// The 32k shapes at 1 and 4 lookahead tokens, the 8k ones at 4.
void cascade_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"shape", "tokens", "factor"});
  for (int s = 0; s < 4; ++s) {
    for (int n : {1, 4}) {
      for (int factor : {2, 4, 8}) {
        if (s < 2 || n == 4) {
          b->Args({s, n, factor});
        }
      }
    }
  }
}

// shape_args, and the 8k shapes at 4 lookahead tokens.
void mass_args(benchmark::internal::Benchmark* b) {
  shape_args(b);
  b->Args({2, 4})->Args({3, 4});
}

}  // namespace

BENCHMARK(bm_dense_read)->ArgName("shape")->Arg(0)->Arg(1)->Arg(2)->Arg(3)->UseRealTime();
BENCHMARK(bm_lookahead_minmax)->Apply(shape_args)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_lookahead_minmax_bf16)
    ->Apply(shape_args)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_lookahead_quantized)->Apply(shape_args)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_lookahead_legacy_f16)->Apply(shape_args)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_lookahead_minmax_softmax)
    ->Apply(shape_args)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_lookahead_mean)
    ->ArgNames({"shape", "tokens"})
    ->Args({0, 4})
    ->Args({1, 4})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_lookahead_int8_keys)->Apply(shape_args)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_lookahead_int8_keys_mass)
    ->Apply(shape_args)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

BENCHMARK(bm_lookahead_quantized_mass)
    ->Apply(mass_args)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_lookahead_int4_keys_mass)
    ->Apply(shape_args)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_lookahead_cascade_mass)
    ->Apply(cascade_args)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_lookahead_int2_mass)
    ->Apply(cascade_args)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(bm_lookahead_int2_pool)
    ->ArgNames({"shape", "threads"})
    ->Args({1, 2})
    ->Args({3, 2})
    ->Args({0, 2})
    ->Args({2, 2})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
