// SPDX-License-Identifier: Apache-2.0
// CPU decode attention against the memory-read limit.
//
// Decode attention reads each selected K and V byte once, so its floor is the time to read those
// bytes. Every kernel row reports bytes_per_second over the K+V bytes it reads and
// frac_of_read_bw: that rate divided by the read bandwidth of a vectorised byte-sum probe over
// the very memory the row reads (the pool, with its huge pages, or the baseline's own f32
// copy), measured in this process at the same thread count (median of 11 runs right after each
// timed loop). Rows:
//   probe/<shape>/threads:N                    the read-bandwidth probe over the pool
//   sparse_decode/<shape>/<budget>/threads:N   cpu::sparse_decode, budget 512..4096 tokens or dense
//   scalar_loop/<shape>/dense                  a straightforward per-q-head loop over the f16 pool
//                                              (what one writes first)
//   openblas_sgemm/<shape>/dense               per KV head, cblas_sgemm of its query heads for the
//                                              scores and for the output, over K and V converted
//                                              to f32 once, before the timed loop (what one writes
//                                              with a BLAS at hand)
// Shapes: llama32k (32 q / 8 kv heads, head dim 128) and smollm2 (9 q / 3 kv, head dim 64), both
// 32768 tokens of context in 16-token f16 blocks scattered over the pool in random order. A
// budget keeps a sink block, the 8 most recent blocks and a random subset of the rest; the pool
// is split into disjoint selections of that size and each iteration attends the next one, as
// consecutive layers do (no layer reads another's blocks), so a small budget is read from
// memory, not from the caches, and the row reads the same pages as its probe.
#include <benchmark/benchmark.h>
#if OASISKV_BENCH_OPENBLAS
#include <cblas.h>
#include <sys/mman.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <new>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "oasiskv/attention/cpu_sparse_decode.hpp"
#include "oasiskv/tier/host_tier.hpp"
#include "read_probe.hpp"

namespace {

using namespace oasiskv;

constexpr std::uint32_t context = 32768;
constexpr std::uint32_t tokens_per_block = 16;
constexpr std::uint32_t num_blocks = context / tokens_per_block;
constexpr std::uint32_t recent_blocks = 8;
constexpr std::uint32_t selections = 16;

struct shape {
  const char* name;
  std::uint32_t q_heads, kv_heads, head_dim;
};
constexpr shape shapes[] = {{"llama32k", 32, 8, 128}, {"smollm2", 9, 3, 64}};

// One sequence of `context` tokens in a pool of exactly its blocks (random slot order), its
// query, and the block tables of every budget.
struct fixture {
  kv_layout layout;
  host_tier pool;
  std::vector<slot_id> slot_of;  // [num_blocks] slot holding block i
  std::vector<float> q, out, lse;
  std::uint32_t seq_len = context;
  std::map<std::uint32_t, std::vector<std::vector<block_ref>>> tables;  // budget -> selections

  explicit fixture(const shape& s)
      : layout{1, s.q_heads, s.kv_heads, s.head_dim, tokens_per_block, dtype::f16},
        pool(layout, num_blocks,
             {.align = host_tier_options::alignment::page, .huge_pages = true, .prefault = true}) {
    std::mt19937 rng(42);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<f16> values(4096);
    for (auto& v : values) {
      v = f16::from_float(dist(rng));
    }
    const std::size_t elems = layout.block_bytes() / sizeof(f16);
    for (slot_id sl = 0; sl < num_blocks; ++sl) {
      auto* p = reinterpret_cast<f16*>(pool.slot_data(sl));
      for (std::size_t i = 0; i < elems; ++i) {
        p[i] = values[(i * 7 + sl * 13) % values.size()];
      }
    }
    slot_of.resize(num_blocks);
    std::iota(slot_of.begin(), slot_of.end(), 0u);
    std::shuffle(slot_of.begin(), slot_of.end(), rng);
    q.resize(std::size_t{s.q_heads} * s.head_dim);
    for (auto& x : q) {
      x = dist(rng);
    }
    out.resize(q.size());
    lse.resize(s.q_heads);
  }

