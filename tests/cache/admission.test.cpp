// SPDX-License-Identifier: Apache-2.0
// cache::admission against the arithmetic it stands for: bytes per sequence counted block by
// block, and the blocks staged at admission against the kept window's definition.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "oasiskv/cache/admission.hpp"

using namespace oasiskv;

TEST_CASE("cache::admission: bytes per sequence, dense and selective, counted block by block") {
  const kv_layout l{30, 9, 3, 64, 16, dtype::f16};  // SmolLM2-135M's shape
  const std::uint64_t summary = 96;                 // bytes of one block's summary entry
  const auto a = cache::admission::double_buffered(l, 64, 0, summary);
  for (const std::uint64_t len : {1ull, 15ull, 16ull, 17ull, 2048ull, 32768ull, 100000ull}) {
    CAPTURE(len);
    std::uint64_t dense = 0, selective = 0, blocks = 0;
    for (std::uint64_t t = 0; t < len; t += l.tokens_per_block) {
      ++blocks;
    }
    for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
      for (std::uint64_t b = 0; b < blocks; ++b) {
        dense += l.block_bytes();
        selective += summary + (b < 128 ? l.block_bytes() : 0);  // two selections of 64
      }
    }
    const std::uint64_t fast = std::uint64_t{8} << 30;
    const admission_report r = a.report(len, fast);
    CHECK(r.dense_bytes_per_sequence == dense);
    CHECK(r.oasis_bytes_per_sequence == selective);
    CHECK(r.dense_sequences == fast / dense);
    CHECK(r.oasis_sequences == fast / selective);
  }
  // An adaptive cap above twice the budget is what a table may take: it is what is staged.
  CHECK(cache::admission::double_buffered(l, 64, 200, 0).staged_blocks(1000) == 200);
  CHECK(cache::admission::double_buffered(l, 64, 100, 0).staged_blocks(1000) == 128);
  CHECK(cache::admission::double_buffered(l, 64, 0, 0).staged_blocks(50) == 50);
  // Nothing to admit: nothing is divided by zero.
  const admission_report none = a.report(0, 1000);
  CHECK(none.dense_bytes_per_sequence == 0);
  CHECK(none.dense_sequences == 1000);
}

TEST_CASE("cache::admission: a pool with slack holds a selection, the kept blocks and slack") {
  const kv_layout l{4, 4, 2, 16, 16, dtype::f16};
  // 64 budget blocks + 25% slack + 1 sink + 2 recent.
  CHECK(cache::admission::with_slack(l, 64, 25, 1, 2, 0).staged_blocks(1000) == 64 + 16 + 3);
  // The newest block is always kept: a recent window of 0 still holds one.
  CHECK(cache::admission::with_slack(l, 64, 0, 1, 0, 0).staged_blocks(1000) == 66);
  CHECK(cache::admission::with_slack(l, 64, 25, 1, 2, 0).staged_blocks(40) == 40);
}

TEST_CASE("cache::admission::initial_blocks: the full blocks among the kept ones, or all") {
  for (std::uint32_t blocks = 0; blocks <= 9; ++blocks) {
    for (const bool partial : {false, true}) {
      if (partial && blocks == 0) {
        continue;
      }
      const std::uint32_t full = partial ? blocks - 1 : blocks;
      for (std::uint32_t sinks = 0; sinks <= 3; ++sinks) {
        for (std::uint32_t recent = 0; recent <= 3; ++recent) {
          CAPTURE(blocks);
          CAPTURE(full);
          CAPTURE(sinks);
          CAPTURE(recent);
          const block_window w = kept_window(blocks, sinks, recent);
          std::vector<std::uint32_t> selective, dense, want_selective, want_dense;
          cache::admission::initial_blocks(w, full, admission_mode::selective, selective);
          cache::admission::initial_blocks(w, full, admission_mode::full, dense);
          for (std::uint32_t b = 0; b < full; ++b) {
            want_dense.push_back(b);
            const bool sink = b < sinks;
            const bool in_recent = b + std::max(recent, 1u) >= blocks;
            if (sink || in_recent) {
              want_selective.push_back(b);
            }
          }
          CHECK(selective == want_selective);
          CHECK(dense == want_dense);
        }
      }
    }
  }
}
