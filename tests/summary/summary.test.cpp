// SPDX-License-Identifier: Apache-2.0
// Block summaries: every model runs the same cases (incremental == bulk, reset, bad input,
// every scoring path agrees); then what each one promises (minmax: an upper bound, tight on one
// token; mean: the mean key's dot product).
#include <doctest/doctest.h>

#include "support/expect_error.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "oasiskv/concepts/block_summary.hpp"
#include "oasiskv/concepts/growable_summary.hpp"
#include "oasiskv/concepts/row_scoring_summary.hpp"
#include "oasiskv/summary/mean_summary.hpp"
#include "oasiskv/summary/minmax_summary.hpp"
#include "oasiskv/summary/quantized_key_summary.hpp"
#include "oasiskv/summary/quantized_minmax_summary.hpp"
#include "support/kv_fixture.hpp"
#include "support/paths.hpp"

using namespace oasiskv;

namespace {

using oasiskv::testing::expect_error;

using oasiskv::testing::key_of;

std::vector<float> random_queries(std::uint32_t n, std::uint32_t d, std::uint32_t seed,
                                  float zero_share = 0.1f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f), coin(0.0f, 1.0f);
  std::vector<float> q(std::size_t{n} * d);
  for (float& x : q) {
    x = coin(rng) < zero_share ? 0.0f : dist(rng);  // zeros exercise the q+ / q- split
  }
  return q;
}

std::vector<float> scores(const auto& s, std::uint32_t h, const std::vector<std::uint32_t>& ids,
                          const std::vector<float>& q, std::uint32_t n) {
  std::vector<float> out(ids.size() * n);
  s.score(h, ids, q.data(), n, out.data());
  return out;
}

constexpr dtype all_dtypes[] = {dtype::f32, dtype::f16, dtype::bf16};

}  // namespace

TEST_CASE_TEMPLATE("block summary: incremental == bulk, reset, every scoring path", S,
                   minmax_summary<f16>, minmax_summary<bf16>, minmax_summary<float>, mean_summary,
                   quantized_minmax_summary, int8_key_summary, int4_key_summary) {
  static_assert(block_summary<S>);
  for (const dtype dt : all_dtypes) {
    CAPTURE(to_string(dt));
    const kv_layout l{1, 8, 2, 24, 16, dt};  // head_dim 24: 8 mod 16 exercises the tail
    host_tier pool(l, 3);
    testing::fill_random(pool, 11);
    const std::uint32_t fill[3] = {16, 16, 7};  // the last block is partial
    const std::vector<std::uint32_t> ids{0, 1, 2};

    {  // one token at a time, two chunks and one bulk update give the same entry
      S bulk(l, 3), single(l, 3), chunks(l, 3);
      for (std::uint32_t b = 0; b < 3; ++b) {
        bulk.update(b, pool.slot_data(b), 0, fill[b]);
        for (std::uint32_t t = 0; t < fill[b]; ++t) {
          single.update(b, pool.slot_data(b), t, 1);
        }
        chunks.update(b, pool.slot_data(b), 0, 5);
        chunks.update(b, pool.slot_data(b), 5, fill[b] - 5);
        CHECK(bulk.tokens(b) == fill[b]);
      }
      const std::vector<float> q = random_queries(5, l.head_dim, 3);
      for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
        const auto a = scores(bulk, h, ids, q, 5);
        const auto b = scores(single, h, ids, q, 5);
        const auto c = scores(chunks, h, ids, q, 5);
        CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
        CHECK(std::memcmp(a.data(), c.data(), a.size() * sizeof(float)) == 0);
      }
    }

    {  // reset empties an entry, which scores -inf
      S s(l, 3);
      s.update(1, pool.slot_data(1), 0, 16);
      s.reset(1);
      CHECK(s.tokens(1) == 0);
      const std::vector<float> q = random_queries(2, l.head_dim, 4);
      for (float v : scores(s, 0, {1, 2}, q, 2)) {
        CHECK(v == -std::numeric_limits<float>::infinity());
      }
    }

    {  // every scoring path agrees with the scalar one
      S s(l, 3);
      for (std::uint32_t b = 0; b < 3; ++b) {
        s.update(b, pool.slot_data(b), 0, fill[b]);
      }
      s.set_isa(cpu_isa::scalar);
      for (const std::uint32_t n : {1u, 3u, 8u, 13u}) {
        const std::vector<float> q = random_queries(n, l.head_dim, n);
        const std::vector<std::uint32_t> order{2, 0, 1, 0};
        const auto ref = scores(s, 1, order, q, n);
        for (const cpu_isa isa : {cpu_isa::avx2, cpu_isa::avx512}) {
          if (!isa_supported(isa)) {
            continue;
          }
          oasiskv::testing::note_path("score kernels: " + std::string(to_string(isa)));
          S v(l, 3, isa);
          for (std::uint32_t b = 0; b < 3; ++b) {
            v.update(b, pool.slot_data(b), 0, fill[b]);
          }
          const auto got = scores(v, 1, order, q, n);
          for (std::size_t i = 0; i < ref.size(); ++i) {
            CHECK(got[i] == doctest::Approx(ref[i]).epsilon(1e-5));
          }
        }
      }
    }
  }
}

