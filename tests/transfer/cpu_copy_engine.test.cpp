// SPDX-License-Identifier: Apache-2.0
#include <doctest/doctest.h>

#include "support/expect_error.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "oasiskv/tier/host_tier.hpp"
#include "oasiskv/transfer/cpu_copy_engine.hpp"
#include "support/engine_conformance.hpp"
#include "support/gated_io_tier.hpp"

using oasiskv::block_copy;
using oasiskv::cpu_copy_engine;
using oasiskv::dtype;
using oasiskv::errc;
using oasiskv::host_tier;
using oasiskv::kv_layout;
using oasiskv::slot_id;

namespace {
const kv_layout small{1, 2, 1, 8, 2, dtype::f32};  // 128-byte blocks

// Writes `tag` over the whole block, so a torn or misdirected copy shows anywhere in it.
void stamp(host_tier& t, slot_id s, std::uint64_t tag) {
  auto* p = reinterpret_cast<std::uint64_t*>(t.slot_data(s));
  for (std::size_t i = 0; i < small.block_bytes() / 8; ++i) {
    p[i] = tag ^ (i * 0x9e3779b97f4a7c15ull);
  }
}
std::uint64_t read_stamp(const host_tier& t, slot_id s) {
  const auto* p = reinterpret_cast<const std::uint64_t*>(t.slot_data(s));
  const std::uint64_t tag = p[0];
  for (std::size_t i = 1; i < small.block_bytes() / 8; ++i) {
    if ((p[i] ^ (i * 0x9e3779b97f4a7c15ull)) != tag) {
      return ~std::uint64_t{0};  // torn block
    }
  }
  return tag;
}

using oasiskv::testing::expect_error;

using oasiskv::testing::gated_io_tier;
static_assert(oasiskv::block_io_tier<gated_io_tier>);
static_assert(oasiskv::transfer_engine<cpu_copy_engine, gated_io_tier, host_tier>);
}  // namespace

TEST_CASE("cpu_copy_engine: a batch copies whole blocks, test/wait report completion") {
  host_tier a(small, 8), b(small, 8);
  for (slot_id s = 0; s < 8; ++s) {
    stamp(a, s, 100 + s);
    stamp(b, s, 200 + s);
  }
  cpu_copy_engine e;
  const std::vector<block_copy> batch{{0, 7}, {5, 1}, {6, 6}};
  const auto t = e.submit(a, b, batch);
  e.wait(t);
  CHECK(e.test(t));
  CHECK(read_stamp(b, 7) == 100);
  CHECK(read_stamp(b, 1) == 105);
  CHECK(read_stamp(b, 6) == 106);
  CHECK(read_stamp(b, 0) == 200);  // untouched
  // Within one tier, between distinct slots.
  e.wait(e.submit(b, b, std::vector<block_copy>{{7, 2}}));
  CHECK(read_stamp(b, 2) == 100);
  // An empty batch is a valid, immediately finishing transfer.
  const auto empty = e.submit(a, b, {});
  e.wait(empty);
  const auto st = e.stats();
  CHECK(st.batches == 3);
  CHECK(st.blocks == 4);
  CHECK(st.bytes == 4 * small.block_bytes());
}

