// SPDX-License-Identifier: Apache-2.0
// quantized_key_summary<Bits>: exact scores in the quantized domain, the exact block log-mass,
// incremental updates equal to a one-shot build, and what mass aggregation does with it.
#include <doctest/doctest.h>

#include "support/expect_error.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "oasiskv/concepts/block_summary.hpp"
#include "oasiskv/oasiskv.hpp"
#include "oasiskv/predictor/lookahead_predictor.hpp"
#include "oasiskv/summary/quantized_key_summary.hpp"
#include "support/kv_fixture.hpp"
#include "support/paths.hpp"
#include "support/summary_inputs.hpp"

using namespace oasiskv;

namespace {

using oasiskv::testing::expect_error;
using oasiskv::testing::random_rows;
using oasiskv::testing::set_key;

static_assert(block_summary<int8_key_summary> && block_summary<int4_key_summary>);
static_assert(log_mass_summary<int8_key_summary> && log_mass_summary<int4_key_summary>);
static_assert(mass_aggregation<softmax_mass_aggregation> &&
              mass_aggregation<confidence_weighted_aggregation>);
static_assert(!mass_aggregation<max_aggregation>);

using oasiskv::testing::key_of;

// The summary's quantization, written out independently (in f32, as specified): scale
// max|k| / (2^(bits-1) - 1), codes round(k / scale), dequantized code * scale.
std::vector<float> dequantize(const std::vector<float>& k, int bits, float* scale_out = nullptr) {
  const float top = bits == 8 ? 127.0f : 7.0f;
  float mag = 0.0f;
  for (float v : k) {
    mag = std::max(mag, std::abs(v));
  }
  const float s = mag / top;
  std::vector<float> out(k.size(), 0.0f);
  for (std::size_t x = 0; x < k.size() && s > 0.0f; ++x) {
    const float c = std::nearbyint(k[x] / s);
    CHECK(std::abs(c) <= top);
    out[x] = c * s;
  }
  if (scale_out != nullptr) {
    *scale_out = s;
  }
  return out;
}

double dot(const float* q, const std::vector<float>& k) {
  double a = 0.0;
  for (std::size_t x = 0; x < k.size(); ++x) {
    a += double{q[x]} * k[x];
  }
  return a;
}

template <class S>
std::vector<float> scores(const S& s, std::uint32_t h, const std::vector<std::uint32_t>& ids,
                          const std::vector<float>& q, std::uint32_t n, float scale = 0.0f) {
  std::vector<float> out(ids.size() * n);
  if (scale == 0.0f) {
    s.score(h, ids, q.data(), n, out.data());
  } else {
    s.score_log_mass(h, ids, q.data(), n, scale, out.data());
  }
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE_TEMPLATE("quantized_key_summary: exact max and log-mass over the dequantized keys", S,
                   int8_key_summary, int4_key_summary) {
  // tokens_per_block 24 pads to 32 lanes; 40 rows cover the 4-row kernel and its remainders.
  for (const dtype dt : {dtype::f32, dtype::f16, dtype::bf16}) {
    CAPTURE(to_string(dt));
    const kv_layout l{1, 8, 2, 40, 24, dt};
    host_tier pool(l, 3);
    testing::fill_random(pool, 7);
    const std::uint32_t fill[3] = {24, 5, 17};
    for (const cpu_isa isa : {cpu_isa::scalar, cpu_isa::avx2, cpu_isa::avx512}) {
      if (!isa_supported(isa)) {
        continue;
      }
      oasiskv::testing::note_path("score kernels: " + std::string(to_string(isa)));
      CAPTURE(to_string(isa));
      S s(l, 3, isa);
      for (std::uint32_t b = 0; b < 3; ++b) {
        s.update(b, pool.slot_data(b), 0, fill[b]);
        CHECK(s.tokens(b) == fill[b]);
      }
      const std::vector<std::uint32_t> ids{1, 2, 0, 2};
      for (const std::uint32_t n : {1u, 3u, 4u, 7u, 13u}) {
        const std::vector<float> q = random_rows(n, l.head_dim, n + 100);
        const float scale = 1.0f / std::sqrt(40.0f);
        for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
          const auto got = scores(s, h, ids, q, n);
          const auto lse = scores(s, h, ids, q, n, scale);
          for (std::size_t i = 0; i < ids.size(); ++i) {
            const std::uint32_t b = ids[i];
            for (std::uint32_t r = 0; r < n; ++r) {
              const float* qr = q.data() + std::size_t{r} * l.head_dim;
              double want = -1e300, exact = -1e300, bound = 0.0, sum = 0.0, qnorm1 = 0.0;
              for (std::uint32_t x = 0; x < l.head_dim; ++x) {
                qnorm1 += std::abs(double{qr[x]});
              }
              std::vector<double> logits;
              for (std::uint32_t t = 0; t < fill[b]; ++t) {
                const std::vector<float> k = key_of(pool, b, h, t);
                float sc = 0.0f;
                const std::vector<float> kq = dequantize(k, S::bits, &sc);
                CHECK(s.dequantized(h, b, t) == kq);
                want = std::max(want, dot(qr, kq));
                exact = std::max(exact, dot(qr, k));
                // |q.k - q.k'| <= ||q||_1 * scale / 2: each element is off by half a step.
                bound = std::max(bound, qnorm1 * sc * 0.5);
                logits.push_back(dot(qr, kq));
              }
              for (const double v : logits) {
                sum += std::exp(scale * (v - want));
              }
              const double want_lse = want + std::log(sum) / scale;
              const float v = got[i * n + r], m = lse[i * n + r];
              CHECK(v == doctest::Approx(want).epsilon(1e-5));
              CHECK(std::abs(double{v} - exact) <= bound * (1 + 1e-5) + 1e-5);
              CHECK(m == doctest::Approx(want_lse).epsilon(1e-5));
              CHECK(m >= v - 1e-5f);  // a soft maximum: at least the maximum ...
              CHECK(m <= v + std::log(double(fill[b])) / scale + 1e-4);  // ... and at most this
            }
          }
        }
      }
    }
  }
}

TEST_CASE_TEMPLATE("quantized_key_summary: any order of updates gives the one-shot entry", S,
                   int8_key_summary, int4_key_summary) {
  const kv_layout l{1, 4, 2, 64, 16, dtype::f16};
  host_tier pool(l, 2);
  testing::fill_random(pool, 21);
  // Growing magnitudes: each new token is larger than every earlier one, the case that would
  // force a per-block scale to requantize the tokens already stored.
  for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
    for (std::uint32_t t = 0; t < 16; ++t) {
      std::vector<float> k = key_of(pool, 1, h, t);
      for (float& x : k) {
        x *= static_cast<float>(1u << (t / 2));
      }
      set_key(pool, 1, h, t, k.data());
    }
  }
  const std::vector<float> q = random_rows(6, l.head_dim, 5);
  const std::vector<std::uint32_t> ids{0, 1};
  const float scale = 0.125f;
  for (const std::uint32_t fill : {16u, 11u, 1u}) {  // full, partial, one token
    CAPTURE(fill);
    S bulk(l, 2);
    for (std::uint32_t b = 0; b < 2; ++b) {
      bulk.update(b, pool.slot_data(b), 0, fill);
    }
    auto check_same = [&](const S& s) {
      for (std::uint32_t b = 0; b < 2; ++b) {
        CHECK(s.tokens(b) == fill);
      }
      for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
        CHECK(same_bits(scores(s, h, ids, q, 6), scores(bulk, h, ids, q, 6)));
        CHECK(same_bits(scores(s, h, ids, q, 6, scale), scores(bulk, h, ids, q, 6, scale)));
      }
    };
    {  // one token at a time
      S s(l, 2);
      for (std::uint32_t b = 0; b < 2; ++b) {
        for (std::uint32_t t = 0; t < fill; ++t) {
          s.update(b, pool.slot_data(b), t, 1);
        }
      }
      check_same(s);
    }
    {  // backwards, in uneven chunks, each token folded in twice
      S s(l, 2);
      for (std::uint32_t b = 0; b < 2; ++b) {
        for (std::uint32_t end = fill; end > 0;) {
          const std::uint32_t first = end > 3 ? end - 3 : 0;
          s.update(b, pool.slot_data(b), first, end - first);
          s.update(b, pool.slot_data(b), first, end - first);
          end = first;
        }
      }
      check_same(s);
    }
    {  // a slot holding only the tokens being appended (the rest zero): appends read no other
      S s(l, 2);
      host_tier sparse(l, 1);
      for (std::uint32_t b = 0; b < 2; ++b) {
        std::memset(sparse.slot_data(0), 0, l.block_bytes());
        for (std::uint32_t t = 0; t < fill; ++t) {
          for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
            set_key(sparse, 0, h, t, key_of(pool, b, h, t).data());
          }
          s.update(b, sparse.slot_data(0), t, 1);
          if (t + 1 < fill) {  // then clear it: the next append must not need it
            std::memset(sparse.slot_data(0), 0, l.block_bytes());
          }
        }
      }
      check_same(s);
    }
  }
  {  // updating a token again replaces it; reset then refill is the one-shot entry
    S s(l, 2), want(l, 2);
    s.update(0, pool.slot_data(1), 0, 16);  // other keys first
    s.update(0, pool.slot_data(0), 0, 16);
    want.update(0, pool.slot_data(0), 0, 16);
    CHECK(s.tokens(0) == 16);
    CHECK(same_bits(scores(s, 1, {0}, q, 6), scores(want, 1, {0}, q, 6)));
    s.reset(0);
    CHECK(s.tokens(0) == 0);
    s.update(0, pool.slot_data(0), 0, 16);
    CHECK(same_bits(scores(s, 0, {0}, q, 6, scale), scores(want, 0, {0}, q, 6, scale)));
  }
}