  // Disjoint selections of `budget_tokens` each (one covering every block for a dense budget),
  // together covering the pool: selection i's blocks live in slots [i * nb, (i + 1) * nb) of a
  // random permutation. Each names the sink, the recent window and a random subset of the middle
  // as its logical blocks, in block order.
  const std::vector<std::vector<block_ref>>& selection(std::uint32_t budget_tokens) {
    auto& sel = tables[budget_tokens];
    if (!sel.empty()) {
      return sel;
    }
    const std::uint32_t nb = std::min(num_blocks, budget_tokens / tokens_per_block);
    const std::uint32_t count = num_blocks / nb;
    std::vector<slot_id> slots(num_blocks);
    std::iota(slots.begin(), slots.end(), 0u);
    std::mt19937 slot_rng(7);
    std::shuffle(slots.begin(), slots.end(), slot_rng);
    for (std::uint32_t i = 0; i < count; ++i) {
      std::vector<std::uint32_t> idx;
      if (nb == num_blocks) {
        idx.resize(num_blocks);
        std::iota(idx.begin(), idx.end(), 0u);
      } else {
        std::vector<std::uint32_t> middle(num_blocks - 1 - recent_blocks);
        std::iota(middle.begin(), middle.end(), 1u);
        std::mt19937 rng(1000 + i);
        std::shuffle(middle.begin(), middle.end(), rng);
        idx.assign(middle.begin(), middle.begin() + (nb - 1 - recent_blocks));
        idx.push_back(0);
        for (std::uint32_t b = num_blocks - recent_blocks; b < num_blocks; ++b) {
          idx.push_back(b);
        }
        std::sort(idx.begin(), idx.end());
      }
      std::vector<block_ref> refs;
      for (std::uint32_t j = 0; j < nb; ++j) {
        refs.push_back({nb == num_blocks ? slot_of[idx[j]] : slots[i * nb + j], idx[j]});
      }
      sel.push_back(std::move(refs));
    }
    return sel;
  }

  // The pool's memory: what the kernel rows read, and their probe.
  std::span<const std::byte> memory() const {
    return {pool.slot_data(0), std::size_t{pool.view().slot_stride} * num_blocks};
  }

  decode_params params(const std::vector<block_ref>& refs, const std::uint32_t* offsets) {
    decode_params p;
    p.q = q.data();
    p.pool = pool.view();
    p.table = {refs.data(), offsets, 1, 1};
    p.seq_lens = &seq_len;
    p.out = out.data();
    p.lse = lse.data();
    p.num_seqs = 1;
    p.q_len = 1;
    p.scale = 1.0f / std::sqrt(static_cast<float>(layout.head_dim));
    return p;
  }

  std::size_t selected_bytes(std::size_t blocks) const { return blocks * layout.block_bytes(); }
};

fixture& get_fixture(const shape& s) {
  static std::map<const shape*, std::unique_ptr<fixture>> cache;
  auto& f = cache[&s];
  if (!f) {
    f = std::make_unique<fixture>(s);
  }
  return *f;
}

// ---------------------------------------------------------------------------------------------
// Read-bandwidth probe: the sum of every byte of a buffer (vpsadbw), split over threads.

using oasiskv::bench::byte_sum;

// The probe over `mem`, split over the pool's threads in page-aligned chunks.
std::uint64_t probe_run(std::span<const std::byte> mem, cpu::thread_pool& pool) {
  const unsigned t = pool.size();
  std::vector<std::uint64_t> part(t);
  const std::size_t bytes = mem.size();
  const std::size_t chunk = (bytes / t + 4095) / 4096 * 4096;
  pool.parallel_for(t, [&](std::size_t i) {
    const std::size_t b = std::min(bytes, i * chunk);
    part[i] = byte_sum(mem.data() + b, std::min(bytes, b + chunk) - b);
  });
  return std::accumulate(part.begin(), part.end(), std::uint64_t{0});
}

cpu::thread_pool& get_pool(unsigned threads) {
  static std::map<unsigned, std::unique_ptr<cpu::thread_pool>> cache;
  auto& p = cache[threads];
  if (!p) {
    p = std::make_unique<cpu::thread_pool>(threads);
  }
  return *p;
}

// Median probe bandwidth (bytes/s) over `mem` at `threads` threads, measured right after the
// kernel row's timed loop: on a shared machine the available bandwidth drifts, so the ratio is
// taken against a probe run under the same conditions, over the same pages.
double reference_bandwidth(std::span<const std::byte> mem, unsigned threads) {
  cpu::thread_pool& pool = get_pool(threads);
  std::vector<double> rates;
  for (int i = 0; i < 12; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(probe_run(mem, pool));
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    if (i >= 1) {  // the first run warms caches and TLBs
      rates.push_back(static_cast<double>(mem.size()) / dt.count());
    }
  }
  std::nth_element(rates.begin(), rates.begin() + rates.size() / 2, rates.end());
  return rates[rates.size() / 2];
}

void bm_probe(benchmark::State& state, const shape* s, unsigned threads) {
  const std::span<const std::byte> mem = get_fixture(*s).memory();
  cpu::thread_pool& pool = get_pool(threads);
  for (auto _ : state) {
    benchmark::DoNotOptimize(probe_run(mem, pool));
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * mem.size()));
}

// Wall time of a benchmark's timed loop, for the frac_of_read_bw ratio (a plain number; Google
// Benchmark's rate counters would print it with a "/s").
struct loop_timer {
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
};

