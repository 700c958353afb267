// SPDX-License-Identifier: Apache-2.0
// The exporter and the decode side on 127.0.0.1, over whatever UCX_TLS says (ctest runs this
// binary with tcp and with sm). Every fetched byte is compared with the source pattern.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "disagg/disagg_support.hpp"
#include "oasiskv/disagg/ucx_remote_tier.hpp"
#include "oasiskv/tier/host_tier.hpp"
#include "support/expect_error.hpp"

using namespace oasiskv::disagg;
using disagg_test::layout;
using oasiskv::block_copy;
using oasiskv::errc;
using oasiskv::host_tier;
using oasiskv::testing::expect_error;

namespace {

std::uint16_t start_exporter(disagg_test::child& c, int requests, int tokens, int lease_ms,
                             std::uint64_t first_seq = 1) {
  disagg_test::spawn(c, {DISAGG_PROC, "export", std::to_string(requests), std::to_string(tokens),
                         std::to_string(lease_ms), "60", std::to_string(first_seq)});
  const std::string l = c.line();
  REQUIRE_MESSAGE(l.rfind("port ", 0) == 0, "exporter said: ", l);
  return static_cast<std::uint16_t>(std::stoul(l.substr(5)));
}

// Correctness tests are not about deadlines: a generous one keeps them from failing on a slow
// machine (sanitizers make software-emulated gets ten times slower).
ucx_engine_options relaxed() {
  return {std::chrono::milliseconds(10000), 128};
}

remote_tier_options client(std::uint16_t port) {
  remote_tier_options o;
  o.port = port;
  o.token = disagg_test::token();
  return o;
}

// Fetches every block of `o` into `local` from slot `first` on and checks each byte.
std::size_t fetch_and_check(ucx_engine& engine, ucx_remote_tier& tier, host_tier& local,
                            const opened_msg& o, oasiskv::slot_id first) {
  std::vector<block_copy> copies;
  for (std::size_t i = 0; i < o.blocks.size(); ++i) {
    copies.push_back({o.blocks[i].slot, static_cast<oasiskv::slot_id>(first + i)});
  }
  engine.wait(engine.submit(tier, local, copies));
  std::vector<std::byte> want(layout.block_bytes());
  std::size_t bad = 0;
  for (std::size_t i = 0; i < o.blocks.size(); ++i) {
    disagg_test::fill_block(want.data(), o.seq, static_cast<std::uint32_t>(i / o.blocks_per_layer),
                            static_cast<std::uint32_t>(i % o.blocks_per_layer), want.size());
    bad += std::memcmp(local.slot_data(copies[i].dst), want.data(), want.size()) != 0;
  }
  return bad;
}

}  // namespace

TEST_CASE("two processes: every fetched block equals the source, byte for byte") {
  disagg_test::child ex;
  const std::uint16_t port = start_exporter(ex, 4, 1000, 30000);
  ucx_engine engine(relaxed());
  ucx_remote_tier tier(engine, client(port));
  CHECK(tier.layout() == layout);
  const std::uint32_t per = layout.num_layers * layout.blocks_for(1000);
  host_tier local(layout, 4 * per);
  for (std::uint64_t seq = 1; seq <= 4; ++seq) {
    const opened_msg o = tier.open(seq);
    CHECK(o.tokens == 1000);
    CHECK(o.summaries.size() == o.blocks.size() * summary_bytes(layout));
    CHECK(fetch_and_check(engine, tier, local, o, static_cast<oasiskv::slot_id>((seq - 1) * per)) ==
          0);
  }
  // The block-I/O path (one block, synchronous).
  const opened_msg o = tier.open(1);
  std::vector<std::byte> one(layout.block_bytes()), want(layout.block_bytes());
  tier.read_block(o.blocks[5].slot, one.data());
  disagg_test::fill_block(want.data(), 1, 0, 5, want.size());
  CHECK(one == want);
  CHECK(tier.heartbeat() == 4);
  for (std::uint64_t seq = 1; seq <= 4; ++seq) {
    tier.release(seq);
  }
  CHECK(tier.heartbeat() == 0);
  CHECK(engine.stats().failed_batches == 0);
  CHECK(engine.stats().bytes == (4 * per + 1) * layout.block_bytes());
}

