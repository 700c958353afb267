// SPDX-License-Identifier: Apache-2.0
// Summaries shipped with adopted blocks: `minmax_summary::load` and
// `quantized_minmax_summary::load` take the f16 max/min wire format of
// `disagg::summarize_block`, and a loaded entry bounds the block's keys as one computed by
// `update` does (equal to it for f16 keys, which the wire holds exactly).
#include <doctest/doctest.h>

#include "support/expect_error.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "oasiskv/concepts/loadable_summary.hpp"
#include "oasiskv/disagg/wire_summary.hpp"
#include "oasiskv/summary/mean_summary.hpp"
#include "oasiskv/summary/minmax_summary.hpp"
#include "oasiskv/summary/quantized_minmax_summary.hpp"
#include "support/kv_fixture.hpp"

using namespace oasiskv;
using oasiskv::testing::expect_error;

static_assert(loadable_summary<minmax_summary<f16>>);
static_assert(loadable_summary<minmax_summary<bf16>>);
static_assert(loadable_summary<minmax_summary<float>>);
static_assert(loadable_summary<quantized_minmax_summary>);
static_assert(!loadable_summary<mean_summary>);

namespace {

std::vector<std::byte> wire_of(const kv_layout& l, const std::byte* block, std::uint32_t tokens) {
  std::vector<std::byte> w(disagg::summary_bytes(l));
  disagg::summarize_block(l, block, tokens, w.data());
  return w;
}

// The true max (which = 0) or min (which = 1) of dimension x of head h over `tokens` tokens.
float extreme(const host_tier& t, slot_id s, std::uint32_t h, std::uint32_t x, std::uint32_t tokens,
              int which) {
  const kv_layout& l = t.layout();
  float best =
      which == 0 ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::infinity();
  visit_dtype(l.kv_dtype, [&](auto elem) {
    using T = decltype(elem);
    const T* p = reinterpret_cast<const T*>(t.slot_data(s) + l.key_offset(h));
    for (std::uint32_t tok = 0; tok < tokens; ++tok) {
      const float v = to_float(p[std::size_t{tok} * l.head_dim + x]);
      best = which == 0 ? std::max(best, v) : std::min(best, v);
    }
  });
  return best;
}

// A pool of random keys with some wide values: beyond f16's range in slot 5 (an infinite shipped
// bound; not for f16 keys, which cannot hold them) and tiny ones in slot 6.
void fill_wide(host_tier& pool, std::uint32_t seed) {
  const kv_layout& l = pool.layout();
  testing::fill_random(pool, seed);
  visit_dtype(l.kv_dtype, [&](auto elem) {
    using T = decltype(elem);
    if constexpr (!std::is_same_v<T, f16>) {
      T* p = reinterpret_cast<T*>(pool.slot_data(5) + l.key_offset(1));
      p[3] = from_float<T>(1e6f);
      p[l.head_dim + 4] = from_float<T>(-1e6f);
    }
    T* q = reinterpret_cast<T*>(pool.slot_data(6) + l.key_offset(0));
    q[0] = from_float<T>(3e-8f);
    q[l.head_dim] = from_float<T>(-3e-8f);
  });
}

// The highest dot product of query row `q` with the keys of head h of slot s's first `tokens`.
float best_dot(const host_tier& t, slot_id s, std::uint32_t h, const float* q,
               std::uint32_t tokens) {
  const kv_layout& l = t.layout();
  float best = -std::numeric_limits<float>::infinity();
  visit_dtype(l.kv_dtype, [&](auto elem) {
    using T = decltype(elem);
    const T* p = reinterpret_cast<const T*>(t.slot_data(s) + l.key_offset(h));
    for (std::uint32_t tok = 0; tok < tokens; ++tok) {
      double dot = 0.0;
      for (std::uint32_t x = 0; x < l.head_dim; ++x) {
        dot += double{q[x]} * double{to_float(p[std::size_t{tok} * l.head_dim + x])};
      }
      best = std::max(best, static_cast<float>(dot));
    }
  });
  return best;
}

// Scores of rows `q` ([n][head_dim]) against every entry [0, entries) of head h: [entry][row].
template <class S>
std::vector<float> scores_of(const S& s, std::uint32_t h, std::uint32_t entries,
                             const std::vector<float>& q, std::uint32_t n) {
  std::vector<std::uint32_t> ids(entries);
  for (std::uint32_t b = 0; b < entries; ++b) {
    ids[b] = b;
  }
  std::vector<float> out(std::size_t{entries} * n);
  s.score(h, ids, q.data(), n, out.data());
  return out;
}

}  // namespace

