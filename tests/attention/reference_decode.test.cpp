// SPDX-License-Identifier: Apache-2.0
#include <doctest/doctest.h>

#include "support/expect_error.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "oasiskv/attention/reference_decode.hpp"
#include "support/kv_fixture.hpp"

using namespace oasiskv;
using oasiskv::testing::decode_case;
using oasiskv::testing::make_decode_case;
using oasiskv::testing::max_rel_error;
using oasiskv::testing::pick;

namespace {
using oasiskv::testing::expect_error;

float* key_row(host_tier& t, slot_id s, std::uint32_t h, std::uint32_t tok) {
  const kv_layout& l = t.layout();
  return reinterpret_cast<float*>(t.slot_data(s) + l.key_offset(h) + tok * l.row_bytes());
}
float* value_row(host_tier& t, slot_id s, std::uint32_t h, std::uint32_t tok) {
  const kv_layout& l = t.layout();
  return reinterpret_cast<float*>(t.slot_data(s) + l.value_offset(h) + tok * l.row_bytes());
}
}  // namespace

TEST_CASE("reference_decode: two tokens by hand") {
  const kv_layout l{1, 1, 1, 8, 4, dtype::f32};
  host_tier pool(l, 1);
  std::memset(pool.slot_data(0), 0, l.block_bytes());
  key_row(pool, 0, 0, 0)[0] = 1.0f;  // score q.k = 2 * scale
  key_row(pool, 0, 0, 1)[1] = 1.0f;  // score 0
  for (int x = 0; x < 8; ++x) {
    value_row(pool, 0, 0, 0)[x] = 1.0f;
    value_row(pool, 0, 0, 1)[x] = static_cast<float>(x);
  }
  std::vector<float> q(8, 0.0f), out(8), lse(1);
  q[0] = 2.0f;
  const block_ref ref{0, 0};
  const std::uint32_t offsets[2] = {0, 1};
  const std::uint32_t len = 2;
  decode_params p{q.data(), pool.view(), {&ref, offsets, 1, 1}, &len, out.data(), lse.data(), 1,
                  1,        0.5f};
  reference_decode{}.decode(p);
  const double w0 = std::exp(1.0) / (std::exp(1.0) + 1.0), w1 = 1.0 - w0;
  for (int x = 0; x < 8; ++x) {
    CHECK(out[x] == doctest::Approx(w0 * 1.0 + w1 * x).epsilon(1e-6));
  }
  CHECK(lse[0] == doctest::Approx(std::log(std::exp(1.0) + 1.0)).epsilon(1e-6));
}

TEST_CASE("reference_decode: query j of a multi-token step equals a 1-token step at its position") {
  for (dtype t : {dtype::f32, dtype::f16, dtype::bf16}) {
    const kv_layout l{1, 8, 2, 16, 4, t};
    const std::uint32_t q_len = 5, len = 23;
    decode_case c = make_decode_case(l, {len}, q_len, false, pick::all, 7);
    reference_decode{}.decode(c.params());
    for (std::uint32_t j = 0; j < q_len; ++j) {
      // The same blocks, the sequence cut just after query j, with only query j.
      const std::uint32_t cut = len - q_len + j + 1;
      std::vector<block_ref> refs;
      for (auto r : c.refs) {
        if (r.index < l.blocks_for(cut)) {
          refs.push_back(r);
        }
      }
      const std::uint32_t offsets[2] = {0, static_cast<std::uint32_t>(refs.size())};
      std::vector<float> q1(c.q.begin() + j * l.num_q_heads * l.head_dim,
                            c.q.begin() + (j + 1) * l.num_q_heads * l.head_dim);
      std::vector<float> out1(q1.size()), lse1(l.num_q_heads);
      decode_params p = c.params();
      p.q = q1.data();
      p.table = {refs.data(), offsets, 1, 1};
      p.seq_lens = &cut;
      p.out = out1.data();
      p.lse = lse1.data();
      p.q_len = 1;
      reference_decode{}.decode(p);
      for (std::size_t i = 0; i < q1.size(); ++i) {
        REQUIRE(out1[i] == c.out[j * q1.size() + i]);
      }
      for (std::uint32_t h = 0; h < l.num_q_heads; ++h) {
        REQUIRE(lse1[h] == c.lse[j * l.num_q_heads + h]);
      }
    }
  }
}

