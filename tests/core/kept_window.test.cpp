// SPDX-License-Identifier: Apache-2.0
// kept_window against the rule it states, block by block: the first sink_blocks, the last
// max(recent_blocks, 1), within the sequence, never counted twice.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <set>

#include "oasiskv/core/kept_window.hpp"
#include "oasiskv/core/selection.hpp"

using namespace oasiskv;

namespace {
// The kept blocks as a set, straight from the rule.
std::set<std::uint32_t> model(std::uint32_t n, std::uint32_t sinks, std::uint32_t recent) {
  std::set<std::uint32_t> kept;
  for (std::uint32_t b = 0; b < n; ++b) {
    const bool sink = b < sinks;
    const bool recent_block = b + std::max(recent, 1u) >= n;
    if (sink || recent_block) {
      kept.insert(b);
    }
  }
  return kept;
}
}  // namespace

TEST_CASE("kept_window: the sinks and the recent window, as the rule states them") {
  for (std::uint32_t n = 0; n <= 12; ++n) {
    for (std::uint32_t sinks = 0; sinks <= 5; ++sinks) {
      for (std::uint32_t recent = 0; recent <= 5; ++recent) {
        CAPTURE(n);
        CAPTURE(sinks);
        CAPTURE(recent);
        const block_window w = kept_window(n, sinks, recent);
        const std::set<std::uint32_t> want = model(n, sinks, recent);
        std::set<std::uint32_t> got;
        for (std::uint32_t b = 0; b < n; ++b) {
          if (w.keeps(b)) {
            got.insert(b);
          }
        }
        CHECK(got == want);
        CHECK(w.blocks == n);
        CHECK(w.kept() == want.size());  // sinks and window never overlap
        CHECK(w.sinks <= w.recent_from);
        CHECK(w.recent_from <= n);
        CHECK(w.candidates() == n - want.size());
        CHECK_FALSE(w.keeps(n));  // nothing past the sequence
        if (n > 0) {
          CHECK(w.keeps(n - 1));  // the newest token's block, even with recent_blocks = 0
        }
      }
    }
  }
}

TEST_CASE("kept_window: reads the counts of any parameters struct") {
  const selection_params sp{8, 2, 3};
  const block_window w = kept_window(20, sp);
  CHECK(w.sinks == 2);
  CHECK(w.recent_from == 17);
  CHECK(w.kept() == 5);
  static_assert(kept_window(1, 1, 1).kept() == 1);  // one block: a sink, not also recent
  static_assert(kept_window(3, 1, 0).recent() == 1);
  static_assert(min_budget_blocks(1, 0) == 2 && min_budget_blocks(2, 3) == 5);
}