TEST_CASE_TEMPLATE("row_scoring_summary: score_rows is score transposed, each id as if alone", S,
                   minmax_summary<f16>, minmax_summary<bf16>, minmax_summary<float>,
                   quantized_minmax_summary) {
  static_assert(row_scoring_summary<S>);
  static_assert(!row_scoring_summary<mean_summary>);
  const kv_layout l{1, 6, 2, 32, 16, dtype::f16};
  const std::uint32_t cap = 40;  // three tiles of 16 entries, the last one partial
  host_tier pool(l, cap);
  testing::fill_random(pool, 21);
  auto every = [](std::uint32_t first, std::uint32_t end, int step) {
    std::vector<std::uint32_t> v;
    for (auto i = static_cast<std::int64_t>(first); step > 0 ? i < end : i >= end; i += step) {
      v.push_back(static_cast<std::uint32_t>(i));
    }
    return v;
  };
  // Every tile whole; a run across a tile boundary; scattered ids; repeats and an empty entry
  // (38, never updated); one entry; entries strided by 4 (a layer's decoded blocks, allocated
  // round-robin with three other layers') and descending ones: ids that share a tile without
  // forming a run.
  const std::vector<std::vector<std::uint32_t>> id_sets = {every(0, cap, 1),
                                                           every(14, 21, 1),
                                                           every(0, cap * 17, 17),
                                                           {7, 7, 3, 38, 39, 38, 0},
                                                           {33},
                                                           every(1, cap, 4),
                                                           every(cap - 1, 0, -1)};
  for (const cpu_isa isa : {cpu_isa::scalar, cpu_isa::avx2, cpu_isa::avx512}) {
    if (!isa_supported(isa)) {
      continue;
    }
    oasiskv::testing::note_path("score kernels: " + std::string(to_string(isa)));
    S s(l, cap, isa);
    for (std::uint32_t b = 0; b < cap; ++b) {
      if (b != 38) {
        s.update(b, pool.slot_data(b), 0, b % 16 + 1);
      }
    }
    for (const std::uint32_t n : {1u, 3u, 8u, 13u}) {
      const std::vector<float> q = random_queries(n, l.head_dim, 40 + n);
      for (std::vector<std::uint32_t> ids : id_sets) {
        for (std::uint32_t& id : ids) {
          id %= cap;
        }
        CAPTURE(n);
        CAPTURE(ids.size());
        for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
          const auto by_entry = scores(s, h, ids, q, n);
          std::vector<float> by_row(ids.size() * n);
          s.score_rows(h, ids, q.data(), n, by_row.data());
          bool same = true, alone = true;
          for (std::size_t i = 0; i < ids.size(); ++i) {
            // Scored by itself (a run of one), the id gives the same bits as within the batch.
            const auto single = scores(s, h, {ids[i]}, q, n);
            for (std::uint32_t r = 0; r < n; ++r) {
              const float a = by_entry[i * n + r], b = by_row[r * ids.size() + i];
              same = same && std::memcmp(&a, &b, sizeof a) == 0;
              alone = alone && std::memcmp(&a, &single[r], sizeof a) == 0;
            }
          }
          CHECK(same);
          CHECK(alone);
        }
      }
    }
  }
}

