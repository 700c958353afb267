// SPDX-License-Identifier: Apache-2.0
// composite_tier (two tiers as one pool, routed by slot range; a read-only first part) and
// routing_engine (each part's copies through its own engine), without UCX: the first part is an
// in-memory block-I/O tier whose reads can be held back or fail.
#include <doctest/doctest.h>

#include "support/expect_error.hpp"

#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "oasiskv/concepts/transfer_engine.hpp"
#include "oasiskv/tier/composite_tier.hpp"
#include "oasiskv/tier/host_tier.hpp"
#include "oasiskv/transfer/cpu_copy_engine.hpp"
#include "oasiskv/transfer/routing_engine.hpp"
#include "support/engine_conformance.hpp"
#include "support/gated_io_tier.hpp"
#include "support/tier_conformance.hpp"

using namespace oasiskv;
using oasiskv::testing::expect_error;
using oasiskv::testing::gated_io_tier;

namespace {

const kv_layout layout{1, 4, 2, 16, 16, dtype::f16};  // 2 KiB blocks
using composite = composite_tier<gated_io_tier, host_tier>;
using router = routing_engine<cpu_copy_engine, cpu_copy_engine>;

static_assert(batched_block_io_tier<composite>);
static_assert(!addressable_tier<composite>);
static_assert(transfer_engine<router, composite, host_tier>);
static_assert(declares_read_only<host_tier> == false);

// Block (tag): every byte differs from its neighbours and from the same offset in other blocks,
// so a copy from the wrong block, the wrong offset or of a partial block cannot compare equal.
std::byte pattern_byte(std::uint8_t tag, std::size_t i) {
  return std::byte(static_cast<unsigned char>(tag * 37u + i * 13u + (i >> 8) * 101u));
}

void fill_block(std::byte* p, std::uint8_t tag) {
  for (std::size_t i = 0; i < layout.block_bytes(); ++i) {
    p[i] = pattern_byte(tag, i);
  }
}

std::vector<std::byte> block_of(std::uint8_t tag) {
  std::vector<std::byte> b(layout.block_bytes());
  fill_block(b.data(), tag);
  return b;
}

composite make(std::uint32_t n, std::uint32_t m, bool read_only) {
  auto first = std::make_unique<gated_io_tier>(layout, n);
  for (slot_id s = 0; s < n; ++s) {
    fill_block(first->raw(s), static_cast<std::uint8_t>(s + 1));
  }
  auto second = std::make_unique<host_tier>(layout, m);
  for (slot_id s = 0; s < m; ++s) {
    fill_block(second->slot_data(s), static_cast<std::uint8_t>(100 + s));
  }
  return composite(std::move(first), std::move(second), read_only);
}

std::uint8_t tag_of(slot_id composite_slot, std::uint32_t n) {
  return static_cast<std::uint8_t>(composite_slot < n ? composite_slot + 1
                                                      : 100 + composite_slot - n);
}

}  // namespace

TEST_CASE("composite_tier: slots route by range; a read-only first part refuses writes") {
  composite c = make(6, 4, true);
  CHECK(c.num_slots() == 10);
  CHECK(c.first_slots() == 6);
  CHECK(c.read_only_slots() == 6);
  std::vector<std::byte> out(layout.block_bytes());
  for (slot_id s = 0; s < 10; ++s) {
    c.read_block(s, out.data());
    CHECK(out == block_of(tag_of(s, 6)));
  }
  expect_error([&] { c.read_block(10, out.data()); }, errc::invalid_slot, "slot 10");
  const auto w = block_of(42);
  c.write_block(7, w.data());
  CHECK(std::memcmp(c.second().slot_data(1), w.data(), w.size()) == 0);
  expect_error([&] { c.write_block(5, w.data()); }, errc::unsupported,
               "slot 5 belongs to the read-only first part");
  // A batch with one read-only slot moves nothing.
  const std::vector<block_write> ws{{8, w.data()}, {2, w.data()}};
  expect_error([&] { c.write_blocks(ws); }, errc::unsupported, "slot 2");
  c.read_block(8, out.data());
  CHECK(out == block_of(102));
  // Batched reads across both parts land where asked.
  std::vector<std::vector<std::byte>> bufs(10, std::vector<std::byte>(layout.block_bytes()));
  std::vector<block_read> rs;
  for (slot_id s : {9u, 0u, 6u, 3u, 7u}) {
    rs.push_back({s, bufs[s].data()});
  }
  c.read_blocks(rs);
  CHECK(bufs[9] == block_of(103));
  CHECK(bufs[0] == block_of(1));
  CHECK(bufs[6] == block_of(100));
  CHECK(bufs[3] == block_of(4));
  CHECK(bufs[7] == block_of(42));
  // Writable first part: writes reach it.
  composite rw = make(3, 2, false);
  CHECK(rw.read_only_slots() == 0);
  const std::vector<block_write> both{{1, w.data()}, {4, w.data()}};
  rw.write_blocks(both);
  rw.read_block(1, out.data());
  CHECK(out == w);
  rw.read_block(4, out.data());
  CHECK(out == w);
}

