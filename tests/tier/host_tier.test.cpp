// SPDX-License-Identifier: Apache-2.0
#include <doctest/doctest.h>

#include "support/expect_error.hpp"

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "oasiskv/tier/host_tier.hpp"
#include "support/tier_conformance.hpp"

using oasiskv::dtype;
using oasiskv::errc;
using oasiskv::host_tier;
using oasiskv::host_tier_options;
using oasiskv::kv_layout;

namespace {
// 2 x 3 heads x 16 tokens x 64 x 2 bytes = 12288 bytes per block: already a multiple of 64.
const kv_layout smollm2{30, 9, 3, 64, 16, dtype::f16};
// 2 x 1 x 3 tokens x 8 x 2 = 96 bytes: the tier rounds the stride up to 128.
const kv_layout odd{1, 2, 1, 8, 3, dtype::bf16};

using oasiskv::testing::expect_error;
}  // namespace

TEST_CASE("host_tier: geometry, alignment and independent slots, in every allocation mode") {
  for (auto options :
       {host_tier_options{.align = host_tier_options::alignment::cache_line},
        host_tier_options{.align = host_tier_options::alignment::page},
        host_tier_options{.huge_pages = true}, host_tier_options{.prefault = true}}) {
    host_tier t(odd, 10, options);
    CHECK(t.layout() == odd);
    CHECK(t.num_slots() == 10);
    CHECK(t.slot_bytes() == 128);
    CHECK(t.bytes() == 1280);
    for (oasiskv::slot_id s = 0; s < 10; ++s) {
      CHECK(reinterpret_cast<std::uintptr_t>(t.slot_data(s)) % 64 == 0);
      std::memset(t.slot_data(s), static_cast<int>(s + 1), odd.block_bytes());
    }
    for (oasiskv::slot_id s = 0; s < 10; ++s) {
      const std::byte* p = std::as_const(t).slot_data(s);
      CHECK(p[0] == std::byte(s + 1));
      CHECK(p[odd.block_bytes() - 1] == std::byte(s + 1));
    }
    const oasiskv::block_pool_view v = t.view();
    REQUIRE_NOTHROW(v.validate());
    CHECK(v.slot(7) == t.slot_data(7));
    CHECK(v.num_slots == 10);
    if (options.align == host_tier_options::alignment::page) {
      CHECK(reinterpret_cast<std::uintptr_t>(t.slot_data(0)) % 4096 == 0);
    }
  }
}

TEST_CASE("host_tier: the tier_backend contract, in every allocation mode") {
  for (auto options :
       {host_tier_options{.align = host_tier_options::alignment::cache_line},
        host_tier_options{.align = host_tier_options::alignment::page},
        host_tier_options{.huge_pages = true}, host_tier_options{.prefault = true}}) {
    host_tier t(odd, 10, options);
    oasiskv::testing::check_tier_conformance(t, 1);
    host_tier big(smollm2, 3, options);
    oasiskv::testing::check_tier_conformance(big, 2);
  }
}

TEST_CASE("host_tier: bad arguments") {
  expect_error([] { host_tier t(odd, 0); }, errc::invalid_argument, "num_slots = 0");
  expect_error(
      [] {
        host_tier t(kv_layout{1, 2, 1, 8, 0, dtype::f16}, 4);
      },
      errc::invalid_layout, "tokens_per_block = 0");
  host_tier t(odd, 4);
  expect_error([&] { (void)t.slot_data(4); }, errc::invalid_slot,
               "slot 4 is outside the pool of 4");
  // Far past the address space: mmap fails and the error says how much was asked for.
  const kv_layout huge{1, 1024, 1024, 1024, 256, dtype::f16};  // 1 GiB blocks
  expect_error([&] { host_tier h(huge, 4000000000u); }, errc::out_of_memory, "4000000000 slots");
}

TEST_CASE("host_tier: the pin hook sees whole-slot chunks, and unpins them in reverse") {
  std::vector<std::pair<void*, std::size_t>> pinned, unpinned;
  {
    host_tier_options o;
    o.pin = [&](void* p, std::size_t n) {
      pinned.emplace_back(p, n);
    };
    o.unpin = [&](void* p, std::size_t n) {
      unpinned.emplace_back(p, n);
    };
    o.pin_chunk_bytes = 3 * smollm2.block_bytes() + 100;  // rounds down to 3 slots
    host_tier t(smollm2, 10, o);
    CHECK(t.slots_per_chunk() == 3);
    REQUIRE(t.pinned_chunks() == 4);
    REQUIRE(pinned.size() == 4);
    std::size_t covered = 0;
    for (std::size_t i = 0; i < pinned.size(); ++i) {
      CHECK(pinned[i].first == t.slot_data(static_cast<oasiskv::slot_id>(3 * i)));
      CHECK(pinned[i].second % t.slot_bytes() == 0);
      covered += pinned[i].second;
    }
    CHECK(covered == t.bytes());
    CHECK(pinned.back().second == t.slot_bytes());  // the tail chunk holds the 10th slot
    host_tier moved = std::move(t);                 // ownership moves; nothing is unpinned yet
    CHECK(unpinned.empty());
    CHECK(moved.pinned_chunks() == 4);
  }
  REQUIRE(unpinned.size() == 4);
  for (std::size_t i = 0; i < 4; ++i) {
    CHECK(unpinned[i] == pinned[3 - i]);
  }
}

TEST_CASE("host_tier: a pin failure unpins the chunks already pinned and propagates") {
  int pins = 0, unpins = 0;
  host_tier_options o;
  o.pin_chunk_bytes = smollm2.block_bytes();
  o.pin = [&](void*, std::size_t) {
    if (++pins == 3) {
      throw std::runtime_error("registration refused");
    }
  };
  o.unpin = [&](void*, std::size_t) {
    ++unpins;
  };
  CHECK_THROWS_WITH_AS(host_tier(smollm2, 5, o), "registration refused", std::runtime_error);
  CHECK(pins == 3);
  CHECK(unpins == 2);
}