TEST_CASE_TEMPLATE("quantized_key_summary: empty entries, zero and non-finite keys", S,
                   int8_key_summary, int4_key_summary) {
  const kv_layout l{1, 2, 1, 16, 8, dtype::f32};
  host_tier pool(l, 1);
  std::memset(pool.slot_data(0), 0, l.block_bytes());
  S s(l, 3);
  const std::vector<float> q = random_rows(2, 16, 3);
  constexpr float inf = std::numeric_limits<float>::infinity();
  s.update(1, pool.slot_data(0), 0, 4);  // all-zero keys: scale 0, every dot product 0
  for (const float v : scores(s, 0, {0, 1}, q, 2)) {
    CHECK((v == -inf || v == 0.0f));
  }
  const auto zero_lse = scores(s, 0, {0, 1}, q, 2, 0.5f);
  CHECK(zero_lse[0] == -inf);  // entry 0 is empty
  CHECK(zero_lse[2] == doctest::Approx(std::log(4.0) / 0.5));
  std::vector<float> k(16, 1.0f);
  k[3] = inf;
  set_key(pool, 0, 0, 2, k.data());
  k[3] = std::numeric_limits<float>::quiet_NaN();
  set_key(pool, 0, 0, 5, k.data());
  s.update(2, pool.slot_data(0), 2, 1);
  s.update(1, pool.slot_data(0), 5, 1);
  for (const float v : scores(s, 0, {1, 2}, q, 2)) {
    CHECK(v == inf);
  }
  for (const float v : scores(s, 0, {1, 2}, q, 2, 0.5f)) {
    CHECK(v == inf);
  }
  CHECK(s.tokens(1) == 5);
  CHECK(s.tokens(2) == 1);
  // Large finite keys stay finite: the largest element maps to the largest code exactly.
  std::vector<float> big(16, 3.0e38f);
  big[0] = -3.0e38f;
  set_key(pool, 0, 0, 7, big.data());
  s.update(0, pool.slot_data(0), 7, 1);
  CHECK(s.dequantized(0, 0, 7)[0] == doctest::Approx(-3.0e38f).epsilon(1e-6));
  CHECK(s.dequantized(0, 0, 7)[1] == doctest::Approx(3.0e38f).epsilon(1e-6));
}

