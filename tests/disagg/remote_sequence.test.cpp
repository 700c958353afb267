// SPDX-License-Identifier: Apache-2.0
// remote_sequence over two processes: what each admission mode reads, and every staged block
// byte-equal to the exporter's.
#include <doctest/doctest.h>

#include <random>
#include <string>
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