TEST_CASE_TEMPLATE("every loadable summary: a loaded entry bounds the keys; update's for f16 keys",
                   S, minmax_summary<f16>, minmax_summary<bf16>, minmax_summary<float>,
                   quantized_minmax_summary) {
  for (const dtype dt : {dtype::f32, dtype::f16, dtype::bf16}) {
    CAPTURE(to_string(dt));
    const kv_layout l{1, 8, 2, 32, 16, dt};
    const std::uint32_t nblocks = 20, n = 3;
    host_tier pool(l, nblocks);
    fill_wide(pool, 31 + static_cast<std::uint32_t>(dt));
    S loaded(l, nblocks), updated(l, nblocks);
    CHECK(loaded.wire_bytes() == disagg::summary_bytes(l));
    std::mt19937 rng(7);
    std::vector<std::uint32_t> fill(nblocks);
    for (std::uint32_t b = 0; b < nblocks; ++b) {
      fill[b] = 1 + static_cast<std::uint32_t>(rng() % l.tokens_per_block);
      loaded.load(b, wire_of(l, pool.slot_data(b), fill[b]), fill[b]);
      updated.update(b, pool.slot_data(b), 0, fill[b]);
      CHECK(loaded.tokens(b) == fill[b]);
    }
    std::vector<float> q(std::size_t{n} * l.head_dim);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (float& v : q) {
      v = u(rng);
    }
    for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
      const auto sl = scores_of(loaded, h, nblocks, q, n);
      const auto su = scores_of(updated, h, nblocks, q, n);
      for (std::uint32_t b = 0; b < nblocks; ++b) {
        for (std::uint32_t r = 0; r < n; ++r) {
          CAPTURE(b);
          CAPTURE(r);
          const float got = sl[std::size_t{b} * n + r], want = su[std::size_t{b} * n + r];
          const float dot = best_dot(pool, b, h, q.data() + std::size_t{r} * l.head_dim, fill[b]);
          CHECK_FALSE(std::isnan(got));
          CHECK(got >= dot - 1e-4f * (1.0f + std::abs(dot)));  // a bound of every key
          if (std::isinf(want)) {  // a key beyond the storage's range: unbounded
            CHECK(got == want);
          } else {
            CHECK(got >= want - 1e-4f * (1.0f + std::abs(want)));  // never tighter than update's
          }
          if (dt == dtype::f16) {
            CHECK(got == want);
          }
        }
      }
    }
  }
}

TEST_CASE_TEMPLATE("every loadable summary: later appends fold into a loaded entry", S,
                   minmax_summary<f16>, minmax_summary<bf16>, minmax_summary<float>,
                   quantized_minmax_summary) {
  const kv_layout l{1, 4, 2, 16, 16, dtype::f16};
  host_tier pool(l, 1);
  testing::fill_random(pool, 5);
  S a(l, 4), b(l, 4);
  a.load(2, wire_of(l, pool.slot_data(0), 5), 5);
  a.update(2, pool.slot_data(0), 5, 7);
  b.update(2, pool.slot_data(0), 0, 12);
  CHECK(a.tokens(2) == 12);
  std::vector<float> q(std::size_t{4} * l.head_dim);
  std::mt19937 rng(2);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (float& v : q) {
    v = u(rng);
  }
  // A reused entry: a load replaces whatever the entry held.
  host_tier other(l, 1);
  testing::fill_random(other, 9);
  a.update(3, other.slot_data(0), 0, 16);
  a.load(3, wire_of(l, pool.slot_data(0), 5), 5);
  b.load(3, wire_of(l, pool.slot_data(0), 5), 5);
  CHECK(a.tokens(3) == 5);
  for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
    CHECK(scores_of(a, h, 4, q, 4) == scores_of(b, h, 4, q, 4));
  }
}