TEST_CASE_TEMPLATE("block summary: bad input and memory", S, minmax_summary<f16>,
                   minmax_summary<bf16>, minmax_summary<float>, mean_summary,
                   quantized_minmax_summary, int8_key_summary, int4_key_summary) {
  SUBCASE("bad input names the value") {
    const kv_layout l{1, 4, 2, 16, 8, dtype::f16};
    host_tier pool(l, 1);
    S s(l, 4);
    std::vector<float> q(16, 1.0f), out(4);
    const std::vector<std::uint32_t> bad_ids{0, 4};
    expect_error([&] { s.reset(4); }, errc::out_of_range, "entry 4");
    expect_error([&] { s.update(7, pool.slot_data(0), 0, 1); }, errc::out_of_range, "entry 7");
    expect_error([&] { s.update(0, pool.slot_data(0), 6, 3); }, errc::out_of_range, "[6, 9)");
    expect_error([&] { s.update(0, nullptr, 0, 1); }, errc::invalid_argument, "null");
    expect_error([&] { s.score(2, bad_ids, q.data(), 1, out.data()); }, errc::out_of_range,
                 "kv head 2");
    expect_error([&] { s.score(0, bad_ids, q.data(), 1, out.data()); }, errc::out_of_range,
                 "entry 4");
    expect_error([&] { S bad(l, 0); }, errc::invalid_argument, "capacity");
    expect_error(
        [&] {
          S bad(kv_layout{1, 4, 3, 16, 8, dtype::f16}, 1);
        },
        errc::invalid_layout, "num_kv_heads = 3");
  }

  SUBCASE("an entry costs far less than the block it describes") {
    const kv_layout l{32, 32, 8, 128, 16, dtype::f16};
    S s(l, 1);
    CAPTURE(s.bytes_per_block());
    // An int8 copy of the keys is a quarter of the f16 K+V bytes, plus its scales.
    const std::size_t ratio = std::is_same_v<S, int8_key_summary> ? 3 : 4;
    CHECK(s.bytes_per_block() * ratio <= l.block_bytes());
  }
}

TEST_CASE_TEMPLATE("block summary: grow keeps every entry and adds empty ones", S,
                   minmax_summary<f16>, minmax_summary<bf16>, minmax_summary<float>, mean_summary,
                   quantized_minmax_summary, int8_key_summary, int4_key_summary) {
  static_assert(growable_summary<S>);
  const kv_layout l{1, 8, 2, 24, 16, dtype::f16};
  host_tier pool(l, 40);
  testing::fill_random(pool, 5);
  // 19 entries: the last tile of the 16-lane layouts is partial before and after growing.
  S grown(l, 19), fixed(l, 40);
  for (std::uint32_t b = 0; b < 19; ++b) {
    const std::uint32_t tokens = b % 3 == 0 ? 16 : 1 + b % 16;
    grown.update(b, pool.slot_data(b), 0, tokens);
    fixed.update(b, pool.slot_data(b), 0, tokens);
  }
  grown.grow(19);  // the same capacity: nothing changes
  grown.grow(37);
  CHECK(grown.capacity() == 37);
  expect_error([&] { grown.grow(36); }, errc::invalid_argument, "grow(36)");
  for (std::uint32_t b = 19; b < 37; ++b) {
    CHECK(grown.tokens(b) == 0);
  }
  for (std::uint32_t b = 30; b < 37; ++b) {  // a new entry takes keys like an old one
    grown.update(b, pool.slot_data(b), 0, 16);
    fixed.update(b, pool.slot_data(b), 0, 16);
  }
  std::vector<std::uint32_t> ids;  // old, new-but-empty and new-and-filled entries, shuffled
  for (std::uint32_t b = 0; b < 37; ++b) {
    ids.push_back((b * 7) % 37);
  }
  const std::vector<float> q = random_queries(6, l.head_dim, 9);
  for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
    const auto a = scores(grown, h, ids, q, 6);
    const auto b = scores(fixed, h, ids, q, 6);
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] >= 19 && ids[i] < 30) {  // empty in both: `fixed` never saw these entries
        for (std::uint32_t r = 0; r < 6; ++r) {
          CHECK(a[i * 6 + r] == -std::numeric_limits<float>::infinity());
        }
      }
    }
    CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("directed rounding brackets the value and stays one step from it") {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dist(-100.0f, 100.0f);
  for (int i = 0; i < 20000; ++i) {
    const float x = i < 4 ? (i < 2 ? 0.0f : 1e-7f) * (i % 2 ? -1.0f : 1.0f) : dist(rng);
    const f16 lo = cpu::detail::round_down<f16>(x), hi = cpu::detail::round_up<f16>(x);
    CHECK(lo.to_float() <= x);
    CHECK(hi.to_float() >= x);
    CHECK(cpu::detail::next_toward_pos_inf(lo).to_float() >= x);
    const bf16 blo = cpu::detail::round_down<bf16>(x), bhi = cpu::detail::round_up<bf16>(x);
    CHECK(blo.to_float() <= x);
    CHECK(bhi.to_float() >= x);
  }
  CHECK(cpu::detail::round_up<f16>(65505.0f).to_float() == std::numeric_limits<float>::infinity());
  CHECK(cpu::detail::round_down<f16>(65505.0f).to_float() == 65504.0f);
}