TEST_CASE("int8_key_summary with mass aggregation ranks blocks by exact mass, not by max") {
  // One KV head, one query row. Block 1 holds one token with the highest logit; block 2 holds
  // 16 tokens each a little lower: their summed mass is larger. With a budget of one free block,
  // max aggregation keeps block 1, mass aggregation (through score_log_mass) block 2, which is
  // what the query's attention covers.
  const kv_layout l{1, 1, 1, 16, 16, dtype::f32};
  host_tier pool(l, 4);
  std::memset(pool.slot_data(0), 0, l.block_bytes() * 4);
  std::vector<float> q(16, 0.0f);
  q[0] = 4.0f;  // logit of a key = 4 * k[0], scaled by 1/sqrt(16): exp(k[0])
  std::vector<float> k(16, 0.0f);
  for (std::uint32_t b = 0; b < 4; ++b) {
    for (std::uint32_t t = 0; t < 16; ++t) {
      k[0] = b == 1 ? (t == 0 ? 3.0f : -3.0f) : (b == 2 ? 2.0f : -3.0f);
      set_key(pool, b, 0, t, k.data());
    }
  }
  // block 1: e^3 + 15 e^-3 = 20.8; block 2: 16 e^2 = 118.2
  int8_key_summary s(l, 4);
  std::vector<std::uint32_t> ids{0, 1, 2, 3};
  for (std::uint32_t b = 0; b < 4; ++b) {
    s.update(b, pool.slot_data(b), 0, 16);
  }
  prediction_input<int8_key_summary> in{l, 64, &s, ids, query_view{q.data(), nullptr, 1}, {}, {}};
  const selection_params sp{3, 1, 1};  // sink block 0, recent block 3, one free block
  selection by_mass, by_max;
  lookahead_predictor<int8_key_summary>{}.select(in, sp, by_mass);  // the default: mass
  lookahead_predictor<int8_key_summary, max_aggregation>{}.select(in, sp, by_max);
  CHECK(std::vector<std::uint32_t>(by_mass.blocks) == std::vector<std::uint32_t>{0, 2, 3});
  CHECK(std::vector<std::uint32_t>(by_max.blocks) == std::vector<std::uint32_t>{0, 1, 3});

  // The aggregated mass equals each block's exact share of the attention.
  std::vector<float> raw(4), acc(4);
  s.score_log_mass(0, ids, q.data(), 1, 0.25f, raw.data());
  softmax_mass_aggregation agg;
  agg.combine(aggregation_context{4, 1, 1, 0.25f, nullptr}, raw.data(), acc.data(), true);
  const double m[4] = {16 * std::exp(-3.0), std::exp(3.0) + 15 * std::exp(-3.0), 16 * std::exp(2.0),
                       16 * std::exp(-3.0)};
  const double total = m[0] + m[1] + m[2] + m[3];
  for (std::uint32_t b = 0; b < 4; ++b) {
    CHECK(acc[b] == doctest::Approx(m[b] / total).epsilon(1e-5));
  }
}

