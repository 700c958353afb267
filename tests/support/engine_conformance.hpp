// SPDX-License-Identifier: Apache-2.0
//! The `transfer_engine` contract, checked the same way for every engine and pair of tiers
//! (cpu_copy_engine between host, file and block-I/O tiers, routing_engine over a composite
//! tier, and any engine an engine author brings): random batches arrive byte-exact, `test` and
//! `wait` report completion, bad batches (slots out of range, a destination twice) are refused
//! before anything moves, and tickets the engine never issued are refused. The model is a copy of
//! what each slot of both tiers should hold.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "oasiskv/concepts/transfer_engine.hpp"
#include "support/tier_conformance.hpp"

namespace oasiskv::testing {

//! @brief Runs the contract for `e` copying from `src` to `dst` (distinct tiers of one layout,
//! each with at least 4 slots). Overwrites every writable slot of both; a read-only slot of `src`
//! keeps what it holds and is copied from like any other.
template <class E, class Src, class Dst>
void check_engine_conformance(E& e, Src& src, Dst& dst, std::uint64_t seed = 1) {
  namespace cd = conformance_detail;
  static_assert(transfer_engine<E, Src, Dst>, "check_engine_conformance: not a transfer_engine");
  REQUIRE(src.layout() == dst.layout());
  const std::size_t bb = src.layout().block_bytes();
  const std::uint32_t ns = src.num_slots(), nd = dst.num_slots();
  REQUIRE(ns >= 4);
  REQUIRE(nd >= 4);
  std::mt19937_64 rng(seed);
  auto random_block = [&] {
    std::vector<std::byte> b(bb);
    for (auto& x : b) {
      x = static_cast<std::byte>(rng());
    }
    return b;
  };
  const std::uint32_t ro = cd::read_only_slots_of(src);
  std::vector<std::vector<std::byte>> src_model(ns), dst_model(nd);
  for (slot_id s = 0; s < ns; ++s) {
    if (s < ro) {
      src_model[s].resize(bb);
      cd::read_slot(std::as_const(src), s, src_model[s].data());
    } else {
      src_model[s] = random_block();
      cd::write_slot(src, s, src_model[s].data());
    }
  }
  for (slot_id s = 0; s < nd; ++s) {
    dst_model[s] = random_block();
    cd::write_slot(dst, s, dst_model[s].data());
  }
  std::vector<std::byte> out(bb);
  auto check_dst = [&](const char* after) {
    for (slot_id s = 0; s < nd; ++s) {
      cd::read_slot(std::as_const(dst), s, out.data());
      INFO(after << ": destination slot " << s);
      REQUIRE(out == dst_model[s]);
    }
  };

  // Random batches, one to three in flight at a time, each to distinct destinations.
  std::vector<slot_id> dsts(nd);
  for (slot_id s = 0; s < nd; ++s) {
    dsts[s] = s;
  }
  for (int round = 0; round < 40; ++round) {
    std::shuffle(dsts.begin(), dsts.end(), rng);
    const std::uint32_t batches = 1 + static_cast<std::uint32_t>(rng() % 3);
    std::vector<typename E::ticket> tickets;
    std::vector<std::vector<block_copy>> sent;
    std::uint32_t next = 0;
    for (std::uint32_t b = 0; b < batches && next < nd; ++b) {
      const std::uint32_t len =
          std::min<std::uint32_t>(nd - next, 1 + static_cast<std::uint32_t>(rng() % 6));
      std::vector<block_copy> batch;
      for (std::uint32_t i = 0; i < len; ++i) {
        batch.push_back({static_cast<slot_id>(rng() % ns), dsts[next++]});
      }
      tickets.push_back(e.submit(std::as_const(src), dst, batch));
      sent.push_back(batch);
    }
    for (std::size_t b = 0; b < tickets.size(); ++b) {
      e.wait(tickets[b]);
      CHECK(e.test(tickets[b]));  // finished stays finished
      for (const block_copy& c : sent[b]) {
        dst_model[c.dst] = src_model[c.src];
      }
    }
  }
  check_dst("40 rounds of random batches");

  // Bad batches are refused whole: the valid copy beside the bad one does not happen.
  const slot_id victim = 0;
  const std::vector<block_copy> src_out{{1, victim}, {ns, 1}};
  expect_error([&] { (void)e.submit(std::as_const(src), dst, src_out); }, errc::invalid_slot,
               std::to_string(ns));
  const std::vector<block_copy> dst_out{{1, victim}, {2, nd + 3}};
  expect_error([&] { (void)e.submit(std::as_const(src), dst, dst_out); }, errc::invalid_slot,
               std::to_string(nd + 3));
  const std::vector<block_copy> twice{{1, victim}, {2, 3}, {3, 3}};
  expect_error([&] { (void)e.submit(std::as_const(src), dst, twice); }, errc::invalid_argument,
               "slot 3");
  check_dst("refused batches");

  // An empty batch finishes; a ticket the engine never issued is refused.
  const auto empty = e.submit(std::as_const(src), dst, std::vector<block_copy>{});
  e.wait(empty);
  CHECK(e.test(empty));
  const typename E::ticket never{};
  expect_error([&] { (void)e.test(never); }, errc::unknown_ticket, "ticket");
  expect_error([&] { e.wait(never); }, errc::unknown_ticket, "ticket");
  check_dst("the whole contract");
}

}  // namespace oasiskv::testing