TEST_CASE_TEMPLATE("minmax_summary: an upper bound of every token's dot product", Storage, f16,
                   bf16, float) {
  for (const dtype dt : all_dtypes) {
    for (const std::uint32_t d : {24u, 64u, 128u}) {
      CAPTURE(to_string(dt));
      CAPTURE(d);
      const kv_layout l{1, 6, 3, d, 16, dt};
      const std::uint32_t nblocks = 12;
      host_tier pool(l, nblocks);
      testing::fill_random(pool, d + 7);
      minmax_summary<Storage> s(l, nblocks);
      std::vector<std::uint32_t> fill(nblocks), ids(nblocks);
      for (std::uint32_t b = 0; b < nblocks; ++b) {
        fill[b] = b < 3 ? 1 : (b % 5 == 0 ? 9 : 16);  // blocks 0-2 hold one token
        s.update(b, pool.slot_data(b), 0, fill[b]);
        ids[b] = b;
      }
      const std::uint32_t n = 7;
      const std::vector<float> q = random_queries(n, d, d);
      // The stored bounds describe the keys exactly when the storage type holds the KV type.
      const bool exact = std::is_same_v<Storage, float> || dtype_of<Storage> == dt;
      for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
        const auto bound = scores(s, h, ids, q, n);
        for (std::uint32_t b = 0; b < nblocks; ++b) {
          for (std::uint32_t r = 0; r < n; ++r) {
            double best = -1e300, mag = 0.0;
            for (std::uint32_t t = 0; t < fill[b]; ++t) {
              const auto k = key_of(pool, b, h, t);
              double dot = 0.0;
              for (std::uint32_t x = 0; x < d; ++x) {
                dot += double{q[r * d + x]} * k[x];
                mag += std::abs(double{q[r * d + x]} * k[x]);
              }
              best = std::max(best, dot);
            }
            const double got = bound[b * n + r];
            const double slack = 1e-5 * mag / fill[b] + 1e-6;  // f32 summation error
            CHECK(got >= best - slack);
            if (fill[b] == 1 && exact) {
              CHECK(got <= best + slack);  // tight: one token's bound is its dot product
            }
          }
        }
      }
    }
  }
}