void set_counters(benchmark::State& state, std::span<const std::byte> mem,
                  std::size_t bytes_per_iter, unsigned threads, double seconds) {
  const double bytes = static_cast<double>(state.iterations()) * bytes_per_iter;
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes));
  const double ref = reference_bandwidth(mem, threads);
  state.counters["frac_of_read_bw"] = bytes / seconds / ref;
  state.counters["probe_GBps"] = ref / 1e9;
}

// ---------------------------------------------------------------------------------------------
// The kernel.

// hot: every iteration attends the same selection, which then stays in L2: the kernel's
// compute limit, with next to no memory traffic (its frac_of_read_bw above 1 says by how much
// the arithmetic could outrun the read probe).
void bm_sparse_decode(benchmark::State& state, const shape* s, std::uint32_t budget,
                      unsigned threads, bool hot) {
  fixture& f = get_fixture(*s);
  const auto& sel = f.selection(budget);
  const std::uint32_t offsets[2] = {0, static_cast<std::uint32_t>(sel[0].size())};
  const cpu::sparse_decode kernel(get_pool(threads));
  std::vector<decode_params> ps;
  for (const auto& refs : sel) {
    ps.push_back(f.params(refs, offsets));
  }
  std::size_t i = 0;
  const loop_timer timer;
  for (auto _ : state) {
    kernel.decode(ps[i]);
    benchmark::DoNotOptimize(f.out.data());
    benchmark::ClobberMemory();
    i = hot || i + 1 == ps.size() ? 0 : i + 1;
  }
  set_counters(state, f.memory(), f.selected_bytes(sel[0].size()), threads, timer.seconds());
  state.SetLabel(std::string(to_string(kernel.isa())));
}

// ---------------------------------------------------------------------------------------------
// Baselines, dense only, one thread: what one would write without this library.