TEST_CASE("cpu_copy_engine: small host batches are copied inline while nothing is unfinished") {
  host_tier a(small, 8), b(small, 8);
  for (slot_id s = 0; s < 8; ++s) {
    stamp(a, s, 300 + s);
  }
  cpu_copy_engine e({.inline_bytes = 2 * small.block_bytes()});
  // Idle engine, two blocks: done before submit returns, by the submitting thread.
  const auto t1 = e.submit(a, b, std::vector<block_copy>{{0, 0}, {1, 1}});
  CHECK(e.test(t1));
  CHECK(read_stamp(b, 0) == 300);
  CHECK(read_stamp(b, 1) == 301);
  CHECK(e.stats().inline_batches == 1);
  // Three blocks are over the limit: the worker copies them.
  e.wait(e.submit(a, b, std::vector<block_copy>{{2, 2}, {3, 3}, {4, 4}}));
  CHECK(read_stamp(b, 4) == 304);
  CHECK(e.stats().inline_batches == 1);
  // Behind an unfinished batch a small one queues, so batches still finish in order.
  gated_io_tier file(small, 4);
  std::memset(file.raw(0), 0x11, small.block_bytes());
  file.set_open(false);
  const auto stalled = e.submit(file, b, std::vector<block_copy>{{0, 5}});
  const auto queued = e.submit(a, b, std::vector<block_copy>{{6, 6}});
  CHECK_FALSE(e.test(stalled));
  CHECK_FALSE(e.test(queued));
  CHECK(read_stamp(b, 6) != 306);
  file.set_open(true);
  e.wait(queued);
  CHECK(e.test(stalled));
  CHECK(read_stamp(b, 6) == 306);
  CHECK(b.slot_data(5)[0] == std::byte{0x11});
  CHECK(e.stats().inline_batches == 1);
  CHECK(e.stats().batches == 4);
  CHECK(e.stats().bytes == 7 * small.block_bytes());
  // Block-I/O tiers never run inline (their calls may block on a device), and 0 turns it off.
  e.wait(e.submit(b, file, std::vector<block_copy>{{0, 1}}));
  CHECK(e.stats().inline_batches == 1);
  cpu_copy_engine off({.inline_bytes = 0});
  off.wait(off.submit(a, b, std::vector<block_copy>{{7, 7}}));
  CHECK(read_stamp(b, 7) == 307);
  CHECK(off.stats().inline_batches == 0);
  // Hazard checks still apply to an inline batch.
  expect_error(
      [&] {
        (void)e.submit(b, b, std::vector<block_copy>{{0, 1}, {1, 2}});
      },
      errc::invalid_argument, "reads slot 1 which the same batch writes");
}

TEST_CASE("cpu_copy_engine: a lingering worker finds new batches, and wait wakes it") {
  host_tier a(small, 8), b(small, 8);
  for (slot_id s = 0; s < 8; ++s) {
    stamp(a, s, 500 + s);
  }
  using namespace std::chrono_literals;
  const auto soon = [](auto&& done) {  // polls `done` for up to 20 s
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (!done() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(100us);
    }
    return done();
  };
  {
    // Lingers 1 s, looking every 1 ms: a batch submitted after the first finishes is found and
    // run with nobody waiting for it.
    cpu_copy_engine e({.inline_bytes = 0, .linger_us = 1'000'000, .poll_us = 1000});
    e.wait(e.submit(a, b, std::vector<block_copy>{{0, 0}}));
    const auto t = e.submit(a, b, std::vector<block_copy>{{1, 1}});
    CHECK(soon([&] { return e.test(t); }));
    CHECK(read_stamp(b, 1) == 501);
  }
  {
    // Looks only once a second: wait (and drain) wake it instead of waiting for its next look.
    cpu_copy_engine e({.inline_bytes = 0, .linger_us = 1'000'000, .poll_us = 1'000'000});
    e.wait(e.submit(a, b, std::vector<block_copy>{{2, 2}}));
    std::this_thread::sleep_for(5ms);  // the worker is between looks
    auto t0 = std::chrono::steady_clock::now();
    e.wait(e.submit(a, b, std::vector<block_copy>{{3, 3}}));
    CHECK(std::chrono::steady_clock::now() - t0 < 900ms);
    std::this_thread::sleep_for(5ms);
    t0 = std::chrono::steady_clock::now();
    (void)e.submit(a, b, std::vector<block_copy>{{4, 4}});
    e.drain();
    CHECK(std::chrono::steady_clock::now() - t0 < 900ms);
    CHECK(read_stamp(b, 3) == 503);
    CHECK(read_stamp(b, 4) == 504);
  }
  {
    // No linger: the worker sleeps at once, and each submit wakes it.
    cpu_copy_engine e({.inline_bytes = 0, .linger_us = 0});
    for (slot_id s = 5; s < 8; ++s) {
      const auto t = e.submit(a, b, std::vector<block_copy>{{s, s}});
      CHECK(soon([&] { return e.test(t); }));
      CHECK(read_stamp(b, s) == 500 + s);
      std::this_thread::sleep_for(1ms);
    }
  }
  expect_error([] { cpu_copy_engine e({.linger_us = 1'000'001}); }, errc::invalid_argument,
               "linger_us = 1000001 must be at most 1000000");
  expect_error([] { cpu_copy_engine e({.poll_us = 0}); }, errc::invalid_argument,
               "poll_us = 0 must be in [1, 1000000]");
}