TEST_CASE_TEMPLATE("minmax_summary: every row group and sign pattern, on every path", Storage, f16,
                   bf16, float) {
  // The vector kernels score rows in groups of up to 4, visiting the dimensions grouped by
  // which rows are negative there. Rows 0..n-1 take every sign pattern of their group in the
  // first 16 dimensions, zeros (+0 and -0) after; the reference is the bound in double from the
  // stored bounds: sum over x of q * (q < 0 ? min : max).
  const kv_layout l{1, 8, 2, 64, 16, dtype::f32};
  const std::uint32_t nblocks = 40;  // 3 tiles, the last partial
  host_tier pool(l, nblocks);
  testing::fill_random(pool, 5);
  std::vector<std::uint32_t> all(nblocks);
  for (std::uint32_t b = 0; b < nblocks; ++b) {
    all[b] = b;
  }
  const std::vector<std::uint32_t> scattered{33, 2, 17, 16, 5, 39, 4, 31};
  for (const cpu_isa isa : {cpu_isa::scalar, cpu_isa::avx2, cpu_isa::avx512}) {
    if (!isa_supported(isa)) {
      continue;
    }
    oasiskv::testing::note_path("score kernels: " + std::string(to_string(isa)));
    CAPTURE(static_cast<int>(isa));
    minmax_summary<Storage> s(l, nblocks, isa);
    for (std::uint32_t b = 0; b < nblocks; ++b) {
      s.update(b, pool.slot_data(b), 0, b % 7 == 3 ? 5 : 16);
    }
    for (std::uint32_t n = 1; n <= 13; ++n) {
      CAPTURE(n);
      std::vector<float> q = random_queries(n, l.head_dim, 100 + n, 0.0f);
      for (std::uint32_t r = 0; r < n; ++r) {
        // Within any group of <= 4 consecutive rows, dimension x < 16 is negative exactly in
        // the rows whose bit (row mod 4) of x is set: every pattern of the group appears.
        for (std::uint32_t x = 0; x < 16; ++x) {
          const float m = std::abs(q[r * l.head_dim + x]) + 0.25f;
          q[r * l.head_dim + x] = ((x >> (r % 4)) & 1u) != 0 ? -m : m;
        }
        q[r * l.head_dim + 16 + r % 8] = 0.0f;
        q[r * l.head_dim + 24 + r % 8] = -0.0f;
      }
      const std::vector<std::uint32_t>* const id_lists[] = {&all, &scattered};
      for (const auto* ids : id_lists) {
        const auto got = scores(s, 1, *ids, q, n);
        for (std::size_t i = 0; i < ids->size(); ++i) {
          const std::vector<Storage> bd = s.bounds(1, (*ids)[i]);
          for (std::uint32_t r = 0; r < n; ++r) {
            double ref = 0.0, mag = 0.0;
            for (std::uint32_t x = 0; x < l.head_dim; ++x) {
              const double qx = q[r * l.head_dim + x];
              const double b = cpu::detail::widen(bd[(qx < 0.0 ? l.head_dim : 0) + x]);
              ref += qx * b;
              mag += std::abs(qx * b);
            }
            CHECK(std::abs(got[i * n + r] - ref) <= 1e-6 * mag + 1e-6);
          }
        }
      }
    }
  }
}

TEST_CASE("minmax_summary: an overflowed minimum does not spoil a positive query's bound") {
  // A key of -1e6 stores an infinite f16 minimum in dimension 0. A row positive there meets
  // only the maximum: its bound stays finite on every path; a negative row meets -inf: +inf.
  const kv_layout l{1, 1, 1, 8, 4, dtype::f32};
  host_tier pool(l, 1);
  std::memset(pool.slot_data(0), 0, l.block_bytes());
  float* k = reinterpret_cast<float*>(pool.slot_data(0));
  k[0] = -1e6f;
  k[8] = 2.0f;  // the second token: dimension 0's maximum is 2
  for (const cpu_isa isa : {cpu_isa::scalar, cpu_isa::avx2, cpu_isa::avx512}) {
    if (!isa_supported(isa)) {
      continue;
    }
    oasiskv::testing::note_path("score kernels: " + std::string(to_string(isa)));
    CAPTURE(static_cast<int>(isa));
    minmax_summary<f16> s(l, 1, isa);
    s.update(0, pool.slot_data(0), 0, 2);
    const std::vector<std::uint32_t> ids{0};
    std::vector<float> q(16, 0.0f), out(2);
    q[0] = 1.5f;   // row 0: meets the maximum, 2
    q[8] = -1.0f;  // row 1: meets the infinite minimum
    s.score(0, ids, q.data(), 2, out.data());
    CHECK(out[0] == 3.0f);
    CHECK(out[1] == std::numeric_limits<float>::infinity());
  }
}