TEST_CASE("composite_tier: the tier_backend contract, with a writable and a read-only first part") {
  composite rw = make(5, 7, false);
  oasiskv::testing::check_tier_conformance(rw, 4);
  composite ro = make(6, 4, true);
  oasiskv::testing::check_tier_conformance(ro, 5);
  // The read-only part still holds what it was made with.
  std::vector<std::byte> out(layout.block_bytes());
  for (slot_id s = 0; s < 6; ++s) {
    ro.read_block(s, out.data());
    CHECK(out == block_of(tag_of(s, 6)));
  }
}

TEST_CASE("composite_tier: bad parts") {
  expect_error(
      [] {
        composite(std::make_unique<gated_io_tier>(layout, 2),
                  std::make_unique<host_tier>(kv_layout{1, 4, 2, 16, 8, dtype::f16}, 2));
      },
      errc::layout_mismatch, "layouts differ");
  expect_error([] { composite(nullptr, std::make_unique<host_tier>(layout, 2)); },
               errc::invalid_argument, "null");
}

TEST_CASE("routing_engine: random batches across both parts arrive byte-exact") {
  composite c = make(40, 24, true);
  host_tier fast(layout, 32);
  router e(c);
  std::mt19937 rng(17);
  for (int round = 0; round < 200; ++round) {
    std::vector<slot_id> srcs(64), dsts(32);
    std::iota(srcs.begin(), srcs.end(), 0u);
    std::iota(dsts.begin(), dsts.end(), 0u);
    std::shuffle(srcs.begin(), srcs.end(), rng);
    std::shuffle(dsts.begin(), dsts.end(), rng);
    const std::size_t n = 1 + rng() % 32;
    std::vector<block_copy> copies;
    for (std::size_t i = 0; i < n; ++i) {
      copies.push_back({srcs[i], dsts[i]});
    }
    const auto t = e.submit(c, fast, copies);
    if (round % 2 == 0) {
      e.wait(t);
    } else {
      while (!e.test(t)) {
      }
      e.wait(t);
    }
    for (const block_copy& cp : copies) {
      REQUIRE(std::memcmp(fast.slot_data(cp.dst), block_of(tag_of(cp.src, 40)).data(),
                          layout.block_bytes()) == 0);
    }
  }
  CHECK(e.first().stats().blocks > 0);
  CHECK(e.second().stats().blocks > 0);
}

TEST_CASE("routing_engine: the transfer_engine contract from both parts of a composite tier") {
  composite c = make(6, 5, true);
  host_tier fast(layout, 9);
  router e(c);
  oasiskv::testing::check_engine_conformance(e, c, fast, 8);
}

TEST_CASE("routing_engine: in flight, failures, refused batches") {
  composite c = make(8, 8, true);
  host_tier fast(layout, 8);
  router e(c);
  // Held back: the batch is in flight until the first part's reads may go on.
  c.first().set_open(false);
  const std::vector<block_copy> mixed{{1, 0}, {9, 1}};
  const auto t = e.submit(c, fast, mixed);
  CHECK_FALSE(e.test(t));
  // A destination an unfinished batch writes is refused (by the part's engine).
  const std::vector<block_copy> clash{{10, 0}};
  expect_error([&] { e.submit(c, fast, clash); }, errc::slot_in_flight, "writes slot 0");
  c.first().set_open(true);
  e.wait(t);
  CHECK(e.test(t));
  // A read that fails is rethrown by wait, once; the other part's copy still landed.
  c.first().poison(2);
  const std::vector<block_copy> poisoned{{2, 2}, {11, 3}};
  const auto f = e.submit(c, fast, poisoned);
  expect_error([&] { e.wait(f); }, errc::transfer_failed, "slot 2");
  e.wait(f);
  CHECK(std::memcmp(fast.slot_data(3), block_of(103).data(), layout.block_bytes()) == 0);
  c.first().cure();
  // Whole-batch checks, before anything moves.
  const std::vector<block_copy> out_of_range{{16, 4}};
  expect_error([&] { e.submit(c, fast, out_of_range); }, errc::invalid_slot, "reads slot 16");
  const std::vector<block_copy> twice{{1, 5}, {12, 5}};
  expect_error([&] { e.submit(c, fast, twice); }, errc::invalid_argument, "writes slot 5");
  // The second part refuses after the first started: the first has finished when submit
  // throws, so its destination is free again.
  c.first().set_open(false);
  const std::vector<block_copy> second_bad{{3, 6}, {12, 99}};
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    c.first().set_open(true);
  });
  expect_error([&] { e.submit(c, fast, second_bad); }, errc::invalid_slot, "writes slot 99");
  opener.join();
  const std::vector<block_copy> again{{4, 6}};
  e.wait(e.submit(c, fast, again));
  CHECK(std::memcmp(fast.slot_data(6), block_of(5).data(), layout.block_bytes()) == 0);
  // Tickets it never issued.
  router::ticket bogus;
  expect_error([&] { (void)e.test(bogus); }, errc::unknown_ticket, "ticket 0");
  bogus.id = 1000;
  expect_error([&] { e.wait(bogus); }, errc::unknown_ticket, "ticket 1000");
}
