// SPDX-License-Identifier: Apache-2.0
// cpu::sparse_decode against reference_decode: every dtype x head dim x GQA ratio x block fill x
// table granularity x code path x thread count, multi-token queries, batches, LSE merging, bad
// input, and the thread pool it runs on.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <thread>
#include <vector>

#include "oasiskv/attention/cpu_sparse_decode.hpp"
#include "oasiskv/attention/reference_decode.hpp"
#include "support/kv_fixture.hpp"
#include "support/paths.hpp"

namespace {

using namespace oasiskv;
using oasiskv::testing::decode_case;
using oasiskv::testing::make_decode_case;
using oasiskv::testing::pick;

kv_layout make_layout(dtype t, std::uint32_t head_dim, std::uint32_t kv_heads, std::uint32_t ratio,
                      std::uint32_t tokens_per_block = 16) {
  kv_layout l;
  l.num_layers = 1;
  l.num_kv_heads = kv_heads;
  l.num_q_heads = kv_heads * ratio;
  l.head_dim = head_dim;
  l.tokens_per_block = tokens_per_block;
  l.kv_dtype = t;
  return l;
}

double tolerance(dtype t) {
  return t == dtype::f32 ? 1e-5 : 2e-3;
}

struct result {
  std::vector<float> out, lse;
};

result run(const cpu::sparse_decode& k, decode_case& c) {
  oasiskv::testing::note_path("cpu::sparse_decode: " + std::string(to_string(k.isa())));
  std::fill(c.out.begin(), c.out.end(), 7.0f);  // a value no kernel writes by accident
  std::fill(c.lse.begin(), c.lse.end(), 7.0f);
  k.decode(c.params());
  return {c.out, c.lse};
}

result run_reference(decode_case& c) {
  reference_decode{}.decode(c.params());
  return {c.out, c.lse};
}

void check_close(const result& got, const result& want, double tol) {
  CHECK(oasiskv::testing::max_rel_error(got.out, want.out) <= tol);
  CHECK(oasiskv::testing::max_rel_error(got.lse, want.lse) <= tol);
}

// Every code path this machine runs, at 1 and 2 threads.
struct kernels {
  std::vector<cpu::sparse_decode> all;
  kernels() {
    for (cpu_isa isa : {cpu_isa::scalar, cpu_isa::avx2, cpu_isa::avx512}) {
      if (isa_supported(isa)) {
        all.emplace_back(1u, isa);
        all.emplace_back(2u, isa);
      }
    }
  }
};

const kernels& every_kernel() {
  static const kernels k;
  return k;
}

template <class T>
void check_matrix(std::vector<std::uint32_t> seq_lens, std::uint32_t q_len) {
  const dtype t = dtype_of<T>;
  std::uint32_t seed = 1;
  for (std::uint32_t d : {64u, 128u, 8u, 96u}) {
    for (std::uint32_t ratio : {1u, 3u, 4u}) {
      for (bool per_head : {false, true}) {
        for (pick mode : {pick::all, pick::random_subset}) {
          const kv_layout l = make_layout(t, d, 2, ratio);
          decode_case c = make_decode_case(l, seq_lens, q_len, per_head, mode, seed++);
          const result want = run_reference(c);
          for (const cpu::sparse_decode& k : every_kernel().all) {
            CAPTURE(to_string(t));
            CAPTURE(d);
            CAPTURE(ratio);
            CAPTURE(per_head);
            CAPTURE(mode == pick::all);
            CAPTURE(to_string(k.isa()));
            CAPTURE(k.threads());
            check_close(run(k, c), want, tolerance(t));
          }
        }
      }
    }
  }
}

}  // namespace

TEST_CASE_TEMPLATE("sparse_decode matches reference_decode on one-token queries", T, float, f16,
                   bf16) {
  SUBCASE("partial last block") {
    check_matrix<T>({37}, 1);
  }
  SUBCASE("whole blocks") {
    check_matrix<T>({48}, 1);
  }
  SUBCASE("a sequence of one token") {
    check_matrix<T>({1}, 1);
  }
  SUBCASE("a single block") {
    check_matrix<T>({16}, 1);
  }
  SUBCASE("a batch of sequences") {
    check_matrix<T>({5, 64, 33, 100}, 1);
  }
}