TEST_CASE("quantized_minmax_summary: an upper bound of every token's dot product, on every path") {
  for (const dtype dt : all_dtypes) {
    for (const std::uint32_t d : {24u, 64u, 128u}) {
      CAPTURE(to_string(dt));
      CAPTURE(d);
      const kv_layout l{1, 6, 3, d, 16, dt};
      const std::uint32_t nblocks = 40;  // three tiles, the last partial
      host_tier pool(l, nblocks);
      testing::fill_random(pool, d + 9);
      for (const cpu_isa isa : {cpu_isa::scalar, cpu_isa::avx512}) {
        if (!isa_supported(isa)) {
          continue;
        }
        oasiskv::testing::note_path("score kernels: " + std::string(to_string(isa)));
        quantized_minmax_summary s(l, nblocks, isa);
        minmax_summary<float> exact(l, nblocks);
        std::vector<std::uint32_t> fill(nblocks), ids(nblocks);
        for (std::uint32_t b = 0; b < nblocks; ++b) {
          fill[b] = b < 3 ? 1 : (b % 5 == 0 ? 9 : 16);
          s.update(b, pool.slot_data(b), 0, fill[b]);
          exact.update(b, pool.slot_data(b), 0, fill[b]);
          ids[b] = b;
        }
        const std::uint32_t n = 7;
        std::vector<float> q = random_queries(n, d, d);
        q[3] = 1e-30f;  // tiny and huge query elements: the query rounding's slack must cover
        q[d + 1] = -3e4f;
        for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
          const auto bound = scores(s, h, ids, q, n);
          const auto tight = scores(exact, h, ids, q, n);
          for (std::uint32_t b = 0; b < nblocks; ++b) {
            for (std::uint32_t r = 0; r < n; ++r) {
              double best = -1e300, mag = 0.0;
              for (std::uint32_t t = 0; t < fill[b]; ++t) {
                const auto k = key_of(pool, b, h, t);
                double dot = 0.0;
                for (std::uint32_t x = 0; x < d; ++x) {
                  dot += double{q[r * d + x]} * k[x];
                  mag += std::abs(double{q[r * d + x]} * k[x]);
                }
                best = std::max(best, dot);
              }
              const double got = bound[b * n + r];
              const double slack = 1e-5 * mag / fill[b] + 1e-6;  // f32 rounding
              CHECK(got >= best - slack);
              CHECK(got >= tight[b * n + r] - slack);  // never below the exact min/max bound
            }
          }
        }
      }
    }
  }
}

TEST_CASE("quantized_minmax_summary: norm is ||A||_2 of the bounds rounded up; overflowed") {
  const kv_layout l{1, 4, 2, 64, 16, dtype::f32};
  host_tier pool(l, 3);
  testing::fill_random(pool, 17);
  // Entry 2 holds an infinite key in KV head 1.
  reinterpret_cast<float*>(pool.slot_data(2) + l.key_offset(1))[5] =
      std::numeric_limits<float>::infinity();
  quantized_minmax_summary s(l, 3);
  for (std::uint32_t b = 0; b < 3; ++b) {
    CHECK(s.norm(0, b) == 0.0f);
    CHECK(!s.overflowed(b));
  }
  s.update(0, pool.slot_data(0), 0, 16);
  s.update(2, pool.slot_data(2), 0, 16);
  std::vector<float> hi(l.head_dim), lo(l.head_dim);
  for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
    for (const std::uint32_t b : {0u, 2u}) {
      CAPTURE(h);
      CAPTURE(b);
      s.bounds(h, b, hi.data(), lo.data());
      double sq = 0.0;
      for (std::uint32_t x = 0; x < l.head_dim; ++x) {
        const double a = std::max(std::abs(double{hi[x]}), std::abs(double{lo[x]}));
        sq += a * a;
      }
      const double want = std::sqrt(sq);
      const float got = s.norm(h, b);
      CHECK(double{got} >= want);                                    // rounded up
      CHECK(double{std::nextafter(got, 0.0f)} < want * (1 + 1e-9));  // by about one step
    }
  }
  CHECK(!s.overflowed(0));
  CHECK(s.overflowed(2));
  CHECK(s.norm(0, 1) == 0.0f);  // still empty
  s.reset(2);
  CHECK(!s.overflowed(2));
  CHECK(s.norm(1, 2) == 0.0f);
  expect_error([&] { (void)s.norm(0, 3); }, errc::out_of_range, "entry 3");
  expect_error([&] { (void)s.norm(2, 0); }, errc::out_of_range, "kv head 2");
  expect_error([&] { (void)s.overflowed(5); }, errc::out_of_range, "entry 5");
}