TEST_CASE("reference_decode: GQA reads KV head h / group_size") {
  // The same KV, once as 2 KV heads for 6 q heads and once duplicated as 6 KV heads (MHA).
  const kv_layout gqa{1, 6, 2, 8, 4, dtype::f32};
  const kv_layout mha{1, 6, 6, 8, 4, dtype::f32};
  decode_case g = make_decode_case(gqa, {10}, 2, false, pick::all, 3);
  decode_case m = make_decode_case(mha, {10}, 2, false, pick::all, 3);
  m.q = g.q;
  m.refs = g.refs;  // slots were assigned identically: the same seed and block count
  for (slot_id s = 0; s < g.pool.num_slots(); ++s) {
    for (std::uint32_t h = 0; h < 6; ++h) {
      std::memcpy(m.pool.slot_data(s) + mha.key_offset(h),
                  g.pool.slot_data(s) + gqa.key_offset(h / 3), gqa.head_bytes());
      std::memcpy(m.pool.slot_data(s) + mha.value_offset(h),
                  g.pool.slot_data(s) + gqa.value_offset(h / 3), gqa.head_bytes());
    }
  }
  reference_decode{}.decode(g.params());
  reference_decode{}.decode(m.params());
  CHECK(g.out == m.out);
  CHECK(g.lse == m.lse);
}

TEST_CASE("reference_decode: table order does not matter; disjoint halves merge by LSE") {
  const kv_layout l{1, 4, 2, 16, 8, dtype::bf16};
  decode_case c = make_decode_case(l, {77}, 1, false, pick::all, 11);
  reference_decode{}.decode(c.params());
  // Reversed table.
  decode_case r = make_decode_case(l, {77}, 1, false, pick::all, 11);
  std::reverse(r.refs.begin(), r.refs.end());
  reference_decode{}.decode(r.params());
  CHECK(max_rel_error(r.out, c.out) < 1e-6);
  // Two halves, merged: out = (e^lse1 out1 + e^lse2 out2) / (e^lse1 + e^lse2).
  const std::size_t half = c.refs.size() / 2;
  decode_case a = make_decode_case(l, {77}, 1, false, pick::all, 11);
  decode_case b = make_decode_case(l, {77}, 1, false, pick::all, 11);
  a.refs.resize(half);
  a.offsets = {0, static_cast<std::uint32_t>(half)};
  b.refs.erase(b.refs.begin(), b.refs.begin() + static_cast<long>(half));
  b.offsets = {0, static_cast<std::uint32_t>(b.refs.size())};
  reference_decode{}.decode(a.params());
  reference_decode{}.decode(b.params());
  for (std::uint32_t h = 0; h < l.num_q_heads; ++h) {
    const double m = std::max(a.lse[h], b.lse[h]);
    const double wa = std::exp(a.lse[h] - m), wb = std::exp(b.lse[h] - m);
    CHECK(m + std::log(wa + wb) == doctest::Approx(c.lse[h]).epsilon(1e-6));
    for (std::uint32_t x = 0; x < l.head_dim; ++x) {
      const std::size_t i = h * l.head_dim + x;
      CHECK((wa * a.out[i] + wb * b.out[i]) / (wa + wb) == doctest::Approx(c.out[i]).epsilon(1e-5));
    }
  }
}

TEST_CASE("reference_decode: per-KV-head tables select per head") {
  const kv_layout l{1, 4, 2, 8, 4, dtype::f32};
  decode_case per = make_decode_case(l, {30}, 1, true, pick::random_subset, 5);
  reference_decode{}.decode(per.params());
  // Each KV head's half of the output equals a shared-table call with that head's table.
  for (std::uint32_t kvh = 0; kvh < 2; ++kvh) {
    decode_case shared = make_decode_case(l, {30}, 1, true, pick::random_subset, 5);
    std::vector<block_ref> refs(per.refs.begin() + per.offsets[kvh],
                                per.refs.begin() + per.offsets[kvh + 1]);
    shared.refs = refs;
    shared.offsets = {0, static_cast<std::uint32_t>(refs.size())};
    shared.tables_per_seq = 1;
    reference_decode{}.decode(shared.params());
    for (std::uint32_t h = kvh * 2; h < kvh * 2 + 2; ++h) {
      for (std::uint32_t x = 0; x < 8; ++x) {
        CHECK(shared.out[h * 8 + x] == per.out[h * 8 + x]);
      }
    }
  }
}

