// SPDX-License-Identifier: Apache-2.0
// cpu_copy_engine: scattered whole-block copies between host tiers, against one contiguous
// memcpy of the same bytes measured in the same binary (the ratio is the figure that matters).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "oasiskv/tier/host_tier.hpp"
#include "oasiskv/transfer/cpu_copy_engine.hpp"

namespace {

const oasiskv::kv_layout smollm2{30, 9, 3, 64, 16, oasiskv::dtype::f16};  // 12 KiB blocks
constexpr std::uint32_t pool_blocks = 8192;                               // 96 MiB

void bm_memcpy_contiguous(benchmark::State& state) {
  const auto blocks = static_cast<std::size_t>(state.range(0));
  std::vector<std::byte> src(blocks * smollm2.block_bytes(), std::byte{1});
  std::vector<std::byte> dst(src.size());
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), src.size());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * src.size()));
}

void bm_copy_engine_scattered(benchmark::State& state) {
  const auto blocks = static_cast<std::uint32_t>(state.range(0));
  oasiskv::host_tier slow(smollm2, pool_blocks, {.prefault = true});
  oasiskv::host_tier fast(smollm2, blocks, {.prefault = true});
  std::vector<oasiskv::slot_id> ids(pool_blocks);
  std::iota(ids.begin(), ids.end(), 0u);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(7));
  std::vector<oasiskv::block_copy> batch;
  for (std::uint32_t i = 0; i < blocks; ++i) {
    batch.push_back({ids[i], i});
  }
  oasiskv::cpu_copy_engine engine;
  for (auto _ : state) {
    engine.wait(engine.submit(slow, fast, batch));
  }
  state.SetBytesProcessed(
      static_cast<std::int64_t>(state.iterations() * blocks * smollm2.block_bytes()));
}

}  // namespace

// Batches of one budget's worth of blocks: 512, 1024 and 2048 tokens of one layer.
BENCHMARK(bm_memcpy_contiguous)->Arg(32)->Arg(64)->Arg(128)->UseRealTime();
BENCHMARK(bm_copy_engine_scattered)->Arg(32)->Arg(64)->Arg(128)->UseRealTime();
BENCHMARK_MAIN();
