// SPDX-License-Identifier: Apache-2.0
// qminmax_int2_summary: 2-bit codes between int8 bounds against a model written from the keys
// (each element within half a code step, inside the bounds), scores and block log-mass against
// the dequantized keys on every scoring path, exact scores for a block still filling, appends
// equal to a bulk update, the two-stage contenders against a brute-force model, re-coding when
// a full entry's bounds widen, its memory, and bad input.
#include <doctest/doctest.h>

#include "support/expect_error.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "oasiskv/oasiskv.hpp"
#include "oasiskv/summary/qminmax_int2_summary.hpp"
#include "support/kv_fixture.hpp"
#include "support/summary_inputs.hpp"

using namespace oasiskv;

namespace {

using oasiskv::testing::expect_error;
using oasiskv::testing::random_rows;
using oasiskv::testing::set_key;

static_assert(block_summary<qminmax_int2_summary> && two_stage_summary<qminmax_int2_summary> &&
              log_mass_summary<qminmax_int2_summary> && growable_summary<qminmax_int2_summary>);

constexpr float inf = std::numeric_limits<float>::infinity();

// Token t's key of KV head h in slot s, as f32.
std::vector<float> key_of(host_tier& pool, slot_id s, std::uint32_t h, std::uint32_t t) {
  const kv_layout& l = pool.layout();
  std::vector<float> k(l.head_dim);
  visit_dtype(l.kv_dtype, [&](auto elem) {
    using T = decltype(elem);
    const T* p = reinterpret_cast<const T*>(pool.slot_data(s) + l.key_offset(h)) +
                 std::size_t{t} * l.head_dim;
    for (std::uint32_t x = 0; x < l.head_dim; ++x) {
      k[x] = to_float(p[x]);
    }
  });
  return k;
}

// max or scaled log-sum-exp over `keys` of their dot products with q, in double.
double model(const std::vector<std::vector<float>>& keys, const float* q, float scale) {
  if (keys.empty()) {
    return -std::numeric_limits<double>::infinity();
  }
  std::vector<double> logits;
  for (const auto& k : keys) {
    double a = 0.0;
    for (std::size_t x = 0; x < k.size(); ++x) {
      a += double{q[x]} * k[x];
    }
    logits.push_back(a);
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

double max_abs(const float* v, std::uint32_t count) {
  double m = 0.0;
  for (std::uint32_t i = 0; i < count; ++i) {
    m = std::max(m, std::abs(double{v[i]}));
  }
  return m;
}

std::vector<cpu_isa> paths() {
  std::vector<cpu_isa> p{cpu_isa::scalar};
  if (detected_cpu_features().avx512) {
    p.push_back(cpu_isa::avx512);
  }
  return p;
}

}  // namespace

TEST_CASE("qminmax_int2_summary: under 10% of the KV bytes at 16-token blocks, head_dim 64") {
  const kv_layout l{30, 9, 3, 64, 16, dtype::f16};
  const qminmax_int2_summary s(l, 8);
  const std::size_t bounds = quantized_minmax_summary(l, 8).bytes_per_block();
  CHECK(bounds == 3 * (2 * 64 + 8) + 6);  // codes, scale, norm a head; bias, token count
  CHECK(s.bytes_per_block() == bounds + 3 * 64 * 16 / 4 + 3);
  const double kv = 2.0 * l.num_kv_heads * l.tokens_per_block * l.head_dim * 2;  // K + V, f16
  CHECK(s.bytes_per_block() / kv < 0.10);
  CHECK(s.bytes_per_block() / kv > 0.09);
  // An odd block size rounds the codes up to 16 tokens.
  const kv_layout odd{1, 2, 1, 64, 20, dtype::f16};
  CHECK(qminmax_int2_summary(odd, 4).bytes_per_block() ==
        quantized_minmax_summary(odd, 4).bytes_per_block() + 64 * 32 / 4 + 3);
}

TEST_CASE("qminmax_int2_summary: every coded element lies within half a code step of its key") {
  for (const dtype dt : {dtype::f16, dtype::bf16, dtype::f32}) {
    for (const std::uint32_t tpb : {16u, 20u}) {
      CAPTURE(to_string(dt));
      CAPTURE(tpb);
      const kv_layout l{1, 4, 2, 64, tpb, dt};
      host_tier pool(l, 6);
      testing::fill_random(pool, 3 + tpb);
      qminmax_int2_summary s(l, 6);
      for (std::uint32_t b = 0; b < 6; ++b) {
        s.update(b, pool.slot_data(b), 0, tpb);
        CHECK(s.coded(b));
        for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
          std::vector<float> hi(l.head_dim), lo(l.head_dim);
          s.bounds().bounds(h, b, hi.data(), lo.data());
          std::vector<float> kmax(l.head_dim, -inf), kmin(l.head_dim, inf);
          for (std::uint32_t t = 0; t < tpb; ++t) {
            const auto k = key_of(pool, b, h, t);
            for (std::uint32_t x = 0; x < l.head_dim; ++x) {
              kmax[x] = std::max(kmax[x], k[x]);
              kmin[x] = std::min(kmin[x], k[x]);
            }
          }
          for (std::uint32_t x = 0; x < l.head_dim; ++x) {
            REQUIRE(lo[x] <= kmin[x]);
            REQUIRE(hi[x] >= kmax[x]);
          }
          for (std::uint32_t t = 0; t < tpb; ++t) {
            const auto k = key_of(pool, b, h, t);
            const auto kq = s.dequantized(h, b, t);
            for (std::uint32_t x = 0; x < l.head_dim; ++x) {
              const float half = (hi[x] - lo[x]) / 6.0f;
              CHECK(kq[x] >= lo[x]);
              CHECK(kq[x] <= hi[x] * (1.0f + 1e-6f) + 1e-6f);
              CHECK(std::abs(kq[x] - k[x]) <= half * (1.0f + 1e-5f) + 1e-6f);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("qminmax_int2_summary: scores and log-mass of the dequantized keys on every path") {
  // 12- and 16-token blocks: one group of codes per dimension (12: its lanes partly used); 20:
  // two (the second partly used).
  for (const std::uint32_t full : {12u, 16u, 20u}) {
    const kv_layout l{1, 8, 2, 64, full, dtype::f16};
    constexpr std::uint32_t blocks = 12;
    host_tier pool(l, blocks);
    testing::fill_random(pool, 21);
    // Full blocks (coded), partly filled ones (scored from their keys) and an empty one.
    const std::uint32_t f = full;
    const std::vector<std::uint32_t> fill{f, f, 5, f, 0, 1, f, f - 1, f, f, 9, f};
    for (const cpu_isa isa : paths()) {
      CAPTURE(full);
      CAPTURE(to_string(isa));
      qminmax_int2_summary s(l, blocks, {}, isa);
      for (std::uint32_t b = 0; b < blocks; ++b) {
        s.update(b, pool.slot_data(b), 0, fill[b]);
        CHECK(s.tokens(b) == fill[b]);
      }
      const bool integer =
          isa == cpu_isa::avx512 && detected_cpu_features().avx512_vnni && full <= 16;
      std::vector<std::uint32_t> ids(blocks);
      std::iota(ids.begin(), ids.end(), 0u);
      std::reverse(ids.begin(), ids.end());
      for (const std::uint32_t n : {1u, 3u, 12u, 13u, 16u, 17u}) {
        const auto q = random_rows(n, l.head_dim, 40 + n);
        for (const float scale : {0.0f, 0.125f}) {
          for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
            CAPTURE(n);
            CAPTURE(scale);
            std::vector<float> out(std::size_t{blocks} * n);
            if (scale == 0.0f) {
              s.score(h, ids, q.data(), n, out.data());
            } else {
              s.score_log_mass(h, ids, q.data(), n, scale, out.data());
            }
            for (std::size_t i = 0; i < ids.size(); ++i) {
              const std::uint32_t b = ids[i];
              CAPTURE(b);
              // Coded blocks: the dequantized keys; blocks still filling: the keys themselves.
              std::vector<std::vector<float>> keys;
              for (std::uint32_t t = 0; t < fill[b]; ++t) {
                keys.push_back(fill[b] == full ? s.dequantized(h, b, t) : key_of(pool, b, h, t));
                if (fill[b] < full) {
                  CHECK(s.dequantized(h, b, t) == keys.back());
                }
              }
              for (std::uint32_t r = 0; r < n; ++r) {
                const float* qr = q.data() + std::size_t{r} * l.head_dim;
                const double expect = model(keys, qr, scale);
                const float got = out[i * n + r];
                if (std::isinf(expect)) {
                  CHECK(got == static_cast<float>(expect));
                } else {
                  REQUIRE(std::isfinite(got));
                  // The integer kernel (coded entries of one code group, AVX-512 VNNI) rounds
                  // the row to alpha Q, alpha = max |q| / limit, and each code's offset from the
                  // lower bound to whole int8 steps of the bounds' scale s (off by at most s /
                  // 3): each dot product moves by at most alpha / 2 sum |k'| + s / 3 (sum |q| +
                  // d alpha / 2), and so does a log-sum-exp of them.
                  double slack = 0.0;
                  if (integer && fill[b] == full) {
                    const double alpha =
                        max_abs(qr, l.head_dim) / cpu::detail::int2_query_limit(l.head_dim);
                    std::vector<std::uint32_t> bw(l.head_dim / 2);
                    const double bs = s.bounds().bound_words(h, b, bw.data());
                    double qsum = 0.0;
                    for (std::uint32_t x = 0; x < l.head_dim; ++x) {
                      qsum += std::abs(double{qr[x]});
                    }
                    for (const auto& k : keys) {
                      double sum = 0.0;
                      for (const float v : k) {
                        sum += std::abs(double{v});
                      }
                      slack = std::max(
                          slack, (alpha / 2 * sum + bs / 3 * (qsum + l.head_dim * alpha / 2)) *
                                     (1.0 + 1e-3));
                    }
                  }
                  CHECK(std::abs(got - expect) <= 1e-5 * std::max(1.0, std::abs(expect)) + slack);
                }
              }
            }
          }
        }
      }
    }
  }
}

TEST_CASE("qminmax_int2_summary: one-token appends code a block as one bulk update does") {
  const kv_layout l{1, 4, 2, 64, 16, dtype::f16};
  host_tier pool(l, 2);
  testing::fill_random(pool, 8);
  qminmax_int2_summary bulk(l, 1), step(l, 1);
  bulk.update(0, pool.slot_data(0), 0, 16);
  for (std::uint32_t t = 0; t < 16; ++t) {
    CHECK_FALSE(step.coded(0));
    step.update(0, pool.slot_data(0), t, 1);
  }
  // Out of order and in pieces too.
  qminmax_int2_summary pieces(l, 1);
  pieces.update(0, pool.slot_data(0), 9, 7);
  pieces.update(0, pool.slot_data(0), 0, 4);
  pieces.update(0, pool.slot_data(0), 2, 5);  // tokens 2, 3 again
  CHECK(pieces.tokens(0) == 7 + 4 + 3);
  pieces.update(0, pool.slot_data(0), 7, 2);
  for (const qminmax_int2_summary* s : {&step, &pieces}) {
    REQUIRE(s->coded(0));
    CHECK(s->tokens(0) == 16);
    for (std::uint32_t h = 0; h < 2; ++h) {
      for (std::uint32_t t = 0; t < 16; ++t) {
        CHECK(s->dequantized(h, 0, t) == bulk.dequantized(h, 0, t));
      }
    }
  }
}

TEST_CASE("qminmax_int2_summary: two-stage scores for the top bounds, -inf for the rest") {
  const kv_layout l{1, 8, 2, 64, 16, dtype::f16};
  constexpr std::uint32_t blocks = 40;
  host_tier pool(l, blocks);
  testing::fill_random(pool, 13);
  std::mt19937 rng(6);
  std::vector<std::uint32_t> fill(blocks);
  for (std::uint32_t b = 0; b < blocks; ++b) {
    fill[b] = b == 5 ? 0 : (rng() % 3 == 0 ? 1 + static_cast<std::uint32_t>(rng() % 15) : 16);
  }
  std::vector<std::uint32_t> ids(blocks);
  std::iota(ids.begin(), ids.end(), 0u);
  std::shuffle(ids.begin(), ids.end(), rng);
  for (const float factor : {1.0f, 3.0f}) {
    qminmax_int2_summary s(l, blocks, cascade_params{factor});
    for (std::uint32_t b = 0; b < blocks; ++b) {
      s.update(b, pool.slot_data(b), 0, fill[b]);
    }
    for (const std::uint32_t n : {1u, 12u}) {
      const auto q = random_rows(n, l.head_dim, 70 + n);
      for (const std::uint32_t keep : {0u, 2u, 9u, 20u}) {
        for (const float scale : {0.0f, 0.125f}) {
          CAPTURE(factor);
          CAPTURE(n);
          CAPTURE(keep);
          CAPTURE(scale);
          const std::uint32_t h = 1;
          std::vector<float> out(std::size_t{blocks} * n);
          s.score_two_stage(h, ids, q.data(), n, scale, keep, out.data());
          const auto want = static_cast<std::uint32_t>(
              std::min<double>(blocks, std::ceil(double{factor} * keep)));
          CHECK(s.contenders(blocks, keep) == want);
          // The model: each entry's bound (the max over rows of the bounds' scores), the top
          // `want` (ties to the earlier index), scored alone.
          const std::vector<bool> contender =
              testing::top_bound_contenders(s.bounds(), h, ids, q, n, want);
          for (std::uint32_t i = 0; i < blocks; ++i) {
            std::vector<float> alone(n);
            if (scale == 0.0f) {
              s.score(h, std::span<const std::uint32_t>(&ids[i], 1), q.data(), n, alone.data());
            } else {
              s.score_log_mass(h, std::span<const std::uint32_t>(&ids[i], 1), q.data(), n, scale,
                               alone.data());
            }
            for (std::uint32_t r = 0; r < n; ++r) {
              CAPTURE(i);
              CHECK(out[std::size_t{i} * n + r] == (contender[i] ? alone[r] : -inf));
            }
          }
        }
      }
    }
  }
}

TEST_CASE("qminmax_int2_summary: a token folded into a full entry again re-codes what moved") {
  const kv_layout l{1, 2, 1, 64, 16, dtype::f32};
  host_tier pool(l, 1);
  testing::fill_random(pool, 30);
  qminmax_int2_summary s(l, 1);
  s.update(0, pool.slot_data(0), 0, 16);
  std::vector<std::vector<float>> before;
  for (std::uint32_t t = 0; t < 16; ++t) {
    before.push_back(s.dequantized(0, 0, t));
  }
  // Token 4's key grows tenfold: the bounds widen, token 4 is coded against them, the other
  // tokens keep their dequantized values up to half a step of the new bounds.
  std::vector<float> big = key_of(pool, 0, 0, 4);
  for (float& v : big) {
    v *= 10.0f;
  }
  set_key(pool, 0, 0, 4, big.data());
  s.update(0, pool.slot_data(0), 4, 1);
  CHECK(s.tokens(0) == 16);
  std::vector<float> hi(64), lo(64);
  s.bounds().bounds(0, 0, hi.data(), lo.data());
  for (std::uint32_t t = 0; t < 16; ++t) {
    const auto kq = s.dequantized(0, 0, t);
    const auto& want = t == 4 ? big : before[t];
    for (std::uint32_t x = 0; x < 64; ++x) {
      const float half = (hi[x] - lo[x]) / 6.0f;
      CHECK(kq[x] >= lo[x]);
      CHECK(kq[x] <= hi[x] * (1.0f + 1e-6f) + 1e-6f);
      CHECK(std::abs(kq[x] - want[x]) <= half * (1.0f + 1e-5f) + 1e-6f);
    }
  }
}

TEST_CASE("qminmax_int2_summary: non-finite keys, reset, growth and bad input") {
  const kv_layout l{1, 4, 2, 64, 16, dtype::f16};
  host_tier pool(l, 3);
  testing::fill_random(pool, 2);
  std::vector<float> k = key_of(pool, 1, 1, 3);
  k[7] = inf;
  set_key(pool, 1, 1, 3, k.data());
  qminmax_int2_summary s(l, 3, cascade_params{2.0f});
  CHECK(s.params().contender_factor == 2.0f);
  for (std::uint32_t b = 0; b < 3; ++b) {
    s.update(b, pool.slot_data(b), 0, 16);
  }
  const auto q = random_rows(2, 64, 9);
  const std::vector<std::uint32_t> ids{0, 1, 2};
  std::vector<float> out(6);
  s.score(0, ids, q.data(), 2, out.data());
  CHECK(std::isfinite(out[0]));
  CHECK(out[2] == inf);  // the entry holding the non-finite key, on every head
  CHECK(out[3] == inf);
  s.score_two_stage(0, ids, q.data(), 2, 0.125f, 1, out.data());
  CHECK(out[2] == inf);  // its bound is +inf too: always a contender
  s.reset(1);
  CHECK(s.tokens(1) == 0);
  s.score(0, ids, q.data(), 2, out.data());
  CHECK(out[2] == -inf);
  s.update(2, pool.slot_data(2), 0, 5);  // entry 2 again, partly: scored from keys
  const auto kept = s.dequantized(0, 0, 9);
  s.grow(40);
  CHECK(s.capacity() == 40);
  CHECK(s.bounds().capacity() == 40);
  CHECK(s.dequantized(0, 0, 9) == kept);
  CHECK(s.tokens(39) == 0);
  expect_error([&] { s.grow(8); }, errc::invalid_argument, "8");
  expect_error([&] { s.update(40, pool.slot_data(0), 0, 1); }, errc::out_of_range, "entry 40");
  expect_error([&] { s.update(0, pool.slot_data(0), 10, 7); }, errc::out_of_range, "17");
  expect_error([&] { s.update(0, nullptr, 0, 1); }, errc::invalid_argument, "null");
  expect_error([&] { s.score(2, ids, q.data(), 2, out.data()); }, errc::out_of_range, "kv head 2");
  const std::vector<std::uint32_t> far{41};
  expect_error([&] { s.score(0, far, q.data(), 2, out.data()); }, errc::out_of_range, "41");
  expect_error([&] { s.score_log_mass(0, ids, q.data(), 2, -1.0f, out.data()); },
               errc::invalid_argument, "scale = -1");
  expect_error([&] { s.score_two_stage(0, ids, q.data(), 2, std::nanf(""), 1, out.data()); },
               errc::invalid_argument, "nan");
  expect_error([&] { s.dequantized(0, 0, 16); }, errc::out_of_range, "token 16");
  expect_error([&] { qminmax_int2_summary(l, 0); }, errc::invalid_argument, "capacity is 0");
  for (const float bad : {0.0f, 0.5f, inf, std::nanf("")}) {
    expect_error([&] { qminmax_int2_summary(l, 4, cascade_params{bad}); }, errc::invalid_argument,
                 "contender_factor = ");
  }
}

TEST_CASE("qminmax_int2_summary: the block kernels against the portable one") {
  // Kernel level, so that each kernel runs on a CPU that has it: the f32 AVX-512 kernel (what
  // AVX-512 without VNNI scores with) against the portable one, and the integer VNNI kernel
  // against it within its query rounding, at head dims 64 and 128 (the int32 headroom).
  if (!detected_cpu_features().avx512) {
    MESSAGE("no AVX-512 on this CPU: only the portable kernel runs here");
    return;
  }
  std::mt19937 rng(5);
  std::uniform_int_distribution<std::uint32_t> word;
  std::uniform_int_distribution<int> code(-128, 127);
  for (const std::uint32_t d : {64u, 128u}) {
    for (const std::uint32_t tokens : {12u, 16u}) {
      // Bounds as int8 codes at a power-of-two scale, in the bound-word layout, and as floats.
      const float s = 0.0625f;
      std::vector<std::uint32_t> words(d), bound(d / 2);
      std::vector<float> lo(d), step(d);
      for (std::uint32_t p = 0; p < d / 2; ++p) {
        std::int8_t b[4];
        for (int j = 0; j < 2; ++j) {
          int h = code(rng), l = code(rng);
          if (h < l) {
            std::swap(h, l);
          }
          l = std::max(l, -127);  // -lo must fit in int8
          b[2 * j] = static_cast<std::int8_t>(h);
          b[2 * j + 1] = static_cast<std::int8_t>(-l);
          lo[2 * p + j] = static_cast<float>(l) * s;
          step[2 * p + j] = h > l ? static_cast<float>(h - l) * s / 3.0f : 0.0f;
        }
        std::memcpy(&bound[p], b, 4);
      }
      for (auto& w : words) {
        w = word(rng);
      }
      for (const std::uint32_t n : {1u, 5u, 12u, 13u, 16u, 17u, 33u}) {
        const auto q = random_rows(n, d, 7 + n + d);
        for (const float scale : {0.0f, 0.125f}) {
          CAPTURE(d);
          CAPTURE(tokens);
          CAPTURE(n);
          CAPTURE(scale);
          std::vector<float> want(n), f32(n), integer(n), dots(std::size_t{n} * 16);
          cpu::detail::int2_score_entry(cpu_isa::scalar, words.data(), 1, lo.data(), step.data(), d,
                                        tokens, q.data(), n, scale, dots.data(), want.data());
          cpu::detail::int2_score_entry(cpu_isa::avx512, words.data(), 1, lo.data(), step.data(), d,
                                        tokens, q.data(), n, scale, dots.data(), f32.data());
          for (std::uint32_t r = 0; r < n; ++r) {
            CHECK(std::abs(f32[r] - want[r]) <= 1e-5f * std::max(1.0f, std::abs(want[r])));
          }
          if (!detected_cpu_features().avx512_vnni) {
            continue;
          }
          cpu::detail::int2_query z;
          REQUIRE(cpu::detail::int2_quantize_query(q.data(), n, d, z));
          cpu::detail::int2_block_rows_avx512_vnni(words.data(), bound.data(), s, tokens, z, scale,
                                                   integer.data());
          for (std::uint32_t r = 0; r < n; ++r) {
            const float* qr = q.data() + std::size_t{r} * d;
            double keys_abs = 0.0;  // the largest sum |k'| over the live tokens
            for (std::uint32_t t = 0; t < tokens; ++t) {
              double sum = 0.0;
              for (std::uint32_t x = 0; x < d; ++x) {
                sum += std::abs(cpu::detail::int2_value(
                    lo[x], step[x], cpu::detail::int2_code(words.data(), 1, x, t)));
              }
              keys_abs = std::max(keys_abs, sum * (1.0 + 1e-3));
            }
            const double alpha = max_abs(qr, d) / cpu::detail::int2_query_limit(d);
            double qsum = 0.0;
            for (std::uint32_t x = 0; x < d; ++x) {
              qsum += std::abs(double{qr[x]});
            }
            // The row's rounding, and each code's offset rounded to whole int8 steps (s / 3).
            const double slack =
                (alpha / 2 * keys_abs + s / 3.0 * (qsum + d * alpha / 2)) * (1.0 + 1e-3);
            CHECK(std::abs(integer[r] - want[r]) <=
                  1e-5 * std::max(1.0, std::abs(double{want[r]})) + slack);
          }
        }
      }
    }
  }
  // A row with a non-finite value is not quantized: the caller scores it in f32.
  cpu::detail::int2_query z;
  std::vector<float> bad(64, 1.0f);
  bad[9] = std::numeric_limits<float>::quiet_NaN();
  CHECK_FALSE(cpu::detail::int2_quantize_query(bad.data(), 1, 64, z));
}