TEST_CASE_TEMPLATE("every loadable summary: bad sizes, token counts, entries; NaN is unbounded", S,
                   minmax_summary<f16>, minmax_summary<bf16>, minmax_summary<float>,
                   quantized_minmax_summary) {
  const kv_layout l{1, 4, 2, 16, 16, dtype::f16};
  S s(l, 4);
  std::vector<std::byte> w(s.wire_bytes());
  expect_error([&] { s.load(0, std::span(w).first(w.size() - 2), 3); }, errc::invalid_argument,
               "entry 0 got 126 bytes, expected 128");
  std::vector<std::byte> longer(w.size() + 1);
  expect_error([&] { s.load(0, longer, 3); }, errc::invalid_argument, "got 129 bytes");
  expect_error([&] { s.load(0, w, 0); }, errc::out_of_range, "of 0 tokens");
  expect_error([&] { s.load(0, w, 17); }, errc::out_of_range, "of 17 tokens");
  expect_error([&] { s.load(4, w, 3); }, errc::out_of_range, "entry 4");
  CHECK(s.tokens(0) == 0);  // unchanged by the refused loads
  std::vector<float> q(l.head_dim, 1.0f);
  CHECK(scores_of(s, 0, 1, q, 1)[0] == -std::numeric_limits<float>::infinity());  // still empty
  // A NaN maximum: the block is unbounded above (always chosen), never a NaN score.
  const f16 nan{0x7e00};
  for (std::uint32_t x = 0; x < l.head_dim; ++x) {
    std::memcpy(w.data() + x * 2, &nan, 2);  // head 0's maximum
  }
  s.load(1, w, 16);
  CHECK(scores_of(s, 0, 2, q, 1)[1] == std::numeric_limits<float>::infinity());
}

TEST_CASE("quantized_minmax_summary::load: an inverted bound is refused; an infinite one is +inf") {
  const kv_layout l{1, 4, 2, 16, 16, dtype::f16};
  quantized_minmax_summary s(l, 4);
  std::vector<std::byte> w(s.wire_bytes());
  auto put = [&](std::uint32_t h, std::uint32_t which, std::uint32_t x, float v) {
    const f16 b = f16::from_float(v);
    std::memcpy(w.data() + ((std::size_t{h} * 2 + which) * l.head_dim + x) * 2, &b, 2);
  };
  for (std::uint32_t h = 0; h < 2; ++h) {
    for (std::uint32_t x = 0; x < l.head_dim; ++x) {
      put(h, 0, x, 0.5f);
      put(h, 1, x, -0.5f);
    }
  }
  s.load(0, w, 4);
  std::vector<float> q(l.head_dim, 1.0f);
  const float before = scores_of(s, 1, 1, q, 1)[0];
  CHECK(before >= 0.5f * static_cast<float>(l.head_dim));
  put(1, 0, 9, -1.0f);  // head 1, dimension 9: max -1 below min -0.5
  expect_error([&] { s.load(0, w, 4); }, errc::invalid_argument,
               "entry 0, kv head 1, dimension 9: maximum -1 is below minimum -0.5");
  CHECK(scores_of(s, 1, 1, q, 1)[0] == before);  // unchanged
  CHECK(s.tokens(0) == 4);
  put(1, 0, 9, std::numeric_limits<float>::infinity());  // a key beyond f16's range
  s.load(2, w, 4);
  CHECK(scores_of(s, 0, 3, q, 1)[2] == std::numeric_limits<float>::infinity());
  CHECK(scores_of(s, 1, 3, q, 1)[2] == std::numeric_limits<float>::infinity());
}