TEST_CASE("two processes: concurrent batches from several threads") {
  disagg_test::child ex;
  const std::uint16_t port = start_exporter(ex, 4, 512, 30000);
  ucx_engine engine({std::chrono::milliseconds(10000), 64});
  ucx_remote_tier tier(engine, client(port));
  const std::uint32_t per = layout.num_layers * layout.blocks_for(512);
  host_tier local(layout, 4 * per);
  std::vector<opened_msg> opened;
  for (std::uint64_t seq = 1; seq <= 4; ++seq) {
    opened.push_back(tier.open(seq));
  }
  std::atomic<std::size_t> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 5; ++round) {
        bad +=
            fetch_and_check(engine, tier, local, opened[t], static_cast<oasiskv::slot_id>(t * per));
      }
    });
  }
  for (auto& th : threads) {
    th.join();
  }
  CHECK(bad == 0);
  CHECK(engine.stats().batches == 20);
}

namespace {

// An in-process exporter of request 1 whose progress thread sleeps as soon as nothing is
// pending, and a decode side that reads the request after pauses.
struct paused_reader {
  static exporter_options options(bool wakeup) {
    exporter_options eo;
    eo.token = disagg_test::token();
    eo.busy_poll = std::chrono::microseconds(0);
    eo.wakeup = wakeup;
    return eo;
  }
  explicit paused_reader(bool wakeup, ucx_engine_options engine_options = relaxed())
      : ex(layout, 64, options(wakeup)), engine(engine_options), tier(engine, client(ex.port())) {
    disagg_test::publish_pattern(ex, 1, 100);
    o = tier.open(1);
  }
  // Reads the whole request `rounds` times, 5 ms apart (the exporter asleep each time); the
  // blocks that differ from the source.
  std::size_t read_after_pauses(int rounds) {
    std::size_t bad = 0;
    for (int r = 0; r < rounds; ++r) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      bad += fetch_and_check(engine, tier, local, o, 0);
    }
    return bad;
  }
  kv_exporter ex;
  ucx_engine engine;
  ucx_remote_tier tier;
  opened_msg o;
  host_tier local{layout, 64};
};

}  // namespace

TEST_CASE("an idle exporter sleeps on its worker's events and wakes for each get") {
  paused_reader p(true);
  // Idle: the thread sleeps until the stop-check timeout (20 ms), it does not spin.
  const exporter_stats before_idle = p.ex.stats();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const exporter_stats idle = p.ex.stats();
  CHECK(idle.progress_sleeps - before_idle.progress_sleeps <= 20);
  constexpr int rounds = 8;
  CHECK(p.read_after_pauses(rounds) == 0);
  const exporter_stats st = p.ex.stats();
  CHECK(st.progress_sleeps - idle.progress_sleeps >= rounds);
  // Each round's gets find the exporter asleep and must wake it; a worker whose descriptor
  // never signalled would serve them only at the stop-check timeout, waking no sleep.
  CHECK(st.progress_wakeups - idle.progress_wakeups >= rounds / 2);
  CHECK(p.engine.stats().failed_batches == 0);
}

TEST_CASE("an exporter without the wake-up feature naps when idle and still serves gets") {
  paused_reader p(false);  // for transports that cannot wake a worker
  CHECK(p.read_after_pauses(4) == 0);
  CHECK(p.ex.stats().progress_sleeps > 0);
  CHECK(p.ex.stats().progress_wakeups == 0);  // naps end by themselves
  CHECK(p.engine.stats().failed_batches == 0);
}

TEST_CASE("the engine's progress thread polls through a decode loop's pauses, then naps") {
  for (const int poll_ms : {0, 500}) {
    CAPTURE(poll_ms);
    ucx_engine_options eo = relaxed();
    eo.busy_poll = std::chrono::milliseconds(poll_ms);
    paused_reader p(true, eo);
    CHECK(fetch_and_check(p.engine, p.tier, p.local, p.o, 0) == 0);
    const std::uint64_t before = p.engine.stats().idle_naps;
    CHECK(p.read_after_pauses(4) == 0);  // 5 ms apart: a submit each, as a decode loop's layers
    const std::uint64_t naps = p.engine.stats().idle_naps - before;
    if (poll_ms == 0) {
      CHECK(naps >= 4);  // every pause: nothing in flight, so it naps at once
    } else {
      CHECK(naps == 0);  // still polling when each submit came: no wake-up to pay
    }
  }
}