TEST_CASE("cpu_copy_engine: the transfer_engine contract between host and block-I/O tiers") {
  {
    host_tier a(small, 9), b(small, 7);
    cpu_copy_engine e;
    oasiskv::testing::check_engine_conformance(e, a, b, 1);
  }
  {
    gated_io_tier file(small, 6);
    host_tier fast(small, 8);
    cpu_copy_engine e;
    oasiskv::testing::check_engine_conformance(e, file, fast, 2);
    oasiskv::testing::check_engine_conformance(e, fast, file, 3);
  }
}

TEST_CASE("cpu_copy_engine: bad batches are rejected before anything moves") {
  host_tier a(small, 4), b(small, 4);
  host_tier other(kv_layout{1, 2, 1, 16, 2, dtype::f32}, 4);
  stamp(b, 0, 7);
  cpu_copy_engine e;
  expect_error(
      [&] {
        (void)e.submit(a, other, std::vector<block_copy>{{0, 0}});
      },
      errc::layout_mismatch, "block bytes 128 vs 256");
  expect_error(
      [&] {
        (void)e.submit(a, b, std::vector<block_copy>{{0, 0}, {4, 1}});
      },
      errc::invalid_slot, "copy 1 reads slot 4");
  expect_error(
      [&] {
        (void)e.submit(a, b, std::vector<block_copy>{{0, 9}});
      },
      errc::invalid_slot, "copy 0 writes slot 9");
  expect_error(
      [&] {
        (void)e.submit(a, b, std::vector<block_copy>{{0, 2}, {1, 2}});
      },
      errc::invalid_argument, "copy 1 writes slot 2 which an earlier copy");
  expect_error(
      [&] {
        (void)e.submit(b, b, std::vector<block_copy>{{0, 1}, {1, 2}});
      },
      errc::invalid_argument, "reads slot 1 which the same batch writes");
  expect_error(
      [&] {
        (void)e.submit(b, b, std::vector<block_copy>{{3, 3}});
      },
      errc::invalid_argument, "reads slot 3 which the same batch writes");
  expect_error([&] { e.wait(cpu_copy_engine::ticket{}); }, errc::unknown_ticket, "ticket 0");
  expect_error([&] { (void)e.test(cpu_copy_engine::ticket{42}); }, errc::unknown_ticket,
               "ticket 42");
  CHECK(e.stats().batches == 0);
  CHECK(read_stamp(b, 0) == 7);
}

TEST_CASE("cpu_copy_engine: slots of an unfinished batch cannot be read or overwritten") {
  gated_io_tier file(small, 4);
  host_tier fast(small, 4), other(small, 4);
  cpu_copy_engine e;
  file.set_open(false);  // the first batch stalls inside read_block
  const auto t1 = e.submit(file, fast, std::vector<block_copy>{{0, 0}, {1, 1}});
  CHECK_FALSE(e.test(t1));
  // Reading a slot being written would read a half-written block.
  expect_error(
      [&] {
        (void)e.submit(fast, other, std::vector<block_copy>{{0, 3}});
      },
      errc::slot_in_flight, "reads slot 0 which an unfinished batch still writes");
  // Writing a slot being written or being read is a write race.
  expect_error(
      [&] {
        (void)e.submit(other, fast, std::vector<block_copy>{{2, 1}});
      },
      errc::slot_in_flight, "writes slot 1 which an unfinished batch still writes");
  expect_error(
      [&] {
        (void)e.submit(fast, file, std::vector<block_copy>{{3, 1}});
      },
      errc::slot_in_flight, "writes slot 1 which an unfinished batch still reads");
  // Untouched slots remain usable meanwhile; they queue behind the stalled batch.
  const auto t2 = e.submit(other, fast, std::vector<block_copy>{{0, 3}});
  file.set_open(true);
  e.wait(t2);
  CHECK(e.test(t1));  // batches finish in order
  // Once finished, the slots are free to use again.
  e.wait(e.submit(fast, other, std::vector<block_copy>{{0, 3}}));
}

