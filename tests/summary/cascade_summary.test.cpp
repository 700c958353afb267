// SPDX-License-Identifier: Apache-2.0
// cascade_summary<Coarse, Fine>: the two-stage scores against a brute-force model (coarse bounds,
// top contenders, fine max / log-mass from the dequantized keys), the predictor's selection
// equal to the fine summary's when every block is a contender, what a small contender factor
// gives up, the forwarded hooks and bad input.
#include <doctest/doctest.h>

#include "support/expect_error.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "oasiskv/oasiskv.hpp"
#include "support/kv_fixture.hpp"
#include "support/summary_inputs.hpp"

using namespace oasiskv;

namespace {

using oasiskv::testing::expect_error;
using oasiskv::testing::random_rows;
using oasiskv::testing::set_key;

static_assert(two_stage_summary<qminmax_int4_cascade> && two_stage_summary<qminmax_int8_cascade>);

// The fine scorer written out: max or scaled log-sum-exp of dot products with the fine part's
// dequantized keys, in double.
template <class C>
double fine_model(const C& c, std::uint32_t h, std::uint32_t b, std::uint32_t tokens,
                  const float* q, float scale) {
  std::vector<double> logits;
  for (std::uint32_t t = 0; t < tokens; ++t) {
    const std::vector<float> k = c.fine().dequantized(h, b, t);
    double a = 0.0;
    for (std::size_t x = 0; x < k.size(); ++x) {
      a += double{q[x]} * k[x];
    }
    logits.push_back(a);
  }
  if (logits.empty()) {
    return -std::numeric_limits<double>::infinity();
  }
  const double m = *std::max_element(logits.begin(), logits.end());
  if (scale == 0.0f) {
    return m;
  }
  double sum = 0.0;
  for (const double v : logits) {
    sum += std::exp(scale * (v - m));
  }
  return m + std::log(sum) / scale;
}

}  // namespace

TEST_CASE_TEMPLATE("cascade_summary: fine scores for the top coarse bounds, -inf for the rest", C,
                   qminmax_int4_cascade, qminmax_int8_cascade) {
  const kv_layout l{1, 8, 2, 64, 16, dtype::f16};
  constexpr std::uint32_t blocks = 40;
  host_tier pool(l, blocks);
  testing::fill_random(pool, 11);
  std::vector<std::uint32_t> fill(blocks);
  std::mt19937 rng(5);
  for (std::uint32_t b = 0; b < blocks; ++b) {
    fill[b] = b == 7 ? 0 : 1 + static_cast<std::uint32_t>(rng() % 16);  // entry 7 empty
  }
  // Entries in a scrambled order, so that "index" and "entry id" differ.
  std::vector<std::uint32_t> ids(blocks);
  std::iota(ids.begin(), ids.end(), 0u);
  std::shuffle(ids.begin(), ids.end(), rng);
  for (const float factor : {1.0f, 2.5f, 4.0f}) {
    CAPTURE(factor);
    C c(l, blocks, cascade_params{factor});
    for (std::uint32_t b = 0; b < blocks; ++b) {
      c.update(b, pool.slot_data(b), 0, fill[b]);
    }
    for (const std::uint32_t n : {1u, 16u}) {
      const std::vector<float> q = random_rows(n, l.head_dim, 30 + n);
      for (const std::uint32_t keep : {0u, 1u, 3u, 7u, 20u}) {
        for (const float scale : {0.0f, 0.125f}) {
          for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
            CAPTURE(n);
            CAPTURE(keep);
            CAPTURE(scale);
            std::vector<float> out(std::size_t{blocks} * n);
            c.score_two_stage(h, ids, q.data(), n, scale, keep, out.data());
            // The model: each entry's bound alone, the top `want` (ties to the earlier index).
            const auto want = static_cast<std::uint32_t>(
                std::min<double>(blocks, std::ceil(double{factor} * keep)));
            CHECK(c.contenders(blocks, keep) == want);
            const std::vector<bool> contender =
                testing::top_bound_contenders(c.coarse(), h, ids, q, n, want);
            for (std::uint32_t i = 0; i < blocks; ++i) {
              CAPTURE(i);
              for (std::uint32_t r = 0; r < n; ++r) {
                const float got = out[std::size_t{i} * n + r];
                const double expect =
                    contender[i] ? fine_model(c, h, ids[i], fill[ids[i]],
                                              q.data() + std::size_t{r} * l.head_dim, scale)
                                 : -std::numeric_limits<double>::infinity();
                if (std::isinf(expect)) {
                  CHECK(got == static_cast<float>(expect));
                } else {
                  CHECK(got == doctest::Approx(expect).epsilon(1e-5));
                }
              }
            }
          }
        }
      }
    }
  }
}