void bm_scalar_loop(benchmark::State& state, const shape* s) {
  fixture& f = get_fixture(*s);
  const auto& refs = f.selection(context)[0];
  const kv_layout& l = f.layout;
  const block_pool_view pool = f.pool.view();
  const float scale = 1.0f / std::sqrt(static_cast<float>(l.head_dim));
  std::vector<float> scores(context);
  const loop_timer timer;
  for (auto _ : state) {
    for (std::uint32_t h = 0; h < l.num_q_heads; ++h) {
      const std::uint32_t kvh = h / l.group_size();
      const float* q = f.q.data() + std::size_t{h} * l.head_dim;
      float mx = -INFINITY;
      std::size_t n = 0;
      for (const block_ref& r : refs) {
        const f16* k = pool.keys<f16>(r.slot, kvh);
        for (std::uint32_t t = 0; t < tokens_per_block; ++t, ++n) {
          float dot = 0.0f;
          for (std::uint32_t x = 0; x < l.head_dim; ++x) {
            dot += q[x] * k[t * l.head_dim + x].to_float();
          }
          scores[n] = dot * scale;
          mx = std::max(mx, scores[n]);
        }
      }
      float sum = 0.0f;
      for (std::size_t t = 0; t < n; ++t) {
        scores[t] = std::exp(scores[t] - mx);
        sum += scores[t];
      }
      float* out = f.out.data() + std::size_t{h} * l.head_dim;
      std::fill(out, out + l.head_dim, 0.0f);
      n = 0;
      for (const block_ref& r : refs) {
        const f16* v = pool.values<f16>(r.slot, kvh);
        for (std::uint32_t t = 0; t < tokens_per_block; ++t, ++n) {
          for (std::uint32_t x = 0; x < l.head_dim; ++x) {
            out[x] += scores[n] * v[t * l.head_dim + x].to_float();
          }
        }
      }
      for (std::uint32_t x = 0; x < l.head_dim; ++x) {
        out[x] /= sum;
      }
      f.lse[h] = mx + std::log(sum);
    }
    benchmark::DoNotOptimize(f.out.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, f.memory(), f.selected_bytes(refs.size()), 1, timer.seconds());
}

#if OASISKV_BENCH_OPENBLAS
// K and V of every kv head as f32 rows in block order ([kv_heads][context][head_dim] each, one
// buffer), converted once: the baseline's input, in page-aligned memory with huge pages
// advised, as the pool's is.
struct f32_kv {
  std::size_t elems_per_head = 0;
  std::size_t bytes = 0;
  std::unique_ptr<float, void (*)(float*)> buf{nullptr, [](float* p) {
                                                 std::free(p);
                                               }};

  explicit f32_kv(const fixture& f) {
    const kv_layout& l = f.layout;
    const block_pool_view pool = f.pool.view();
    constexpr std::size_t huge = std::size_t{2} << 20;
    elems_per_head = std::size_t{context} * l.head_dim;
    bytes = (2 * l.num_kv_heads * elems_per_head * sizeof(float) + huge - 1) / huge * huge;
    buf.reset(static_cast<float*>(std::aligned_alloc(huge, bytes)));
    if (!buf) {
      throw std::bad_alloc();
    }
    ::madvise(buf.get(), bytes, MADV_HUGEPAGE);
    const auto& refs = const_cast<fixture&>(f).selection(context)[0];
    for (std::uint32_t kvh = 0; kvh < l.num_kv_heads; ++kvh) {
      float* k32 = keys(kvh);
      float* v32 = values(kvh);
      std::size_t n = 0;
      for (const block_ref& r : refs) {
        const f16* k = pool.keys<f16>(r.slot, kvh);
        const f16* v = pool.values<f16>(r.slot, kvh);
        for (std::size_t i = 0; i < tokens_per_block * l.head_dim; ++i, ++n) {
          k32[n] = k[i].to_float();
          v32[n] = v[i].to_float();
        }
      }
    }
  }
  float* keys(std::uint32_t kvh) const { return buf.get() + 2 * kvh * elems_per_head; }
  float* values(std::uint32_t kvh) const { return keys(kvh) + elems_per_head; }
};

void bm_openblas(benchmark::State& state, const shape* s) {
  fixture& f = get_fixture(*s);
  const kv_layout& l = f.layout;
  static std::map<const shape*, std::unique_ptr<f32_kv>> cache;
  auto& kv = cache[s];
  if (!kv) {
    kv = std::make_unique<f32_kv>(f);
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(l.head_dim));
  const std::size_t d = l.head_dim;
  const auto rows = static_cast<int>(context);
  openblas_set_num_threads(1);
  const loop_timer timer;
  const auto group = static_cast<int>(l.group_size());
  std::vector<float> scores(std::size_t{l.group_size()} * context);
  for (auto _ : state) {
    for (std::uint32_t kvh = 0; kvh < l.num_kv_heads; ++kvh) {
      // The KV head's query heads at once: scores = scale * Q K^T, then out = softmax(scores) V.
      const float* q = f.q.data() + std::size_t{kvh} * l.group_size() * d;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, group, rows, static_cast<int>(d), scale,
                  q, static_cast<int>(d), kv->keys(kvh), static_cast<int>(d), 0.0f, scores.data(),
                  rows);
      for (int g = 0; g < group; ++g) {
        float* sc = scores.data() + std::size_t(g) * context;
        const float mx = *std::max_element(sc, sc + rows);
        float sum = 0.0f;
        for (int t = 0; t < rows; ++t) {
          sc[t] = std::exp(sc[t] - mx);
          sum += sc[t];
        }
        for (int t = 0; t < rows; ++t) {
          sc[t] /= sum;
        }
        f.lse[kvh * l.group_size() + g] = mx + std::log(sum);
      }
      float* out = f.out.data() + std::size_t{kvh} * l.group_size() * d;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, group, static_cast<int>(d), rows, 1.0f,
                  scores.data(), rows, kv->values(kvh), static_cast<int>(d), 0.0f, out,
                  static_cast<int>(d));
    }
    benchmark::DoNotOptimize(f.out.data());
    benchmark::ClobberMemory();
  }
  // It reads the f32 copy: twice the f16 bytes, against a probe over that copy.
  const std::size_t read = 2 * std::size_t{l.num_kv_heads} * kv->elems_per_head * sizeof(float);
  set_counters(state, {reinterpret_cast<const std::byte*>(kv->buf.get()), read}, read, 1,
               timer.seconds());
  state.SetLabel("f32 copy made once");
}

#endif  // OASISKV_BENCH_OPENBLAS

}  // namespace

int main(int argc, char** argv) {
  const std::uint32_t budgets[] = {512, 1024, 2048, 4096, context};
  for (const shape& s : shapes) {
    const std::string n = s.name;
    for (unsigned t : {1u, 2u}) {
      benchmark::RegisterBenchmark(("probe/" + n + "/threads:" + std::to_string(t)).c_str(),
                                   bm_probe, &s, t)
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
      for (std::uint32_t b : budgets) {
        const std::string bn = b == context ? "dense" : "budget:" + std::to_string(b);
        benchmark::RegisterBenchmark(
            ("sparse_decode/" + n + "/" + bn + "/threads:" + std::to_string(t)).c_str(),
            bm_sparse_decode, &s, b, t, false)
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
      }
      benchmark::RegisterBenchmark(
          ("sparse_decode/" + n + "/hot:512/threads:" + std::to_string(t)).c_str(),
          bm_sparse_decode, &s, 512u, t, true)
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    }
    benchmark::RegisterBenchmark(("scalar_loop/" + n + "/dense").c_str(), bm_scalar_loop, &s)
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
#if OASISKV_BENCH_OPENBLAS
    benchmark::RegisterBenchmark(("openblas_sgemm/" + n + "/dense").c_str(), bm_openblas, &s)
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
#endif
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) {
    return 1;
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