TEST_CASE("cpu_copy_engine: a failure while copying surfaces at wait, once, and frees the slots") {
  gated_io_tier file(small, 4);
  host_tier fast(small, 4);
  std::memset(file.raw(2), 0x5a, small.block_bytes());
  file.poison(1);
  cpu_copy_engine e;
  const auto bad = e.submit(file, fast, std::vector<block_copy>{{0, 0}, {1, 1}});
  const auto good = e.submit(file, fast, std::vector<block_copy>{{2, 2}});
  expect_error([&] { e.wait(bad); }, errc::transfer_failed, "I/O error reading slot 1");
  CHECK_NOTHROW(e.wait(bad));  // reported once
  e.wait(good);
  CHECK(fast.slot_data(2)[5] == std::byte{0x5a});
  CHECK(e.stats().failed_batches == 1);
  // Host -> block-I/O and block-I/O -> block-I/O paths.
  gated_io_tier file2(small, 4);
  stamp(fast, 3, 77);
  e.wait(e.submit(fast, file, std::vector<block_copy>{{3, 3}}));
  e.wait(e.submit(file, file2, std::vector<block_copy>{{3, 0}}));
  e.wait(e.submit(file2, fast, std::vector<block_copy>{{0, 0}}));
  CHECK(read_stamp(fast, 0) == 77);
}