TEST_CASE("lookahead_predictor over the cascade selects what int4 keys select when all contend") {
  const kv_layout l{1, 8, 2, 64, 16, dtype::f16};
  constexpr std::uint32_t blocks = 48;
  host_tier pool(l, blocks);
  testing::fill_random(pool, 3);
  qminmax_int4_cascade c(l, blocks, cascade_params{1000.0f});
  int4_key_summary f(l, blocks);
  for (std::uint32_t b = 0; b < blocks; ++b) {
    c.update(b, pool.slot_data(b), 0, 16);
    f.update(b, pool.slot_data(b), 0, 16);
  }
  std::vector<std::uint32_t> ids(blocks);
  std::iota(ids.rbegin(), ids.rend(), 0u);
  const std::uint32_t seq_len = blocks * 16 - 5;
  const std::vector<float> q = random_rows(4 * l.num_q_heads, l.head_dim, 8);
  const query_view qv{q.data(), nullptr, 4};
  const prediction_input<qminmax_int4_cascade> ic{l, seq_len, &c, ids, qv, {}, {}};
  const prediction_input<int4_key_summary> iff{l, seq_len, &f, ids, qv, {}, {}};
  for (const std::uint32_t budget : {2u, 5u, 12u, 47u}) {
    CAPTURE(budget);
    const selection_params sp{budget, 1, 1};
    selection a, b;
    lookahead_predictor<qminmax_int4_cascade>{}.select(ic, sp, a);
    lookahead_predictor<int4_key_summary>{}.select(iff, sp, b);
    CHECK(a.blocks == b.blocks);
    CHECK(a.offsets == b.offsets);
    CHECK(a.blocks.size() == budget);
    lookahead_predictor<qminmax_int4_cascade, max_aggregation, per_kv_head_selection>{}.select(
        ic, sp, a);
    lookahead_predictor<int4_key_summary, max_aggregation, per_kv_head_selection>{}.select(iff, sp,
                                                                                           b);
    CHECK(a.blocks == b.blocks);
    CHECK(a.offsets == b.offsets);
  }
}