TEST_CASE_TEMPLATE("sparse_decode matches reference_decode on multi-token queries", T, float, f16,
                   bf16) {
  SUBCASE("q_len 2") {
    check_matrix<T>({40, 17}, 2);
  }
  SUBCASE("q_len 5") {
    check_matrix<T>({21, 80}, 5);
  }
  SUBCASE("q_len 16, one sequence exactly 16 long") {
    check_matrix<T>({16, 50}, 16);
  }
}

TEST_CASE("sparse_decode is causal across blocks smaller than the query window") {
  for (std::uint32_t tpb : {1u, 4u, 5u}) {
    for (std::uint32_t q_len : {3u, 9u, 16u}) {
      const kv_layout l = make_layout(dtype::f16, 128, 2, 4, tpb);
      decode_case c = make_decode_case(l, {q_len + 7, 61}, q_len, true, pick::random_subset, tpb);
      const result want = run_reference(c);
      for (const cpu::sparse_decode& k : every_kernel().all) {
        CAPTURE(tpb);
        CAPTURE(q_len);
        CAPTURE(to_string(k.isa()));
        check_close(run(k, c), want, tolerance(dtype::f16));
      }
    }
  }
}

TEST_CASE_TEMPLATE("sparse_decode covers every row tiling and key-tile shape", T, float, f16,
                   bf16) {
  // Rows (q_len x group) of 1-9, 12, 16 and 48 make every tile of up to 4 rows and mixes of
  // query tokens within a tile; blocks of 1, 5, 16, 20 and 32 tokens make partial, whole, whole
  // then partial, and two whole 16-key steps per block; lengths leave a partial last block.
  const dtype t = dtype_of<T>;
  const std::uint32_t shapes[][2] = {{1, 1}, {2, 1}, {3, 1}, {4, 1},  {5, 1}, {3, 2},
                                     {8, 1}, {3, 3}, {4, 3}, {1, 16}, {3, 16}};
  std::uint32_t seed = 100;
  for (std::uint32_t d : {64u, 128u}) {
    for (std::uint32_t tpb : {1u, 5u, 16u, 20u, 32u}) {
      for (const auto& sh : shapes) {
        const std::uint32_t ratio = sh[0];
        const std::uint32_t q_len = sh[1];
        const bool per_head = seed % 2 == 0;
        const kv_layout l = make_layout(t, d, 3, ratio, tpb);
        decode_case c = make_decode_case(l, {tpb * 3 + 2 + q_len, q_len + 1}, q_len, per_head,
                                         pick::random_subset, seed++);
        const result want = run_reference(c);
        for (const cpu::sparse_decode& k : every_kernel().all) {
          CAPTURE(to_string(t));
          CAPTURE(d);
          CAPTURE(tpb);
          CAPTURE(ratio);
          CAPTURE(q_len);
          CAPTURE(to_string(k.isa()));
          CAPTURE(k.threads());
          check_close(run(k, c), want, tolerance(t));
        }
      }
    }
  }
}