TEST_CASE_TEMPLATE("quantized_key_summary: bad input names the value; memory", S, int8_key_summary,
                   int4_key_summary) {
  const kv_layout l{1, 4, 2, 16, 8, dtype::f16};
  S s(l, 4);
  std::vector<float> q(16, 1.0f), out(4);
  const std::vector<std::uint32_t> ok{0}, bad{5};
  const std::string name = S::bits == 8 ? "int8_key_summary" : "int4_key_summary";
  expect_error([&] { s.score_log_mass(0, ok, q.data(), 1, 0.0f, out.data()); },
               errc::invalid_argument, "scale = 0");
  expect_error([&] { s.score_log_mass(0, ok, q.data(), 1, -1.0f, out.data()); },
               errc::invalid_argument, "scale = -1");
  expect_error(
      [&] {
        s.score_log_mass(0, ok, q.data(), 1, std::numeric_limits<float>::infinity(), out.data());
      },
      errc::invalid_argument, "must be finite");
  expect_error([&] { s.score_log_mass(2, ok, q.data(), 1, 1.0f, out.data()); }, errc::out_of_range,
               name + "::score_log_mass: kv head 2");
  expect_error([&] { s.score_log_mass(0, bad, q.data(), 1, 1.0f, out.data()); }, errc::out_of_range,
               "entry 5 >= capacity = 4");
  expect_error([&] { s.score(0, ok, nullptr, 1, out.data()); }, errc::invalid_argument,
               name + "::score: null query");
  expect_error([&] { (void)s.dequantized(0, 4, 0); }, errc::out_of_range, "entry 4");
  expect_error([&] { (void)s.dequantized(0, 0, 8); }, errc::out_of_range, "token 8");
  expect_error([&] { (void)s.tokens(9); }, errc::out_of_range, "entry 9");

  // Memory: codes (bits / 8 per element) and a 4-byte scale per token, per KV head, and the
  // token count; tokens_per_block rounded up to 16.
  const kv_layout smol{30, 9, 3, 64, 16, dtype::f16};
  const S m(smol, 1);
  CHECK(m.bytes_per_block() == 3 * 16 * (64 * S::bits / 8 + 4) + 2);
  const S padded(kv_layout{1, 4, 2, 16, 20, dtype::f16}, 1);
  CHECK(padded.bytes_per_block() == 2 * 32 * (16 * S::bits / 8 + 4) + 2);
}

