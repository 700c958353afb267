// SPDX-License-Identifier: Apache-2.0
// The mini-decoder's quantized products (apps/mini_decoder/ops/) against the memory-read limit.
//
// Decode multiplies every weight matrix by one token's activations (or a few: the verification
// of drafted tokens), so its floor is the time to read the weight bytes. Each row multiplies a
// set of matrices that together exceed the caches (256 MiB of weights, read in turn as a
// forward pass reads its layers) and reports bytes_per_second over the weight bytes and
// frac_of_read_bw: that rate divided by the read bandwidth of a vectorised byte-sum probe over
// the same weights, in this process, at the same thread count (median of 11 runs right after the
// row's timed loop). Rows:
//   probe/<shape>/<type>/threads:N                 the read-bandwidth probe over the weights
//   matvec/<shape>/<type>/<int8|int8_rows|f32>/n:T/threads:N
//                                                  matmul_quantized of T tokens, activations
//                                                  quantized to int8 (integer dot products) over
//                                                  the panel copies (int8; where the CPU has
//                                                  AVX-512 VNNI) or the stored rows (int8_rows),
//                                                  or kept in f32 (weights expanded to f32)
//   prefill_sgemm/<shape>/<type>/n:T/threads:N     matmul_prefill (weights expanded, OpenBLAS
//                                                  sgemm): the batched f32 baseline
// Shapes: smollm2 (1536 x 576, SmolLM2-135M's FFN up/gate) and llama8b (4096 x 4096, a
// Llama-3-8B attention projection). Types: Q4_1 and Q8_0 (random blocks with sane scales).
//   build/release/bench/matvec_bench [--benchmark_filter=...]
// The intrinsics below: the false positives of the compilers are silenced in one place.
#include <benchmark/benchmark.h>
#include <omp.h>
#include "oasiskv/cpu/kernel_begin.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <mini_decoder/io/mapped_file.hpp>
#include <mini_decoder/ops/int8_matmul.hpp>
#include <mini_decoder/ops/matmul.hpp>
#include <mini_decoder/ops/threads.hpp>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/cpu/isa.hpp"
#include "read_probe.hpp"

namespace {

using namespace mini_decoder;

struct shape {
  const char* name;
  std::uint32_t rows, cols;
};
constexpr shape shapes[] = {{"smollm2", 1536, 576}, {"llama8b", 4096, 4096}};
constexpr std::size_t weight_bytes = std::size_t{256} << 20;

// A set of matrices of one shape and type, adjacent in one buffer, 256 MiB in all.
struct fixture {
  std::vector<std::byte> mem;
  std::vector<weight_matrix> mats;  // rows in `mem`, with their panel copies where there are
  page_buffer panels;               // the panel copies (pack_panels), as the model loader makes
};

fixture& get_fixture(const shape& s, quant_type t) {
  static std::map<std::pair<const shape*, quant_type>, std::unique_ptr<fixture>> cache;
  auto& f = cache[{&s, t}];
  if (!f) {
    f = std::make_unique<fixture>();
    const std::size_t rb = row_bytes(t, s.cols), mb = rb * s.rows;
    const std::size_t count = std::max<std::size_t>(1, weight_bytes / mb);
    f->mem.resize(count * mb);
    std::mt19937 rng(1);
    std::uniform_int_distribution<int> byte(0, 255);
    for (auto& b : f->mem) {
      b = std::byte(static_cast<unsigned char>(byte(rng)));
    }
    const std::size_t bb = block_bytes(t);
    const std::uint16_t d = oasiskv::f16::from_float(0.01f).bits;
    const std::uint16_t m = oasiskv::f16::from_float(-0.05f).bits;
    for (std::size_t off = 0; off < f->mem.size(); off += bb) {
      std::memcpy(&f->mem[off], &d, 2);
      if (t == quant_type::q4_1) {
        std::memcpy(&f->mem[off + 2], &m, 2);
      }
    }
    for (std::size_t i = 0; i < count; ++i) {
      f->mats.push_back(weight_matrix{t, f->mem.data() + i * mb, s.rows, s.cols, rb});
    }
    if (panel_matmul_kernel(t) != nullptr) {
      const std::size_t pb = panel_bytes(f->mats.front());
      f->panels = page_buffer(pb * count);
      for (std::size_t i = 0; i < count; ++i) {
        pack_panels(f->mats[i], f->panels.data() + i * pb);
        f->mats[i].panels = f->panels.data() + i * pb;
      }
    }
  }
  return *f;
}

// ---- the read-bandwidth probe (read_probe.hpp), split over the OpenMP threads ---------------

using oasiskv::bench::byte_sum;

std::uint64_t probe_run(const std::vector<std::byte>& mem) {
  std::uint64_t total = 0;
  const std::int64_t chunks = 256;
  const std::size_t chunk = (mem.size() / chunks + 4095) / 4096 * 4096;
#pragma omp parallel for schedule(static) reduction(+ : total)
  for (std::int64_t i = 0; i < chunks; ++i) {
    const std::size_t b = std::min(mem.size(), static_cast<std::size_t>(i) * chunk);
    total += byte_sum(mem.data() + b, std::min(mem.size(), b + chunk) - b);
  }
  return total;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Median probe bandwidth (bytes/s), measured right after the row's timed loop.
double reference_bandwidth(const std::vector<std::byte>& mem) {
  std::vector<double> rates;
  for (int i = 0; i < 12; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(probe_run(mem));
    if (i >= 1) {  // the first run warms caches and TLBs
      rates.push_back(static_cast<double>(mem.size()) / seconds_since(t0));
    }
  }
  std::nth_element(rates.begin(), rates.begin() + rates.size() / 2, rates.end());
  return rates[rates.size() / 2];
}

void bm_probe(benchmark::State& state, const shape* s, quant_type t, int threads) {
  set_num_threads(threads);
  const fixture& f = get_fixture(*s, t);
  for (auto _ : state) {
    benchmark::DoNotOptimize(probe_run(f.mem));
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * f.mem.size()));
}

void bm_matvec(benchmark::State& state, const shape* s, quant_type t, matmul_activations act,
               bool panels, std::uint32_t n, int threads) {
  set_num_threads(threads);
  const matmul_activations before = get_matmul_activations();
  set_matmul_activations(act);
  fixture& f = get_fixture(*s, t);
  std::vector<const std::byte*> saved;
  for (weight_matrix& w : f.mats) {  // the row-layout rows multiply without the panel copies
    saved.push_back(w.panels);
    w.panels = panels ? w.panels : nullptr;
  }
  std::vector<float> x(std::size_t{n} * s->cols), y(std::size_t{n} * s->rows);
  std::mt19937 rng(2);
  std::normal_distribution<float> g;
  for (float& v : x) {
    v = g(rng);
  }
  std::size_t next = 0, bytes = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    const weight_matrix& w = f.mats[next];
    next = (next + 1) % f.mats.size();
    matmul_quantized(w, x.data(), n, y.data());
    benchmark::DoNotOptimize(y.data());
    bytes += w.row_stride * w.rows;
  }
  const double secs = seconds_since(t0);
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes));
  state.counters["frac_of_read_bw"] =
      static_cast<double>(bytes) / secs / reference_bandwidth(f.mem);
  state.counters["tokens_x_rows_per_s"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * n * s->rows, benchmark::Counter::kIsRate);
  state.SetLabel(matmul_isa() + (panels && f.mats.front().panels != nullptr ? " panels" : " rows"));
  set_matmul_activations(before);
  for (std::size_t i = 0; i < f.mats.size(); ++i) {
    f.mats[i].panels = saved[i];
  }
}