TEST_CASE("minmax_summary: a key beyond f16 range scores +inf, never NaN") {
  const kv_layout l{1, 1, 1, 8, 4, dtype::f32};
  host_tier pool(l, 1);
  std::memset(pool.slot_data(0), 0, l.block_bytes());
  reinterpret_cast<float*>(pool.slot_data(0))[0] = 1e6f;
  minmax_summary<f16> s(l, 1);
  s.update(0, pool.slot_data(0), 0, 1);
  std::vector<float> q(8, 0.0f), out(1);  // q[0] = 0 meets the infinite maximum
  const std::vector<std::uint32_t> ids{0};
  s.score(0, ids, q.data(), 1, out.data());
  CHECK(out[0] == std::numeric_limits<float>::infinity());
  q[0] = 1.0f;
  s.score(0, ids, q.data(), 1, out.data());
  CHECK(out[0] == std::numeric_limits<float>::infinity());
  minmax_summary<bf16> wide(l, 1);  // bf16 has f32's range: the bound stays finite
  wide.update(0, pool.slot_data(0), 0, 1);
  wide.score(0, ids, q.data(), 1, out.data());
  CHECK(out[0] >= 1e6f);
  CHECK(out[0] < 1.01e6f);
}

TEST_CASE("mean_summary: the dot product with the mean key") {
  for (const dtype dt : all_dtypes) {
    CAPTURE(to_string(dt));
    const kv_layout l{1, 4, 2, 64, 16, dt};
    host_tier pool(l, 4);
    testing::fill_random(pool, 21);
    mean_summary s(l, 4);
    const std::uint32_t fill[4] = {16, 3, 16, 1};
    for (std::uint32_t b = 0; b < 4; ++b) {
      s.update(b, pool.slot_data(b), 0, fill[b]);
    }
    const std::vector<float> q = random_queries(3, 64, 8);
    const std::vector<std::uint32_t> ids{3, 2, 1, 0};
    for (std::uint32_t h = 0; h < 2; ++h) {
      const auto got = scores(s, h, ids, q, 3);
      for (std::size_t i = 0; i < ids.size(); ++i) {
        const std::uint32_t b = ids[i];
        for (std::uint32_t r = 0; r < 3; ++r) {
          double want = 0.0;
          for (std::uint32_t t = 0; t < fill[b]; ++t) {
            const auto k = key_of(pool, b, h, t);
            for (std::uint32_t x = 0; x < 64; ++x) {
              want += double{q[r * 64 + x]} * k[x] / fill[b];
            }
          }
          CHECK(got[i * 3 + r] == doctest::Approx(want).epsilon(1e-4).scale(1.0));
        }
      }
    }
    expect_error([&] { s.update(1, pool.slot_data(1), 0, 14); }, errc::out_of_range,
                 "would hold 17 tokens");
  }
}