TEST_CASE("the online softmax stays exact when scores jump between blocks") {
  // Keys of block b are scaled by b + 1, so with a large scale each block's scores exceed the
  // previous block's by far more than the kernels' rescale slack; tables list the blocks in
  // rising, falling and shuffled order, so the running max is raised on every block, only on the
  // first, or anywhere in between.
  for (std::uint32_t d : {64u, 128u}) {
    for (float scale_mul : {4.0f, 40.0f}) {
      for (int order = 0; order < 3; ++order) {
        const kv_layout l = make_layout(dtype::f32, d, 2, 3);
        decode_case c = make_decode_case(l, {16 * 12 + 3}, 2, false, pick::all, 7 + order);
        c.scale *= scale_mul;
        const block_pool_view v = c.pool.view();
        for (const block_ref& r : c.refs) {
          auto* k = reinterpret_cast<float*>(v.slot(r.slot));  // keys of both heads come first
          for (std::size_t i = 0; i < std::size_t{l.num_kv_heads} * 16 * d; ++i) {
            k[i] *= static_cast<float>(r.index + 1);
          }
        }
        std::sort(c.refs.begin(), c.refs.end(), [&](const block_ref& a, const block_ref& b) {
          return order == 0 ? a.index < b.index : a.index > b.index;
        });
        if (order == 2) {
          std::swap(c.refs[3], c.refs[9]);
          std::swap(c.refs[0], c.refs[6]);
        }
        const result want = run_reference(c);
        for (const cpu::sparse_decode& k : every_kernel().all) {
          CAPTURE(d);
          CAPTURE(scale_mul);
          CAPTURE(order);
          CAPTURE(to_string(k.isa()));
          CAPTURE(k.threads());
          const result got = run(k, c);
          for (float x : got.out) {
            REQUIRE(std::isfinite(x));
          }
          check_close(got, want, 1e-4);
        }
      }
    }
  }
}

TEST_CASE("sparse_decode splits long tables over threads and merges them exactly") {
  for (dtype t : {dtype::f32, dtype::f16}) {
    for (std::uint32_t ratio : {1u, 3u}) {
      const kv_layout l = make_layout(t, 64, 1, ratio);
      decode_case c = make_decode_case(l, {5000, 700}, 2, false, pick::random_subset, 9);
      const result want = run_reference(c);
      for (const cpu::sparse_decode& k : every_kernel().all) {
        CAPTURE(to_string(k.isa()));
        CAPTURE(k.threads());
        check_close(run(k, c), want, tolerance(t));
      }
      cpu::thread_pool pool(3);
      check_close(run(cpu::sparse_decode(pool), c), want, tolerance(t));
    }
  }
}

TEST_CASE("a query that sees no listed token gets zero output and LSE -inf") {
  // 17 tokens, 4 new ones at positions 13..16; the table lists only block 1 (token 16), which
  // only the last query token can see.
  const kv_layout l = make_layout(dtype::f32, 64, 1, 2);
  decode_case c = make_decode_case(l, {17}, 4, false, pick::all, 3);
  c.refs = {c.refs[0].index == 1 ? c.refs[0] : c.refs[1]};
  c.offsets = {0, 1};
  const result want = run_reference(c);
  for (const cpu::sparse_decode& k : every_kernel().all) {
    const result got = run(k, c);
    check_close(got, want, 1e-5);
    for (std::uint32_t r = 0; r < 3 * l.num_q_heads; ++r) {
      CHECK(got.lse[r] == -std::numeric_limits<float>::infinity());
      CHECK(got.out[r * l.head_dim] == 0.0f);
    }
    CHECK(std::isfinite(got.lse[3 * l.num_q_heads]));
  }
}

TEST_CASE("partial results over disjoint block subsets merge by LSE into the full result") {
  for (dtype t : {dtype::f32, dtype::bf16}) {
    for (std::uint32_t q_len : {1u, 4u}) {
      const kv_layout l = make_layout(t, 128, 2, 3);
      decode_case c = make_decode_case(l, {300, 45}, q_len, true, pick::all, 21);
      const cpu::sparse_decode k(1u);
      const result full = run(k, c);
      // Split every table into its even and odd entries (which hold blocks in shuffled order).
      const std::vector<block_ref> all_refs = c.refs;
      const std::vector<std::uint32_t> all_offsets = c.offsets;
      result half[2];
      for (int h = 0; h < 2; ++h) {
        c.refs.clear();
        c.offsets = {0};
        for (std::size_t tbl = 0; tbl + 1 < all_offsets.size(); ++tbl) {
          for (std::uint32_t i = all_offsets[tbl]; i < all_offsets[tbl + 1]; ++i) {
            if ((i - all_offsets[tbl]) % 2 == static_cast<std::uint32_t>(h)) {
              c.refs.push_back(all_refs[i]);
            }
          }
          c.offsets.push_back(static_cast<std::uint32_t>(c.refs.size()));
        }
        half[h] = run(k, c);
      }
      cpu::merge_partial(half[0].out.data(), half[0].lse.data(), half[1].out.data(),
                         half[1].lse.data(), half[0].lse.size(), l.head_dim);
      check_close(half[0], full, 1e-5);
    }
  }
}