TEST_CASE_TEMPLATE("minmax_summary::load: the wire format, bounds as `update`'s", Storage, f16,
                   bf16, float) {
  for (const dtype dt : {dtype::f32, dtype::f16, dtype::bf16}) {
    CAPTURE(to_string(dt));
    const kv_layout l{1, 8, 2, 32, 16, dt};
    const std::uint32_t nblocks = 20;
    host_tier pool(l, nblocks);
    fill_wide(pool, 11 + static_cast<std::uint32_t>(dt));
    std::mt19937 rng(3);
    minmax_summary<Storage> loaded(l, nblocks), updated(l, nblocks);
    CHECK(loaded.wire_bytes() == disagg::summary_bytes(l));
    std::vector<std::uint32_t> fill(nblocks);
    for (std::uint32_t b = 0; b < nblocks; ++b) {
      fill[b] = 1 + static_cast<std::uint32_t>(rng() % l.tokens_per_block);
      const auto w = wire_of(l, pool.slot_data(b), fill[b]);
      loaded.load(b, w, fill[b]);
      updated.update(b, pool.slot_data(b), 0, fill[b]);
      CHECK(loaded.tokens(b) == fill[b]);
    }
    for (std::uint32_t b = 0; b < nblocks; ++b) {
      for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
        const auto lb = loaded.bounds(h, b), ub = updated.bounds(h, b);
        for (std::uint32_t x = 0; x < l.head_dim; ++x) {
          const float lhi = cpu::detail::widen(lb[x]), llo = cpu::detail::widen(lb[l.head_dim + x]);
          const float uhi = cpu::detail::widen(ub[x]), ulo = cpu::detail::widen(ub[l.head_dim + x]);
          // A bound of the true keys, never tighter than the one computed from them.
          CHECK(lhi >= extreme(pool, b, h, x, fill[b], 0));
          CHECK(llo <= extreme(pool, b, h, x, fill[b], 1));
          CHECK(lhi >= uhi);
          CHECK(llo <= ulo);
          if constexpr (std::is_same_v<Storage, f16>) {
            CHECK(lhi == uhi);  // the same outward rounding to f16
            CHECK(llo == ulo);
          }
          if (std::is_same_v<Storage, float> && dt == dtype::f16) {
            CHECK(lhi == uhi);
            CHECK(llo == ulo);
          }
        }
      }
    }
    // Scores: at least the computed summary's; equal for f16 storage.
    std::vector<std::uint32_t> ids(nblocks);
    for (std::uint32_t b = 0; b < nblocks; ++b) {
      ids[b] = b;
    }
    std::vector<float> q(3 * l.head_dim), sl(nblocks * 3), su(nblocks * 3);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (float& v : q) {
      v = u(rng);
    }
    for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
      loaded.score(h, ids, q.data(), 3, sl.data());
      updated.score(h, ids, q.data(), 3, su.data());
      for (std::size_t i = 0; i < sl.size(); ++i) {
        CHECK_FALSE(std::isnan(sl[i]));
        if constexpr (std::is_same_v<Storage, f16>) {
          CHECK(sl[i] == su[i]);
        } else {
          CHECK(sl[i] >= su[i] - 1e-4f * (1.0f + std::abs(su[i])));
        }
      }
    }
  }
}

TEST_CASE("minmax_summary::load: later appends fold into a loaded entry") {
  const kv_layout l{1, 4, 2, 16, 16, dtype::f16};
  host_tier pool(l, 1);
  testing::fill_random(pool, 5);
  minmax_summary<f16> a(l, 4), b(l, 4);
  a.load(2, wire_of(l, pool.slot_data(0), 5), 5);
  a.update(2, pool.slot_data(0), 5, 7);
  b.update(2, pool.slot_data(0), 0, 12);
  for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
    CHECK(a.bounds(h, 2) == b.bounds(h, 2));
  }
  CHECK(a.tokens(2) == 12);
}
