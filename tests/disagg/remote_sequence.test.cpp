// SPDX-License-Identifier: Apache-2.0
// remote_sequence over two processes: what each admission mode reads, and every staged block
// byte-equal to the exporter's.
#include <doctest/doctest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "disagg/disagg_support.hpp"
#include "oasiskv/disagg/remote_sequence.hpp"
#include "support/expect_error.hpp"

using namespace oasiskv::disagg;
using disagg_test::layout;

namespace {

std::uint16_t start(disagg_test::child& c) {
  disagg_test::spawn(c, {DISAGG_PROC, "export", "2", "1000", "30000", "60", "1"});
  const std::string l = c.line();
  REQUIRE_MESSAGE(l.rfind("port ", 0) == 0, "exporter said: ", l);
  return static_cast<std::uint16_t>(std::stoul(l.substr(5)));
}

// Checks every staged remote block of (seq, layer) against the pattern; returns mismatches.
std::size_t check_staged(const remote_sequence& rs, std::uint64_t seq, std::uint32_t layer,
                         const std::vector<oasiskv::block_ref>& refs, std::uint32_t remote_blocks) {
  std::vector<std::byte> want(layout.block_bytes());
  std::size_t bad = 0;
  for (const oasiskv::block_ref& r : refs) {
    if (r.index >= remote_blocks) {
      continue;  // local tail
    }
    disagg_test::fill_block(want.data(), seq, layer, r.index, want.size());
    bad += std::memcmp(rs.pool().slot(r.slot), want.data(), want.size()) != 0;
  }
  return bad;
}

}  // namespace

TEST_CASE("remote_sequence: full and selective admission read what they should, exactly") {
  disagg_test::child ex;
  const std::uint16_t port = start(ex);
  ucx_engine engine({std::chrono::milliseconds(10000), 128});
  remote_tier_options o;
  o.port = port;
  o.token = disagg_test::token();
  ucx_remote_tier tier(engine, o);
  const std::uint32_t blocks = layout.blocks_for(1000);  // 63: 62 full + a partial one
  const std::uint32_t remote = 1000 / layout.tokens_per_block;
  const std::size_t bb = layout.block_bytes();

  admission_options full;
  full.mode = admission_mode::full;
  remote_sequence dense(tier, 1, full);
  CHECK(dense.stats().admitted_bytes == std::uint64_t{layout.num_layers} * blocks * bb);

  admission_options sel;
  sel.budget_tokens = 256;  // 16 blocks
  remote_sequence sparse(tier, 2, sel);
  CHECK(sparse.stats().admitted_bytes ==
        layout.num_layers * (blocks * summary_bytes(layout) + (1 + 2 + 1) * bb));
  CHECK(sparse.stats().host_bytes < dense.stats().host_bytes);

  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> q(layout.num_q_heads * layout.head_dim);
  std::vector<std::uint32_t> chosen;
  std::vector<oasiskv::block_ref> refs;
  for (int step = 0; step < 6; ++step) {
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      for (float& x : q) {
        x = nd(rng);
      }
      sparse.select(l, q.data(), chosen);
      CHECK(chosen.size() == 16);
      CHECK(chosen.front() == 0);
      CHECK(chosen.back() == remote - 1);
      refs.clear();
      sparse.stage(l, chosen, refs);
      CHECK(refs.size() == 17);  // the selection and the partial block in the local tail
      CHECK(check_staged(sparse, 2, l, refs, remote) == 0);
    }
  }
  CHECK(sparse.stats().fetched_blocks > 0);
  dense.select(0, q.data(), chosen);
  refs.clear();
  dense.stage(0, chosen, refs);
  CHECK(chosen.size() == remote);
  CHECK(check_staged(dense, 1, 0, refs, remote) == 0);
  CHECK(dense.stats().fetched_blocks == 0);  // nothing after admission

  // Decode tokens go to the local tail, after the prompt's partial block.
  std::vector<oasiskv::f16> k(layout.num_kv_heads * layout.head_dim), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = oasiskv::f16::from_float(static_cast<float>(i));
    v[i] = oasiskv::f16::from_float(-static_cast<float>(i));
  }
  for (int t = 0; t < 10; ++t) {
    sparse.append(0, k.data(), v.data());
  }
  CHECK(sparse.length(0) == 1010);
  refs.clear();
  const std::vector<std::uint32_t> first_block{0};
  sparse.stage(0, first_block, refs);
  CHECK(refs.size() == 1 + 2);  // block 0, the partial block and a new tail block
  const auto* tail = sparse.pool().keys<oasiskv::f16>(refs[2].slot, 1);
  CHECK(tail[std::size_t{(1009 % 16)} * layout.head_dim + 3] == k[layout.head_dim + 3]);

  // Bad input: one clear error each, and the sequence as it was.
  using oasiskv::errc;
  using oasiskv::testing::expect_error;
  const std::vector<std::uint32_t> partial{0, remote};  // the partial block is local
  expect_error([&] { sparse.stage(0, partial, refs); }, errc::out_of_range,
               "block " + std::to_string(remote) + " of layer 0 is not one of its " +
                   std::to_string(remote) + " remote blocks");
  expect_error([&] { sparse.prefetch(1, partial); }, errc::out_of_range, "prefetch: block");
  const std::uint32_t bad_layer = layout.num_layers;
  expect_error([&] { sparse.select(bad_layer, q.data(), chosen); }, errc::out_of_range,
               "select: layer " + std::to_string(bad_layer) + " of a " +
                   std::to_string(layout.num_layers) + "-layer sequence");
  expect_error([&] { sparse.stage(bad_layer, first_block, refs); }, errc::out_of_range,
               "stage: layer");
  expect_error([&] { sparse.append(bad_layer, k.data(), v.data()); }, errc::out_of_range,
               "append: layer");
  expect_error([&] { (void)sparse.length(bad_layer); }, errc::out_of_range, "length: layer");
  expect_error([&] { sparse.select(0, nullptr, chosen); }, errc::invalid_argument, "null query");
  CHECK(sparse.length(0) == 1010);
  sparse.select(1, q.data(), chosen);
  refs.clear();
  sparse.stage(1, chosen, refs);
  CHECK(check_staged(sparse, 2, 1, refs, remote) == 0);
}