TEST_CASE("a decode node without the exporter's token is refused") {
  exporter_options eo;
  eo.token = disagg_test::token();
  kv_exporter ex(layout, 64, eo);
  ucx_engine engine(relaxed());
  remote_tier_options o = client(ex.port());
  o.token = disagg_test::token('x');
  // Neither side can prove the other's token: the decode node refuses the exporter's proof
  // and hangs up, and the exporter counts a connection that never completed the handshake.
  expect_error([&] { ucx_remote_tier tier(engine, o); }, errc::invalid_argument,
               "could not prove the exporter's token");
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (ex.stats().refused == 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  CHECK(ex.stats().refused == 1);
  CHECK(ex.stats().opens == 0);
}

TEST_CASE("a read of a block the exporter freed fails on its generation") {
  exporter_options eo;
  eo.token = disagg_test::token();
  kv_exporter ex(layout, 64, eo);
  disagg_test::publish_pattern(ex, 1, 100);
  ucx_engine engine(relaxed());
  ucx_remote_tier tier(engine, client(ex.port()));
  const opened_msg o = tier.open(1);
  host_tier local(layout, 64);
  CHECK(fetch_and_check(engine, tier, local, o, 0) == 0);
  ex.drop(1);                                // freed while the decode node still reads it...
  disagg_test::publish_pattern(ex, 2, 100);  // ...and its slots reused by another request
  std::vector<block_copy> copies{{o.blocks[0].slot, 20}, {o.blocks[3].slot, 21}};
  try {
    engine.wait(engine.submit(tier, local, copies));
    FAIL("a stale block was accepted");
  } catch (const oasiskv::error& e) {
    CHECK(e.code() == errc::transfer_failed);
    CHECK(std::string(e.what()).find("generation") != std::string::npos);
  }
  CHECK(engine.stats().generation_mismatches == 1);
  // The exporter itself is fine: a fresh open of the new request reads correctly.
  const opened_msg o2 = tier.open(2);
  CHECK(fetch_and_check(engine, tier, local, o2, 30) == 0);
}

TEST_CASE("slots of no opened request and writes are refused before anything moves") {
  exporter_options eo;
  eo.token = disagg_test::token();
  kv_exporter ex(layout, 64, eo);
  disagg_test::publish_pattern(ex, 1, 40);
  ucx_engine engine(relaxed());
  ucx_remote_tier tier(engine, client(ex.port()));
  host_tier local(layout, 8);
  std::vector<block_copy> copies{{0, 0}};
  CHECK_THROWS_AS(engine.submit(tier, local, copies), oasiskv::error);  // nothing opened yet
  const opened_msg o = tier.open(1);
  copies = {{o.blocks[0].slot, 0}, {o.blocks[1].slot, 0}};  // one destination twice
  expect_error([&] { engine.submit(tier, local, copies); }, errc::invalid_slot,
               "copy 1 writes slot 0 twice");
  copies = {{o.blocks[0].slot, 1}, {o.blocks[1].slot, 8}};  // beyond the destination
  expect_error([&] { engine.submit(tier, local, copies); }, errc::invalid_slot,
               "copy 1 writes slot 8, outside the destination's 8 slots");
  std::vector<std::byte> buf(layout.block_bytes());
  CHECK_THROWS_AS(tier.write_block(o.blocks[0].slot, buf.data()), oasiskv::error);
  CHECK_THROWS_AS(tier.open(99), oasiskv::error);  // never published
}

TEST_CASE("a batch's deadline counts time without progress, not its size or its queueing") {
  // A 64 MiB batch, then a small batch submitted behind it, each with a deadline of half the
  // time the large one takes alone (measured first, so the case means the same on a loaded
  // machine and under the sanitizers): both finish, byte-exact, and the exporter stays usable,
  // because the clock runs only while a batch waits on a silent exporter. A deadline counted
  // from submit would fail both.
  exporter_options eo;
  eo.token = disagg_test::token();
  const std::uint32_t tokens = 4096 * 16;  // 4096 blocks per layer: 8192 blocks, 64 MiB
  kv_exporter ex(layout, 2 * layout.blocks_for(tokens) + 64, eo);
  disagg_test::publish_pattern(ex, 1, tokens);
  disagg_test::publish_pattern(ex, 2, 100);
  ucx_engine engine(relaxed());
  ucx_remote_tier tier(engine, client(ex.port()));
  const opened_msg big = tier.open(1, false), small = tier.open(2, false);
  host_tier local(layout, static_cast<std::uint32_t>(big.blocks.size() + small.blocks.size()));
  std::vector<block_copy> cb, cs;
  for (std::size_t i = 0; i < big.blocks.size(); ++i) {
    cb.push_back({big.blocks[i].slot, static_cast<oasiskv::slot_id>(i)});
  }
  for (std::size_t i = 0; i < small.blocks.size(); ++i) {
    cs.push_back({small.blocks[i].slot, static_cast<oasiskv::slot_id>(big.blocks.size() + i)});
  }
  engine.wait(engine.submit(tier, local, cb));  // warm-up: the pages of `local`, the endpoint
  auto t0 = std::chrono::steady_clock::now();
  engine.wait(engine.submit(tier, local, cb));
  const auto alone =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
  const auto deadline = std::max(alone / 2, std::chrono::milliseconds(20));
  t0 = std::chrono::steady_clock::now();
  const auto tb = engine.submit(tier, local, cb, deadline);
  const auto ts = engine.submit(tier, local, cs, deadline);
  engine.wait(ts);
  engine.wait(tb);
  MESSAGE("64 MiB batch alone: ", alone.count(), " ms; with a small one queued behind it, under a ",
          deadline.count(), " ms deadline: ",
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(),
          " ms");
  CHECK(engine.stats().forced_closes == 0);
  std::vector<std::byte> want(layout.block_bytes());
  std::size_t bad = 0;
  for (std::size_t i = 0; i < cb.size(); i += 97) {  // a sample of the big batch
    disagg_test::fill_block(want.data(), 1, static_cast<std::uint32_t>(i / big.blocks_per_layer),
                            static_cast<std::uint32_t>(i % big.blocks_per_layer), want.size());
    bad += std::memcmp(local.slot_data(cb[i].dst), want.data(), want.size()) != 0;
  }
  for (std::size_t i = 0; i < cs.size(); ++i) {
    disagg_test::fill_block(want.data(), 2, static_cast<std::uint32_t>(i / small.blocks_per_layer),
                            static_cast<std::uint32_t>(i % small.blocks_per_layer), want.size());
    bad += std::memcmp(local.slot_data(cs[i].dst), want.data(), want.size()) != 0;
  }
  CHECK(bad == 0);
}

TEST_CASE("a destroyed tier leaves no endpoint, rkey or descriptor behind") {
  exporter_options eo;
  eo.token = disagg_test::token();
  kv_exporter ex(layout, 64, eo);
  ucx_engine engine(relaxed());
  host_tier local(layout, 64);
  auto fds = [] {
    std::size_t n = 0;
    for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
      (void)e;
      ++n;
    }
    return n;
  };
  std::size_t before = 0;
  for (int i = 0; i < 30; ++i) {
    disagg_test::publish_pattern(ex, 1 + i, 40);
    {
      ucx_remote_tier tier(engine, client(ex.port()));
      const opened_msg o = tier.open(1 + i, false);
      CHECK(fetch_and_check(engine, tier, local, o, 0) == 0);
      tier.release(1 + i);
    }
    if (i == 4) {
      before = fds();  // after the engine's own start-up
    }
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (engine.stats().peers != 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  CHECK(engine.stats().peers == 0);
  CHECK(engine.stats().disconnects == 30);
  CHECK(engine.stats().forced_closes == 0);
  // The exporter's side of each connection (UCX's, in this process too) goes at its keepalive
  // (UCX_KEEPALIVE_INTERVAL=1s here).
  const auto settle = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (fds() > before + 2 && std::chrono::steady_clock::now() < settle) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  CHECK(fds() <= before + 2);
}

TEST_CASE("an exporter whose endpoint the engine force-closed can be reconnected") {
  // A force-close (here asked for, as a missed deadline or a UCX error does it) leaves the
  // exporter refused to this engine until the tier reconnects: then reads go on, byte-exact,
  // with the request's lease and generations as they were.
  exporter_options eo;
  eo.token = disagg_test::token();
  kv_exporter ex(layout, 64, eo);
  disagg_test::publish_pattern(ex, 1, 100);
  ucx_engine engine(relaxed());
  ucx_remote_tier tier(engine, client(ex.port()));
  host_tier local(layout, 64);
  const opened_msg o = tier.open(1, false);
  CHECK(fetch_and_check(engine, tier, local, o, 0) == 0);
  tier.reconnect();  // healthy: a no-op
  CHECK(tier.reconnects() == 0);
  engine.close_peer(tier.peer(), "distrusted by the test");
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (engine.peer_failure(tier.peer()).empty() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  CHECK(engine.peer_failure(tier.peer()).find("distrusted by the test") != std::string::npos);
  const std::vector<block_copy> one{{o.blocks[0].slot, 0}};
  expect_error([&] { (void)engine.submit(tier, local, one); }, errc::transfer_failed,
               "is unusable");
  tier.reconnect();
  CHECK(tier.reconnects() == 1);
  CHECK(engine.peer_failure(tier.peer()).empty());
  CHECK(fetch_and_check(engine, tier, local, o, 20) == 0);
  CHECK(engine.stats().forced_closes == 1);
  tier.release(1);
}