namespace {
struct int8_bundle {
  using allocator = free_list_allocator;
  using fast_tier = host_tier;
  using slow_tier = host_tier;
  using transfer = cpu_copy_engine;
  using predictor = lookahead_predictor<int8_key_summary>;
  using scheduler = lookahead_prefetcher<lru_eviction>;
  using kernel = reference_decode;
};
}  // namespace

TEST_CASE("tiered_kv_cache with int8_key_summary stages the block the lookahead points at") {
  // 16 blocks of 4 tokens with random keys; the keys of block 9 are the lookahead query's
  // direction, scaled, so nearly all of that query's attention falls there. A budget of three
  // blocks (sink, newest, one free) must stage block 9: then attention over the staged blocks
  // equals dense attention, and it would not without it.
  const kv_layout l{1, 4, 2, 16, 4, dtype::f32};
  tiered_kv_cache<int8_bundle> cache(host_tier(l, 64), host_tier(l, 16),
                                     {.budget_tokens = 12, .scale = 0.25f});
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), uq(-2.0f, 2.0f);
  std::vector<float> q(std::size_t{l.num_q_heads} * l.head_dim);
  for (std::uint32_t x = 0; x < l.head_dim; ++x) {  // every q head: the same direction
    const float v = uq(rng);
    for (std::uint32_t h = 0; h < l.num_q_heads; ++h) {
      q[std::size_t{h} * l.head_dim + x] = v;
    }
  }
  const std::uint32_t tokens = 64, kvd = l.num_kv_heads * l.head_dim;
  std::vector<float> k(std::size_t{tokens} * kvd), v(k.size());
  for (std::uint32_t t = 0; t < tokens; ++t) {
    for (std::uint32_t i = 0; i < kvd; ++i) {
      k[std::size_t{t} * kvd + i] = t / 4 == 9 ? 2.0f * q[i % l.head_dim] : u(rng);
      v[std::size_t{t} * kvd + i] = u(rng);
    }
  }
  const sequence_id s = cache.add_sequence();
  cache.append(s, 0, k.data(), v.data(), tokens);
  cache.lookahead(s, 0, {q.data(), nullptr, 1});
  std::vector<float> out(q.size()), lse(l.num_q_heads), ref(q.size()), ref_lse(lse.size());
  const sequence_id one[1] = {s};
  cache.attend(one, 0, q.data(), 1, out.data(), lse.data());
  const auto slots = cache.block_slots(s, 0);
  std::vector<block_ref> refs;
  for (std::uint32_t b = 0; b < slots.size(); ++b) {
    refs.push_back({slots[b], b});
  }
  const std::uint32_t offsets[2] = {0, static_cast<std::uint32_t>(refs.size())};
  const std::uint32_t len = cache.length(s, 0);
  reference_decode{}.decode({q.data(),
                             cache.capacity_tier().view(),
                             {refs.data(), offsets, 1, 1},
                             &len,
                             ref.data(),
                             ref_lse.data(),
                             1,
                             1,
                             0.25f});
  CHECK(oasiskv::testing::max_rel_error(out, ref) < 1e-3);
}
