// SPDX-License-Identifier: Apache-2.0
// cache::check_options and the per-call checks of the facade: every bad value is refused with
// an error that names it, and the limits that follow from good options are those the options
// state.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "oasiskv/cache/options.hpp"
#include "support/expect_error.hpp"

using namespace oasiskv;
using oasiskv::testing::expect_error;

namespace {
const kv_layout layout{2, 4, 2, 16, 4, dtype::f32};  // 4-token blocks
}  // namespace

TEST_CASE("cache::check_options: the limits that follow from good options") {
  const cache::step_limits fixed = cache::check_options(
      {.budget_tokens = 30, .sink_blocks = 2, .recent_blocks = 3}, layout, layout, 16);
  CHECK(fixed.budget_blocks == 8);  // 30 tokens round up to 8 blocks of 4
  CHECK(fixed.block_cap == 0);      // the fixed budget has no cap
  CHECK(fixed.scale == doctest::Approx(1.0 / std::sqrt(16.0)));
  CHECK(fixed.max_tokens == cache_options{}.max_tokens_per_sequence);
  const selection_params sp = fixed.selection();
  CHECK(sp.budget_blocks == 8);
  CHECK(sp.sink_blocks == 2);
  CHECK(sp.recent_blocks == 3);
  CHECK(fixed.window(10).recent_from == 7);

  // The adaptive cap defaults to twice the budget, within the fast tier's slots less one.
  CHECK(cache::check_options({.budget_tokens = 16, .target_mass = 0.9f}, layout, layout, 100)
            .block_cap == 8);
  CHECK(cache::check_options({.budget_tokens = 16, .target_mass = 0.9f}, layout, layout, 6)
            .block_cap == 5);
  CHECK(cache::check_options({.budget_tokens = 16, .target_mass = 0.5f, .max_selected_blocks = 5},
                             layout, layout, 100)
            .block_cap == 5);
  CHECK(cache::check_options({.budget_tokens = 16, .scale = 0.5f}, layout, layout, 8).scale ==
        0.5f);
}

TEST_CASE("cache::check_options: each bad option is refused, naming it") {
  const kv_layout other{2, 4, 2, 16, 8, dtype::f32};
  expect_error([&] { cache::check_options({.budget_tokens = 16}, layout, other, 16); },
               errc::layout_mismatch, "layouts differ");
  expect_error([&] { cache::check_options({.budget_tokens = 0}, layout, layout, 16); },
               errc::invalid_argument, "budget_tokens = 0");
  // Below the kept blocks: one sink and the recent window, which holds at least one block.
  expect_error(
      [&] {
        cache::check_options({.budget_tokens = 8, .sink_blocks = 1, .recent_blocks = 2}, layout,
                             layout, 16);
      },
      errc::invalid_argument, "budget_tokens = 8 (2 blocks) is smaller than");
  expect_error(
      [&] {
        cache::check_options({.budget_tokens = 4, .sink_blocks = 1, .recent_blocks = 0}, layout,
                             layout, 16);
      },
      errc::invalid_argument, "max(recent_blocks, 1) = 2");
  expect_error([&] { cache::check_options({.budget_tokens = 16}, layout, layout, 4); },
               errc::invalid_argument, "fast tier's 4 slots cannot stage one selection of 4");
  for (const float bad : {1.5f, -0.25f, std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::infinity()}) {
    CAPTURE(bad);
    expect_error(
        [&] {
          cache::check_options({.budget_tokens = 16, .target_mass = bad}, layout, layout, 16);
        },
        errc::invalid_argument, "target_mass = ");
  }
  expect_error(
      [&] {
        cache::check_options({.budget_tokens = 16, .target_mass = 0.9f, .max_selected_blocks = 3},
                             layout, layout, 16);
      },
      errc::invalid_argument, "max_selected_blocks = 3 is below the budget of 4 blocks");
  expect_error(
      [&] {
        cache::check_options({.budget_tokens = 16, .target_mass = 0.9f, .max_selected_blocks = 8},
                             layout, layout, 8);
      },
      errc::invalid_argument, "cannot stage a selection of up to 8 blocks");
}

TEST_CASE("cache: the per-call checks name the call, the sequence and the value") {
  const cache::step_limits limits = cache::check_options(
      {.budget_tokens = 16, .max_tokens_per_sequence = 40}, layout, layout, 16);
  const sequence_id seq{7};
  CHECK_NOTHROW(limits.check_room(30, 10, "append", seq, 1));
  expect_error([&] { limits.check_room(30, 11, "append", seq, 1); }, errc::out_of_range,
               "append: 11 tokens to sequence 7 layer 1 (30 tokens) would pass "
               "max_tokens_per_sequence = 40");

  std::vector<float> q(2 * layout.num_q_heads * layout.head_dim, 0.5f);
  CHECK_NOTHROW(cache::check_lookahead(layout, {q.data(), nullptr, 2}, 5, seq, 0));
  expect_error(
      [&] {
        cache::check_lookahead(layout, {nullptr, nullptr, 2}, 5, seq, 0);
      },
      errc::invalid_argument, "null data");
  expect_error(
      [&] {
        cache::check_lookahead(layout, {q.data(), nullptr, 17}, 5, seq, 0);
      },
      errc::invalid_argument, "got 17 tokens");
  expect_error(
      [&] {
        cache::check_lookahead(layout, {q.data(), nullptr, 2}, 0, seq, 3);
      },
      errc::invalid_argument, "sequence 7 layer 3 holds no tokens");

  CHECK_NOTHROW(cache::check_step(4, false, false, 4, seq, 0));
  CHECK_NOTHROW(cache::check_step(4, true, true, 1, seq, 0));
  expect_error([&] { cache::check_step(3, true, false, 4, seq, 1); }, errc::invalid_argument,
               "holds 3 tokens, fewer than q_len = 4");
  expect_error([&] { cache::check_step(8, false, true, 1, seq, 1); }, errc::invalid_argument,
               "has no lookahead selection for this step");
}