TEST_CASE("sparse_decode rejects bad input with oasiskv::error before writing output") {
  const kv_layout l = make_layout(dtype::f16, 64, 2, 2);
  const cpu::sparse_decode k(2u);
  auto expect = [&](decode_case& c, decode_params p, errc code) {
    std::fill(c.out.begin(), c.out.end(), 7.0f);
    try {
      k.decode(p);
      FAIL("no error thrown");
    } catch (const oasiskv::error& e) {
      CHECK(e.code() == code);
    }
    CHECK(std::all_of(c.out.begin(), c.out.end(), [](float x) { return x == 7.0f; }));
  };
  decode_case c = make_decode_case(l, {40}, 1, true, pick::all, 5);
  SUBCASE("empty table") {
    c.offsets[1] = c.offsets[0];  // kv head 0 lists nothing
    for (std::size_t i = 1; i < c.offsets.size(); ++i) {
      c.offsets[i] = std::max(c.offsets[i], c.offsets[i - 1]);
    }
    expect(c, c.params(), errc::invalid_argument);
  }
  SUBCASE("slot out of range") {
    c.refs[0].slot = c.pool.num_slots();
    expect(c, c.params(), errc::invalid_slot);
  }
  SUBCASE("block past the end of the sequence") {
    c.refs[0].index = 3;  // 40 tokens: blocks 0..2
    expect(c, c.params(), errc::out_of_range);
  }
  SUBCASE("a sequence shorter than its listed blocks (the fill would exceed the data)") {
    c.seq_lens[0] = 20;
    expect(c, c.params(), errc::out_of_range);
  }
  SUBCASE("q heads not a multiple of kv heads") {
    decode_params p = c.params();
    p.pool.layout.num_q_heads = 3;
    expect(c, p, errc::invalid_layout);
  }
  SUBCASE("misaligned pool") {
    decode_params p = c.params();
    p.pool.base += 4;
    expect(c, p, errc::misaligned);
  }
  SUBCASE("misaligned query") {
    decode_params p = c.params();
    p.q = reinterpret_cast<const float*>(reinterpret_cast<const char*>(p.q) + 2);
    expect(c, p, errc::misaligned);
  }
  SUBCASE("q_len of 17") {
    decode_params p = c.params();
    p.q_len = 17;
    expect(c, p, errc::invalid_argument);
  }
  SUBCASE("zero threads") {
    CHECK_THROWS_AS(cpu::sparse_decode(0u), oasiskv::error);
  }
}

TEST_CASE("sparse_decode serves concurrent callers that share one pool") {
  const kv_layout l = make_layout(dtype::f16, 128, 2, 4);
  decode_case a = make_decode_case(l, {900, 33}, 1, false, pick::random_subset, 31);
  decode_case b = make_decode_case(l, {700}, 3, true, pick::random_subset, 32);
  const result want_a = run_reference(a);
  const result want_b = run_reference(b);
  cpu::thread_pool pool(2);
  const cpu::sparse_decode k(pool);
  std::vector<float> out_b(b.out.size()), lse_b(b.lse.size());
  std::thread other([&] {
    for (int i = 0; i < 20; ++i) {
      decode_params p = b.params();
      p.out = out_b.data();
      p.lse = lse_b.data();
      k.decode(p);
    }
  });
  for (int i = 0; i < 20; ++i) {
    k.decode(a.params());
  }
  other.join();
  check_close({a.out, a.lse}, want_a, 2e-3);
  check_close({out_b, lse_b}, want_b, 2e-3);
}

