// SPDX-License-Identifier: Apache-2.0
// file_tier: scattered 12 KiB blocks (SmolLM2-135M) read in batches through io_uring and through
// the pread pool, against one large sequential O_DIRECT read of the same number of bytes from
// the same file, measured in the same binary (the `frac_of_sequential` counter). With O_DIRECT
// the guest page cache is bypassed, so this measures the device (and whatever cache the host or
// the drive itself keeps). The file goes to $OASISKV_BENCH_DIR (default /tmp).
#include <benchmark/benchmark.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "oasiskv/tier/file_tier.hpp"

namespace {

const oasiskv::kv_layout smollm2{30, 9, 3, 64, 16, oasiskv::dtype::f16};  // 12 KiB blocks
constexpr std::uint32_t pool_blocks = 32768;                              // 384 MiB file

std::string bench_dir() {
  const char* d = std::getenv("OASISKV_BENCH_DIR");
  return d != nullptr ? d : "/tmp";
}

struct aligned_delete {
  void operator()(std::byte* p) const noexcept { ::operator delete[](p, std::align_val_t{4096}); }
};
using aligned_bytes = std::unique_ptr<std::byte[], aligned_delete>;
aligned_bytes aligned_alloc_bytes(std::size_t n) {
  return aligned_bytes(static_cast<std::byte*>(::operator new[](n, std::align_val_t{4096})));
}

// One filled file per backend, written once: fallocated but unwritten extents read as zeros
// without touching the device, which would flatter every figure.
oasiskv::file_tier& pool(oasiskv::file_backend backend) {
  static std::map<oasiskv::file_backend, std::unique_ptr<oasiskv::file_tier>> pools;
  auto& p = pools[backend];
  if (!p) {
    p = std::make_unique<oasiskv::file_tier>(
        smollm2, pool_blocks, oasiskv::file_tier_options{.path = bench_dir(), .backend = backend});
    constexpr std::uint32_t chunk = 256;
    aligned_bytes buf = aligned_alloc_bytes(chunk * smollm2.block_bytes());
    std::mt19937_64 rng(1);
    for (std::size_t i = 0; i < chunk * smollm2.block_bytes() / 8; ++i) {
      const std::uint64_t v = rng();
      std::memcpy(buf.get() + i * 8, &v, 8);
    }
    std::vector<oasiskv::block_write> writes(chunk);
    for (std::uint32_t first = 0; first < pool_blocks; first += chunk) {
      for (std::uint32_t i = 0; i < chunk; ++i) {
        writes[i] = {first + i, buf.get() + i * smollm2.block_bytes()};
      }
      p->write_blocks(writes);
    }
  }
  return *p;
}

// Bytes per second of one contiguous O_DIRECT pread of `blocks` blocks at a random place in the
// pool, over `reps` reads: the device's sequential figure for the same amount of data.
double sequential_rate(std::uint32_t blocks, int reps) {
  const oasiskv::file_tier& t = pool(oasiskv::file_backend::pread_pool);
  const std::size_t bytes = std::size_t{blocks} * t.slot_bytes();
  aligned_bytes buf = aligned_alloc_bytes(bytes);
  std::mt19937 rng(11);
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r) {
    const std::uint64_t first = rng() % (pool_blocks - blocks);
    const ssize_t n =
        ::pread(t.native_handle(), buf.get(), bytes, static_cast<off_t>(first * t.slot_bytes()));
    if (n != static_cast<ssize_t>(bytes)) {
      std::abort();
    }
  }
  const std::chrono::duration<double> s = std::chrono::steady_clock::now() - start;
  return static_cast<double>(bytes) * reps / s.count();
}

double sequential_baseline(std::uint32_t blocks) {
  static std::map<std::uint32_t, double> cache;
  auto [it, fresh] = cache.try_emplace(blocks, 0.0);
  if (fresh) {
    sequential_rate(blocks, 20);  // warm-up
    it->second = sequential_rate(blocks, 400);
  }
  return it->second;
}

std::vector<oasiskv::slot_id> scattered_slots(std::uint32_t n, std::uint32_t seed) {
  std::vector<oasiskv::slot_id> ids(pool_blocks);
  std::iota(ids.begin(), ids.end(), 0u);
  std::mt19937 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(n);
  return ids;
}

void bm_sequential_direct(benchmark::State& state) {
  const auto blocks = static_cast<std::uint32_t>(state.range(0));
  const oasiskv::file_tier& t = pool(oasiskv::file_backend::pread_pool);
  const std::size_t bytes = std::size_t{blocks} * t.slot_bytes();
  aligned_bytes buf = aligned_alloc_bytes(bytes);
  std::mt19937 rng(3);
  for (auto _ : state) {
    const std::uint64_t first = rng() % (pool_blocks - blocks);
    benchmark::DoNotOptimize(
        ::pread(t.native_handle(), buf.get(), bytes, static_cast<off_t>(first * t.slot_bytes())));
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}

// A new random set of slots every iteration, so no two batches read the same places.
void scattered(benchmark::State& state, oasiskv::file_backend backend, bool batched) {
  const auto blocks = static_cast<std::uint32_t>(state.range(0));
  oasiskv::file_tier& t = pool(backend);
  const double seq = sequential_baseline(blocks);
  const std::size_t bb = smollm2.block_bytes();
  aligned_bytes dst = aligned_alloc_bytes(std::size_t{blocks} * bb);
  std::vector<std::vector<oasiskv::block_read>> batches;
  for (std::uint32_t k = 0; k < 64; ++k) {
    std::vector<oasiskv::block_read> reads;
    for (const oasiskv::slot_id s : scattered_slots(blocks, 100 + k)) {
      reads.push_back({s, dst.get() + reads.size() * bb});
    }
    batches.push_back(std::move(reads));
  }
  std::size_t k = 0;
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    const auto& reads = batches[k++ % batches.size()];
    if (batched) {
      t.read_blocks(reads);
    } else {
      for (const oasiskv::block_read& r : reads) {
        t.read_block(r.slot, r.out);
      }
    }
  }
  const std::chrono::duration<double> s = std::chrono::steady_clock::now() - start;
  const double bytes = static_cast<double>(state.iterations()) * blocks * bb;
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes));
  state.counters["frac_of_sequential"] = bytes / s.count() / seq;
  state.counters["seq_GBps"] = seq / 1e9;
  state.SetLabel(std::string(oasiskv::to_string(t.backend())) +
                 (t.direct_io() ? " O_DIRECT" : " buffered"));
}

void bm_scattered_io_uring(benchmark::State& state) {
  if (!oasiskv::file_tier::io_uring_available()) {
    state.SkipWithError("io_uring unavailable (no liburing in this build, or refused)");
    return;
  }
  scattered(state, oasiskv::file_backend::io_uring, true);
}
void bm_scattered_pread_pool(benchmark::State& state) {
  scattered(state, oasiskv::file_backend::pread_pool, true);
}
// One block per call on the caller's thread: what batching buys.
void bm_scattered_one_at_a_time(benchmark::State& state) {
  scattered(state, oasiskv::file_backend::pread_pool, false);
}

}  // namespace

BENCHMARK(bm_sequential_direct)->Arg(64)->Arg(128)->UseRealTime();
BENCHMARK(bm_scattered_io_uring)->Arg(64)->Arg(128)->UseRealTime();
BENCHMARK(bm_scattered_pread_pool)->Arg(64)->Arg(128)->UseRealTime();
BENCHMARK(bm_scattered_one_at_a_time)->Arg(64)->Arg(128)->UseRealTime();
BENCHMARK_MAIN();