TEST_CASE("cascade_summary: a flat high-mass block loses to spiky bounds at a small factor") {
  // One KV head, one query row, logit of a key = 4 k[0] / sqrt(16) = k[0] (scaled). Blocks 1-3
  // each hold one spike (k[0] = 3) in otherwise cold tokens: the highest max, mass e^3 + 15
  // e^-3 = 20.8 each. Block 4 holds 16 warm tokens (k[0] = 2): a lower max, but mass 16 e^2 =
  // 118. int4 keys alone keep block 4 for the one free block. The coarse bounds rank the spikes
  // above it, so with 3 contenders (factor 1, budget 3) block 4 is ruled out and a spike block
  // is kept; 6 contenders (factor 2) let the fine stage see it again.
  const kv_layout l{1, 1, 1, 16, 16, dtype::f32};
  constexpr std::uint32_t blocks = 10;
  host_tier pool(l, blocks);
  std::memset(pool.slot_data(0), 0, l.block_bytes() * blocks);
  std::vector<float> q(16, 0.0f);
  q[0] = 4.0f;
  std::vector<float> k(16, 0.0f);
  for (std::uint32_t b = 0; b < blocks; ++b) {
    for (std::uint32_t t = 0; t < 16; ++t) {
      k[0] = b >= 1 && b <= 3 ? (t == 0 ? 3.0f : -3.0f) : (b == 4 ? 2.0f : -3.0f);
      set_key(pool, b, 0, t, k.data());
    }
  }
  std::vector<std::uint32_t> ids(blocks);
  std::iota(ids.begin(), ids.end(), 0u);
  const selection_params sp{3, 1, 1};  // sink block 0, recent block 9, one free block
  auto run = [&](float factor) {
    qminmax_int4_cascade c(l, blocks, cascade_params{factor});
    for (std::uint32_t b = 0; b < blocks; ++b) {
      c.update(b, pool.slot_data(b), 0, 16);
    }
    const prediction_input<qminmax_int4_cascade> in{
        l, blocks * 16, &c, ids, query_view{q.data(), nullptr, 1}, {}, {}};
    selection s;
    lookahead_predictor<qminmax_int4_cascade>{}.select(in, sp, s);
    return s.blocks;
  };
  int4_key_summary f(l, blocks);
  for (std::uint32_t b = 0; b < blocks; ++b) {
    f.update(b, pool.slot_data(b), 0, 16);
  }
  selection alone;
  lookahead_predictor<int4_key_summary>{}.select(
      prediction_input<int4_key_summary>{
          l, blocks * 16, &f, ids, query_view{q.data(), nullptr, 1}, {}, {}},
      sp, alone);
  CHECK(alone.blocks == std::vector<std::uint32_t>{0, 4, 9});
  CHECK(run(1.0f) == std::vector<std::uint32_t>{0, 1, 9});  // the spikes tie: the first wins
  CHECK(run(2.0f) == std::vector<std::uint32_t>{0, 4, 9});
}

TEST_CASE("cascade_summary: hooks reach both parts; memory is the sum") {
  const kv_layout l{1, 4, 2, 64, 16, dtype::f16};
  host_tier pool(l, 4);
  testing::fill_random(pool, 2);
  qminmax_int4_cascade c(l, 4, cascade_params{1.0f});
  CHECK(c.bytes_per_block() == quantized_minmax_summary(l, 4).bytes_per_block() +
                                   int4_key_summary(l, 4).bytes_per_block());
  for (std::uint32_t b = 0; b < 4; ++b) {
    c.update(b, pool.slot_data(b), 0, 16);
  }
  CHECK(c.coarse().tokens(2) == 16);
  CHECK(c.fine().tokens(2) == 16);
  c.reset(2);
  CHECK(c.coarse().tokens(2) == 0);
  CHECK(c.fine().tokens(2) == 0);
  c.grow(40);
  CHECK(c.capacity() == 40);
  CHECK(c.coarse().capacity() == 40);
  CHECK(c.fine().capacity() == 40);
  CHECK(c.fine().tokens(3) == 16);  // kept across the growth
  expect_error([&] { c.grow(8); }, errc::invalid_argument, "8");
  // An empty entry (2) scores -inf in both stages; the others keep their fine scores.
  const std::vector<float> q = random_rows(1, l.head_dim, 4);
  const std::vector<std::uint32_t> ids{0, 1, 2, 3};
  std::vector<float> two(4), fine(4);
  c.score_two_stage(0, ids, q.data(), 1, 0.0f, 4, two.data());
  c.fine().score(0, ids, q.data(), 1, fine.data());
  CHECK(two == fine);
  CHECK(std::isinf(two[2]));
  CHECK(two[2] < 0.0f);
}