TEST_CASE("thread_pool runs every index once, rethrows, and nests inline") {
  for (unsigned n : {1u, 2u, 4u}) {
    cpu::thread_pool pool(n);
    CHECK(pool.size() == n);
    for (std::size_t items : {0u, 1u, 7u, 1000u}) {
      std::vector<std::atomic<int>> hits(items);
      pool.parallel_for(items, [&](std::size_t i) { hits[i].fetch_add(1); });
      for (auto& h : hits) {
        CHECK(h.load() == 1);
      }
    }
    std::atomic<int> ran{0};
    CHECK_THROWS_AS(pool.parallel_for(50,
                                      [&](std::size_t i) {
                                        ran.fetch_add(1);
                                        if (i == 13) {
                                          throw std::runtime_error("boom");
                                        }
                                      }),
                    std::runtime_error);
    CHECK(ran.load() == 50);
    std::atomic<int> inner{0};
    pool.parallel_for(
        4, [&](std::size_t) { pool.parallel_for(3, [&](std::size_t) { inner.fetch_add(1); }); });
    CHECK(inner.load() == 12);
  }
  CHECK_THROWS_AS(cpu::thread_pool(0), oasiskv::error);
  CHECK_THROWS_AS(cpu::thread_pool(2, std::chrono::nanoseconds(-1)), oasiskv::error);
}

TEST_CASE("thread_pool: loops back to back, after idle gaps, and without spinning") {
  // Back-to-back loops are picked up by spinning workers; a gap longer than the spin puts them
  // to sleep, and the next loop must wake them; spin 0 sleeps at once. Every loop must run each
  // index once and return only when all have run.
  using namespace std::chrono_literals;
  for (const auto spin : {std::chrono::nanoseconds(0), std::chrono::nanoseconds(20us)}) {
    cpu::thread_pool pool(3, spin);
    std::vector<int> counts(64, 0);
    for (int round = 0; round < 2000; ++round) {
      if (round % 250 == 0) {
        std::this_thread::sleep_for(200us);  // past the spin: the workers sleep
      }
      pool.parallel_for(counts.size(), [&](std::size_t i) { ++counts[i]; });
      REQUIRE(counts[round % counts.size()] == round + 1);  // all done when it returned
    }
    for (int c : counts) {
      CHECK(c == 2000);
    }
  }
}

// The comparison every kernel check goes through must not let a broken output pass: one NaN, one
// unmatched infinity or one element off by more than the tolerance in a real kernel's output
// makes the check fail.
TEST_CASE("the kernel checks fail on one NaN, infinity or wrong element in an output") {
  using oasiskv::testing::max_rel_error;
  const kv_layout l = make_layout(dtype::f16, 64, 2, 4);
  decode_case c = make_decode_case(l, {90, 33}, 2, true, pick::random_subset, 16);
  const result want = run_reference(c);
  const result got = run(cpu::sparse_decode{}, c);
  REQUIRE(max_rel_error(got.out, want.out) <= tolerance(dtype::f16));
  REQUIRE(max_rel_error(got.lse, want.lse) <= tolerance(dtype::f16));
  for (std::size_t at : {std::size_t{0}, got.out.size() / 2, got.out.size() - 1}) {
    CAPTURE(at);
    for (float bad :
         {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
          -std::numeric_limits<float>::infinity(), want.out[at] + 0.5f}) {
      CAPTURE(bad);
      std::vector<float> broken = got.out;
      broken[at] = bad;
      CHECK_FALSE(max_rel_error(broken, want.out) <= tolerance(dtype::f16));
      CHECK_FALSE(max_rel_error(want.out, broken) <= tolerance(dtype::f16));
    }
  }
  std::vector<float> lse = got.lse;
  lse.back() = std::numeric_limits<float>::quiet_NaN();
  CHECK_FALSE(max_rel_error(lse, want.lse) <= tolerance(dtype::f16));
  std::vector<float> empty_row = want.lse;  // -inf (a query that saw no token) matches only -inf
  empty_row.front() = -std::numeric_limits<float>::infinity();
  CHECK(max_rel_error(empty_row, empty_row) == 0.0);
  CHECK_FALSE(max_rel_error(empty_row, want.lse) <= tolerance(dtype::f16));
  CHECK_FALSE(max_rel_error(std::vector<float>(got.out.begin(), got.out.end() - 1), want.out) <=
              tolerance(dtype::f16));
}