TEST_CASE("remote_sequence: a request dropped right after open fails the admission cleanly") {
  // The exporter frees the request while the decode node's admission reads it: every layer's
  // batch fails on its generation. The constructor must throw transfer_failed only once no get
  // can still write into the pool it frees, and the tier must go on serving other requests.
  const oasiskv::kv_layout deep{16, 4, 2, 64, 16, oasiskv::dtype::f16};  // 16 layers, 8 KiB blocks
  exporter_options eo;
  eo.token = disagg_test::token();
  const std::uint32_t per = deep.num_layers * deep.blocks_for(1000);
  kv_exporter ex(deep, 2 * per + 8, eo);
  ucx_engine engine({std::chrono::milliseconds(10000), 128});
  remote_tier_options o;
  o.port = ex.port();
  o.token = disagg_test::token();
  ucx_remote_tier tier(engine, o);
  admission_options full;
  full.mode = admission_mode::full;
  int failed = 0;
  for (std::uint64_t seq = 1; seq <= 8 && failed == 0; ++seq) {
    disagg_test::publish_pattern(ex, seq, 1000);
    const std::uint64_t opens = ex.stats().opens;
    std::thread dropper([&] {
      while (ex.stats().opens == opens) {
        std::this_thread::yield();
      }
      ex.drop(seq);
    });
    try {
      remote_sequence rs(tier, seq, full);
      MESSAGE("admission of request ", seq, " finished before the drop; retrying");
    } catch (const oasiskv::error& e) {
      CHECK(e.code() == oasiskv::errc::transfer_failed);
      ++failed;
    }
    dropper.join();
  }
  REQUIRE_MESSAGE(failed == 1, "no admission overlapped the drop in 8 tries");
  // The tier and the exporter are fine: a fresh request admits and reads exactly.
  disagg_test::publish_pattern(ex, 100, 1000);
  remote_sequence rs(tier, 100, full);
  std::vector<std::uint32_t> all;
  std::vector<float> q(deep.num_q_heads * deep.head_dim, 1.0f);
  rs.select(3, q.data(), all);
  std::vector<oasiskv::block_ref> refs;
  rs.stage(3, all, refs);
  std::vector<std::byte> want(deep.block_bytes());
  std::size_t bad = 0;
  for (const oasiskv::block_ref& r : refs) {
    if (r.index < 1000 / deep.tokens_per_block) {
      disagg_test::fill_block(want.data(), 100, 3, r.index, want.size());
      bad += std::memcmp(rs.pool().slot(r.slot), want.data(), want.size()) != 0;
    }
  }
  CHECK(bad == 0);
}

TEST_SUITE("failure") {
  TEST_CASE("remote_sequence: after its exporter dies, every stage throws; none serves stale KV") {
    // A stage whose fetch failed, or whose batch the engine refused, must not leave the blocks
    // it meant to fill marked resident: a retry would return bytes never fetched.
    disagg_test::child ex;
    const std::uint16_t port = start(ex);
    ucx_engine engine({std::chrono::milliseconds(500), 128});
    remote_tier_options o;
    o.port = port;
    o.token = disagg_test::token();
    ucx_remote_tier tier(engine, o);
    const std::uint32_t remote = 1000 / layout.tokens_per_block;  // 62 full blocks
    admission_options sel;
    sel.budget_tokens = 256;  // 16 blocks
    remote_sequence rs(tier, 1, sel);
    std::vector<oasiskv::block_ref> refs;
    const std::vector<std::uint32_t> first{0,  5,  6,  7,  8,  9,  10, 11,
                                           12, 13, 14, 15, 16, 17, 60, 61};
    rs.stage(0, first, refs);
    CHECK(check_staged(rs, 1, 0, refs, remote) == 0);
    ::kill(ex.pid, SIGKILL);
    const std::vector<std::uint32_t> next{0,  30, 31, 32, 33, 34, 35, 36,
                                          37, 38, 39, 40, 41, 42, 60, 61};
    for (int attempt = 0; attempt < 4; ++attempt) {
      CAPTURE(attempt);
      refs.clear();
      bool threw = false;
      try {
        rs.stage(0, next, refs);
      } catch (const oasiskv::error&) {
        threw = true;
      }
      CHECK(threw);
      if (!threw) {
        CHECK(check_staged(rs, 1, 0, refs, remote) == 0);
      }
    }
  }
}