TEST_CASE("cascade_summary: bad input names the value") {
  const kv_layout l{1, 4, 2, 64, 16, dtype::f16};
  for (const float bad : {0.0f, 0.5f, -2.0f}) {
    expect_error([&] { qminmax_int4_cascade(l, 4, cascade_params{bad}); }, errc::invalid_argument,
                 "contender_factor = ");
  }
  expect_error([&] { qminmax_int4_cascade(l, 4, cascade_params{0.5f}); }, errc::invalid_argument,
               "0.5");
  expect_error(
      [&] { qminmax_int4_cascade(l, 4, cascade_params{std::numeric_limits<float>::quiet_NaN()}); },
      errc::invalid_argument, "nan");
  expect_error(
      [&] { qminmax_int4_cascade(l, 4, cascade_params{std::numeric_limits<float>::infinity()}); },
      errc::invalid_argument, "inf");
  expect_error(
      [&] { qminmax_int4_cascade(quantized_minmax_summary(l, 4), int4_key_summary(l, 5)); },
      errc::invalid_argument, "coarse capacity 4 != fine capacity 5");
  const kv_layout other{1, 4, 2, 32, 16, dtype::f16};
  expect_error(
      [&] { qminmax_int4_cascade(quantized_minmax_summary(l, 4), int4_key_summary(other, 4)); },
      errc::invalid_argument, "head_dim 64");
  expect_error(
      [&] { qminmax_int4_cascade(quantized_minmax_summary(l, 4), int4_key_summary(other, 4)); },
      errc::invalid_argument, "head_dim 32");
  qminmax_int4_cascade c(quantized_minmax_summary(l, 4), int4_key_summary(l, 4),
                         cascade_params{2.0f});
  CHECK(c.params().contender_factor == 2.0f);
  const std::vector<float> q(64, 1.0f);
  const std::vector<std::uint32_t> ids{0, 1};
  std::vector<float> out(2);
  expect_error([&] { c.score_two_stage(0, ids, q.data(), 1, -1.0f, 1, out.data()); },
               errc::invalid_argument, "scale = -1");
  expect_error(
      [&] {
        c.score_two_stage(0, ids, q.data(), 1, std::numeric_limits<float>::quiet_NaN(), 1,
                          out.data());
      },
      errc::invalid_argument, "scale = nan");
  const std::vector<std::uint32_t> far{0, 9};
  expect_error([&] { c.score_two_stage(0, far, q.data(), 1, 0.0f, 1, out.data()); },
               errc::out_of_range, "9");
  expect_error([&] { c.score_two_stage(5, ids, q.data(), 1, 0.0f, 1, out.data()); },
               errc::out_of_range, "5");
}

TEST_CASE("softmax mass gives ruled-out (-inf) blocks exactly zero mass, never subnormal") {
  // Most blocks of a two-stage score are -inf: their share of each row must be an exact 0 (a
  // subnormal would cost a microcode assist per block in the sums), the others' shares sum to
  // the number of rows.
  constexpr std::uint32_t blocks = 100, rows = 3;
  std::vector<float> raw(std::size_t{rows} * blocks, -std::numeric_limits<float>::infinity());
  for (std::uint32_t r = 0; r < rows; ++r) {
    raw[std::size_t{r} * blocks + 7] = 1.0f;
    raw[std::size_t{r} * blocks + 50 + r] = 2.0f;
    raw[std::size_t{r} * blocks + 90] = -60.0f;  // exp(-62 / 8): small, normal
  }
  const aggregation_context ctx{blocks, rows, 1, 0.125f, nullptr};
  softmax_mass_aggregation agg;
  std::vector<float> acc(blocks);
  agg.combine(ctx, raw.data(), acc.data(), true);
  double total = 0.0;
  for (std::uint32_t b = 0; b < blocks; ++b) {
    CAPTURE(b);
    CHECK(std::fpclassify(acc[b]) != FP_SUBNORMAL);
    const bool scored = b == 7 || b == 90 || (b >= 50 && b < 50 + rows);
    if (scored) {
      CHECK(acc[b] > 0.0f);
    } else {
      CHECK(acc[b] == 0.0f);
    }
    total += acc[b];
  }
  CHECK(total == doctest::Approx(rows).epsilon(1e-5));
}