TEST_CASE("reference_decode: a query that sees no token gets zeros and -inf") {
  const kv_layout l{1, 1, 1, 8, 4, dtype::f32};
  decode_case c = make_decode_case(l, {8}, 2, false, pick::all, 1);
  // Only block 0 (tokens 0-3) listed; both queries are at positions 6 and 7 and see tokens 0-3.
  c.refs = {c.refs[0].index == 0 ? c.refs[0] : c.refs[1]};
  c.offsets = {0, 1};
  REQUIRE_NOTHROW(reference_decode{}.decode(c.params()));
  CHECK(std::isfinite(c.lse[0]));
  // A 1-token sequence whose table lists nothing it can see is impossible to build (block 0
  // holds the token), so the -inf path shows with a block that starts after the query.
  decode_case d = make_decode_case(l, {8}, 8, false, pick::all, 1);
  d.refs = {d.refs[0].index == 1 ? d.refs[0] : d.refs[1]};  // block 1: tokens 4-7
  d.offsets = {0, 1};
  reference_decode{}.decode(d.params());
  CHECK(d.lse[0] == -std::numeric_limits<float>::infinity());  // query 0 at position 0
  CHECK(d.out[0] == 0.0f);
  CHECK(std::isfinite(d.lse[4]));  // query 4 at position 4 sees token 4
}

TEST_CASE("decode_params validation: every bad input names its value") {
  const kv_layout l{1, 4, 2, 8, 4, dtype::f16};
  decode_case c = make_decode_case(l, {10, 5}, 2, false, pick::all, 9);
  reference_decode k;
  REQUIRE_NOTHROW(k.decode(c.params()));
  auto with = [&](auto mutate) {
    decode_params p = c.params();
    mutate(p);
    return p;
  };
  expect_error([&] { k.decode(with([](decode_params& p) { p.q = nullptr; })); },
               errc::invalid_argument, "decode_params.q is null");
  expect_error(
      [&] {
        k.decode(with([](decode_params& p) {
          p.out = reinterpret_cast<float*>(reinterpret_cast<char*>(p.out) + 1);
        }));
      },
      errc::misaligned, "decode_params.out");
  expect_error([&] { k.decode(with([](decode_params& p) { p.q_len = 0; })); },
               errc::invalid_argument, "q_len = 0");
  expect_error([&] { k.decode(with([](decode_params& p) { p.q_len = 17; })); },
               errc::invalid_argument, "q_len = 17");
  expect_error([&] { k.decode(with([](decode_params& p) { p.num_seqs = 3; })); },
               errc::invalid_argument, "num_seqs = 3");
  expect_error([&] { k.decode(with([](decode_params& p) { p.table.tables_per_seq = 3; })); },
               errc::invalid_argument, "tables_per_seq = 3");
  expect_error(
      [&] {
        k.decode(with([](decode_params& p) { p.scale = std::numeric_limits<float>::quiet_NaN(); }));
      },
      errc::invalid_argument, "scale = nan");
  expect_error([&] { k.decode(with([](decode_params& p) { p.pool.layout.num_kv_heads = 3; })); },
               errc::invalid_layout, "num_q_heads = 4 is not a multiple of num_kv_heads = 3");
  std::uint32_t short_lens[2] = {10, 1};
  expect_error([&] { k.decode(with([&](decode_params& p) { p.seq_lens = short_lens; })); },
               errc::invalid_argument, "seq_lens[1] = 1 is shorter than q_len = 2");
  // Table contents.
  auto saved = c.refs;
  c.refs[0].slot = 1000;
  expect_error([&] { k.decode(c.params()); }, errc::invalid_slot, "slot 1000 is outside the pool");
  c.refs = saved;
  c.refs[0].index = 3;  // sequence 0 has 10 tokens: blocks 0-2
  expect_error([&] { k.decode(c.params()); }, errc::out_of_range,
               "block 3 is past the end of sequence 0 (10 tokens, 3 blocks)");
  c.refs = saved;
  c.refs[1] = c.refs[0];
  expect_error([&] { k.decode(c.params()); }, errc::invalid_argument, "twice");
  c.refs = saved;
  auto saved_offsets = c.offsets;
  c.offsets[1] = 0;  // sequence 0's table empty
  expect_error([&] { k.decode(c.params()); }, errc::invalid_argument,
               "block table 0 (sequence 0, kv head 0) is empty");
  c.offsets = saved_offsets;
  c.offsets[2] = c.offsets[1] - 1;
  expect_error([&] { k.decode(c.params()); }, errc::invalid_argument,
               "offsets decrease at table 1");
}