namespace {
void random_operations(oasiskv::cpu_copy_engine_options options) {
  const std::size_t inline_bytes = options.inline_bytes;
  constexpr std::uint32_t slots = 24;
  host_tier tiers[2] = {host_tier(small, slots), host_tier(small, slots)};
  std::vector<std::uint64_t> model[2];  // each slot's tag once every submitted batch has run
  std::uint64_t next_tag = 1;
  for (int t = 0; t < 2; ++t) {
    for (slot_id s = 0; s < slots; ++s) {
      stamp(tiers[t], s, next_tag);
      model[t].push_back(next_tag++);
    }
  }
  struct pending {
    cpu_copy_engine::ticket ticket;
    int src, dst;
    std::vector<block_copy> copies;
  };
  std::vector<pending> in_flight;  // submitted and not yet seen finished
  cpu_copy_engine e(options);
  std::mt19937 rng(2024);
  auto conflicts = [&](int src, int dst, const std::vector<block_copy>& copies, const pending& p) {
    for (const auto& c : copies) {
      for (const auto& q : p.copies) {
        if ((p.dst == src && q.dst == c.src) || (p.dst == dst && q.dst == c.dst) ||
            (p.src == dst && q.src == c.dst)) {
          return true;
        }
      }
    }
    return false;
  };
  std::size_t accepted = 0, rejected = 0;
  for (int op = 0; op < 100000; ++op) {
    const unsigned r = rng() % 100;
    if (r < 60) {
      const int src = static_cast<int>(rng() % 2), dst = static_cast<int>(rng() % 2);
      std::vector<block_copy> copies;
      const unsigned n = 1 + rng() % 4;
      std::vector<bool> used_dst(slots, false), used_src(slots, false);
      for (unsigned i = 0; i < n; ++i) {
        const slot_id s = rng() % slots, d = rng() % slots;
        const bool same_tier_hazard = src == dst && (s == d || used_dst[s] || used_src[d]);
        if (used_dst[d] || same_tier_hazard) {
          continue;  // keep batches well-formed; malformed ones are tested above
        }
        used_dst[d] = true;
        used_src[s] = true;
        copies.push_back({s, d});
      }
      bool may_conflict = false;
      for (const auto& p : in_flight) {
        may_conflict = may_conflict || conflicts(src, dst, copies, p);
      }
      try {
        const auto t = e.submit(tiers[src], tiers[dst], copies);
        ++accepted;
        // Accepted despite a conflict with a batch we had not seen finish: it must have finished.
        for (const auto& p : in_flight) {
          if (conflicts(src, dst, copies, p)) {
            REQUIRE(e.test(p.ticket));
          }
        }
        for (const auto& c : copies) {
          model[dst][c.dst] = model[src][c.src];  // hazards excluded: submission order is the order
        }
        in_flight.push_back({t, src, dst, copies});
      } catch (const oasiskv::error& err) {
        REQUIRE(err.code() == errc::slot_in_flight);
        REQUIRE(may_conflict);  // a rejection needs a real hazard
        ++rejected;
      }
    } else if (r < 80 && !in_flight.empty()) {
      const std::size_t i = rng() % in_flight.size();
      if (e.test(in_flight[i].ticket)) {
        in_flight.erase(in_flight.begin() + static_cast<long>(i));
      }
    } else if (r < 99 && !in_flight.empty()) {
      const std::size_t i = rng() % in_flight.size();
      e.wait(in_flight[i].ticket);
      in_flight.erase(in_flight.begin() + static_cast<long>(i));
    } else {
      e.drain();
      in_flight.clear();
      for (int t = 0; t < 2; ++t) {
        for (slot_id s = 0; s < slots; ++s) {
          REQUIRE(read_stamp(tiers[t], s) == model[t][s]);
        }
      }
    }
  }
  e.drain();
  for (int t = 0; t < 2; ++t) {
    for (slot_id s = 0; s < slots; ++s) {
      REQUIRE(read_stamp(tiers[t], s) == model[t][s]);
    }
  }
  CHECK(accepted > 10000);
  const std::uint64_t inlined = e.stats().inline_batches;
  CHECK((inline_bytes == 0 ? inlined == 0 : inlined > 0));
  MESSAGE("accepted " << accepted << " batches (" << inlined << " inline), rejected " << rejected
                      << " as hazards");
}
}  // namespace

TEST_CASE("cpu_copy_engine: 100k random operations against a model") {
  // Inline copies on (the default: most of these batches are small enough), and off; a worker
  // that lingers (the default) and one that sleeps as soon as its queue is empty.
  SUBCASE("inline copies") {
    random_operations({});
  }
  SUBCASE("every batch on the worker") {
    random_operations({.inline_bytes = 0});
  }
  SUBCASE("every batch on a worker that never lingers") {
    random_operations({.inline_bytes = 0, .linger_us = 0});
  }
}

TEST_CASE("cpu_copy_engine: concurrent submitters on disjoint slots") {
  constexpr int threads = 4;
  constexpr std::uint32_t per_thread = 8;
  host_tier src(small, threads * per_thread), dst(small, threads * per_thread);
  for (slot_id s = 0; s < src.num_slots(); ++s) {
    stamp(src, s, 1000 + s);
  }
  cpu_copy_engine e;
  std::atomic<int> failures{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (int round = 0; round < 500; ++round) {
        std::vector<block_copy> batch;
        for (std::uint32_t i = 0; i < per_thread; ++i) {
          const slot_id s = static_cast<slot_id>(t * per_thread + i);
          batch.push_back({s, s});
        }
        try {
          const auto tk = e.submit(src, dst, batch);
          while (!e.test(tk)) {
            std::this_thread::yield();
          }
          e.wait(tk);
        } catch (...) {
          ++failures;
        }
      }
    });
  }
  for (auto& th : pool) {
    th.join();
  }
  CHECK(failures == 0);
  for (slot_id s = 0; s < dst.num_slots(); ++s) {
    CHECK(read_stamp(dst, s) == 1000 + s);
  }
  CHECK(e.stats().batches == threads * 500);
}