TEST_CASE("softmax row kernels: every path clamps, exponentiates and accumulates alike") {
  // The passes the softmax-mass aggregation makes over each query row: clamp_finite_max, then
  // exp_sum, then add_scaled. Each vector path against a double reference, at every length up
  // to two vectors past the widest unroll (tails included), with NaN and infinities mixed in.
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  constexpr float lim = std::numeric_limits<float>::max();
  for (std::size_t count = 0; count <= 70; ++count) {
    CAPTURE(count);
    std::vector<float> x(count);
    for (float& v : x) {
      const auto c = rng() % 30;
      v = c == 0   ? std::numeric_limits<float>::quiet_NaN()
          : c == 1 ? std::numeric_limits<float>::infinity()
          : c == 2 ? -std::numeric_limits<float>::infinity()
                   : normal(rng);
    }
    std::vector<float> want_clamped(count);
    float want_max = -lim;
    for (std::size_t i = 0; i < count; ++i) {
      want_clamped[i] = std::isnan(x[i]) ? lim : std::clamp(x[i], -lim, lim);
      want_max = std::max(want_max, want_clamped[i]);
    }
    // exp_sum's input: finite and at most the maximum, as the aggregation passes it.
    std::vector<float> finite(count);
    for (std::size_t i = 0; i < count; ++i) {
      finite[i] = std::isfinite(x[i]) ? x[i] : -20.0f;
    }
    const float m = count == 0 ? 0.0f : *std::max_element(finite.begin(), finite.end());
    const float scale = 0.125f;
    double want_sum = 0.0;
    std::vector<double> want_exp(count);
    for (std::size_t i = 0; i < count; ++i) {
      want_exp[i] = std::exp(double{scale} * (double{finite[i]} - m));
      want_sum += want_exp[i];
    }
    std::vector<float> acc0(count);
    for (float& v : acc0) {
      v = normal(rng);
    }
    const float k = 0.37f;

    auto check_path = [&](const char* path, auto clamp_max, auto exp_sum, auto add_scaled) {
      CAPTURE(path);
      std::vector<float> clamped(count + 1, 123.0f);  // one past the end: must stay untouched
      CHECK(clamp_max(x.data(), count, clamped.data()) == want_max);
      for (std::size_t i = 0; i < count; ++i) {
        CHECK(clamped[i] == want_clamped[i]);
      }
      CHECK(clamped[count] == 123.0f);
      std::vector<float> e(count + 1, 123.0f);
      const float sum = exp_sum(finite.data(), m, count, scale, e.data());
      CHECK(sum == doctest::Approx(want_sum).epsilon(1e-5));
      for (std::size_t i = 0; i < count; ++i) {
        CHECK(e[i] == doctest::Approx(want_exp[i]).epsilon(1e-6));
      }
      CHECK(e[count] == 123.0f);
      std::vector<float> acc = acc0;
      acc.push_back(123.0f);
      add_scaled(acc.data(), e.data(), k, count);
      for (std::size_t i = 0; i < count; ++i) {
        CHECK(acc[i] == doctest::Approx(acc0[i] + k * want_exp[i]).epsilon(1e-6));
      }
      CHECK(acc[count] == 123.0f);
    };
    check_path("dispatched", cpu::detail::clamp_finite_max, cpu::detail::exp_sum,
               [](float* a, const float* v, float f, std::size_t c) {
                 cpu::detail::add_scaled(a, v, f, c);
               });
#if OASISKV_X86_KERNELS
    if (isa_supported(cpu_isa::avx2)) {
      oasiskv::testing::note_path("softmax helpers: avx2");
      check_path("avx2", cpu::detail::clamp_finite_max_avx2, cpu::detail::exp_sum_avx2,
                 cpu::detail::add_scaled_avx2);
    }
    if (isa_supported(cpu_isa::avx512)) {
      oasiskv::testing::note_path("softmax helpers: avx512");
      check_path("avx512", cpu::detail::clamp_finite_max_avx512, cpu::detail::exp_sum_avx512,
                 cpu::detail::add_scaled_avx512);
    }
#endif
  }
}

TEST_CASE("entry id stats: the largest id and the consecutive steps, on every path") {
  // What check_entry_ids and the predictors' capacity checks read: a wrong maximum would let an
  // out-of-range id through, a wrong count would score ids as one run that are not.
  std::mt19937 rng(23);
  for (int trial = 0; trial < 400; ++trial) {
    const std::size_t n = 1 + rng() % 70;
    std::vector<std::uint32_t> ids(n);
    std::uint32_t next = rng() % 1000;
    for (std::uint32_t& id : ids) {  // runs of consecutive ids, jumps, repeats, huge ids
      const auto c = rng() % 10;
      id = c < 6 ? next : c < 8 ? rng() % 1000 : c < 9 ? 0xffffffffu - rng() % 3 : next - 1;
      next = id + 1;
    }
    if (trial % 5 == 0) {
      std::iota(ids.begin(), ids.end(), rng() % 1000);  // wholly consecutive
    }
    cpu::detail::entry_id_stats want;
    for (std::size_t i = 0; i < n; ++i) {
      want.top = std::max(want.top, ids[i]);
      want.steps += i > 0 && ids[i] == ids[i - 1] + 1 ? 1u : 0u;
    }
    CAPTURE(n);
    const cpu::detail::entry_id_stats got = cpu::detail::entry_id_stats_of(ids);
    CHECK(got.top == want.top);
    CHECK(got.steps == want.steps);
    const cpu::detail::entry_id_stats s = cpu::detail::entry_id_stats_scalar(ids);
    CHECK(s.top == want.top);
    CHECK(s.steps == want.steps);
#if OASISKV_X86_KERNELS
    if (isa_supported(cpu_isa::avx512)) {
      const cpu::detail::entry_id_stats v = cpu::detail::entry_id_stats_avx512(ids);
      CHECK(v.top == want.top);
      CHECK(v.steps == want.steps);
    }
#endif
    const bool contiguous = want.steps + 1 == n;
    if (want.top < 0xffffffffu) {
      CHECK(cpu::detail::check_entry_ids(ids, want.top + 1, "t") == contiguous);
    }
    expect_error([&] { cpu::detail::check_entry_ids(ids, want.top, "t"); }, errc::out_of_range,
                 ">= capacity");
  }
}