void bm_prefill_sgemm(benchmark::State& state, const shape* s, quant_type t, std::uint32_t n,
                      int threads) {
  set_num_threads(threads);
  const fixture& f = get_fixture(*s, t);
  std::vector<float> x(std::size_t{n} * s->cols, 0.5f), y(std::size_t{n} * s->rows), scratch;
  std::size_t next = 0;
  for (auto _ : state) {
    matmul_prefill(f.mats[next], x.data(), n, y.data(), scratch);
    next = (next + 1) % f.mats.size();
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["tokens_x_rows_per_s"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * n * s->rows, benchmark::Counter::kIsRate);
}

const int registered = [] {
  const int max_threads = omp_get_num_procs();
  for (const shape& s : shapes) {
    for (const quant_type t : {quant_type::q4_1, quant_type::q8_0}) {
      const std::string st = std::string(s.name) + "/" + to_string(t);
      for (int th = 1; th <= std::min(2, max_threads); ++th) {
        const std::string ts = "/threads:" + std::to_string(th);
        benchmark::RegisterBenchmark(("probe/" + st + ts).c_str(), bm_probe, &s, t, th)
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime();
        struct path {
          const char* name;
          matmul_activations act;
          bool panels;
        };
        for (const path p : {path{"int8", matmul_activations::int8, true},
                             path{"int8_rows", matmul_activations::int8, false},
                             path{"f32", matmul_activations::f32, false}}) {
          for (const std::uint32_t n : {1u, 4u, 16u, 64u}) {
            benchmark::RegisterBenchmark(
                ("matvec/" + st + "/" + p.name + "/n:" + std::to_string(n) + ts).c_str(), bm_matvec,
                &s, t, p.act, p.panels, n, th)
                ->Unit(benchmark::kMicrosecond)
                ->UseRealTime();
          }
        }
        for (const std::uint32_t n : {16u, 64u}) {
          benchmark::RegisterBenchmark(
              ("prefill_sgemm/" + st + "/n:" + std::to_string(n) + ts).c_str(), bm_prefill_sgemm,
              &s, t, n, th)
              ->Unit(benchmark::kMicrosecond)
              ->UseRealTime();
        }
      }
    }
  }
  return 0;
}();

}  // namespace

BENCHMARK_MAIN();

#include "oasiskv/cpu/kernel_end.hpp"
