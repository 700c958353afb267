// SPDX-License-Identifier: Apache-2.0
// Failure tests, over tcp and over sm (ctest runs the suite with each): a killed or stopped
// exporter fails its own sequences within the batch deadline while another exporter's go on; a
// dead decode node's leases lapse and it releases nothing it does not own. Over shared memory
// the gets of a force-closed endpoint never report back (UCX 1.13), so the engine reports the
// failure only after its grace period (`ucx_engine` keeps the destination slots quarantined
// until then): the bound is the deadline plus that grace.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "disagg/disagg_support.hpp"
#include "oasiskv/disagg/ucx_remote_tier.hpp"
#include "oasiskv/tier/host_tier.hpp"

using namespace oasiskv::disagg;
using disagg_test::layout;
using oasiskv::block_copy;
using oasiskv::errc;
using oasiskv::host_tier;
using ms = std::chrono::milliseconds;

namespace {

std::uint16_t start(disagg_test::child& c, std::uint64_t first_seq, int lease_ms = 30000) {
  disagg_test::spawn(c, {DISAGG_PROC, "export", "2", "2048", std::to_string(lease_ms), "60",
                         std::to_string(first_seq)});
  const std::string l = c.line();
  REQUIRE_MESSAGE(l.rfind("port ", 0) == 0, "exporter said: ", l);
  return static_cast<std::uint16_t>(std::stoul(l.substr(5)));
}

remote_tier_options client(std::uint16_t port, const char* name) {
  remote_tier_options o;
  o.port = port;
  o.token = disagg_test::token();
  o.client = name;
  return o;
}

std::vector<block_copy> table(const opened_msg& o, oasiskv::slot_id first, std::size_t n) {
  std::vector<block_copy> c;
  for (std::size_t i = 0; i < n && i < o.blocks.size(); ++i) {
    c.push_back({o.blocks[i].slot, static_cast<oasiskv::slot_id>(first + i)});
  }
  return c;
}

bool exact(host_tier& local, const opened_msg& o, const std::vector<block_copy>& c) {
  std::vector<std::byte> want(layout.block_bytes());
  for (std::size_t i = 0; i < c.size(); ++i) {
    disagg_test::fill_block(want.data(), o.seq, static_cast<std::uint32_t>(i / o.blocks_per_layer),
                            static_cast<std::uint32_t>(i % o.blocks_per_layer), want.size());
    if (std::memcmp(local.slot_data(c[i].dst), want.data(), want.size()) != 0) {
      return false;
    }
  }
  return true;
}

// Decodes from exporters A and B; hurts A with `sig` after a few steps; A's next batch must fail
// with transfer_failed within its deadline, and B must go on byte-exact.
void exporter_failure(int sig, const char* expect_in_message) {
  const ms deadline(500);
  disagg_test::child a, b;
  const std::uint16_t pa = start(a, 1), pb = start(b, 101);
  ucx_engine engine({deadline, 128});
  ucx_remote_tier ta(engine, client(pa, "decode->A")), tb(engine, client(pb, "decode->B"));
  const opened_msg oa = ta.open(1), ob = tb.open(101);
  host_tier local(layout, 512);
  const auto ca = table(oa, 0, 128), cb = table(ob, 256, 128);
  for (int step = 0; step < 3; ++step) {
    engine.wait(engine.submit(ta, local, ca));
    engine.wait(engine.submit(tb, local, cb));
    REQUIRE(exact(local, oa, ca));
    REQUIRE(exact(local, ob, cb));
  }
  ::kill(a.pid, sig);
  const auto submitted = std::chrono::steady_clock::now();
  bool failed = false;
  std::string what;
  try {
    for (int step = 0; step < 50; ++step) {  // a batch already past the kill, or the next one
      engine.wait(engine.submit(ta, local, ca));
    }
  } catch (const oasiskv::error& e) {
    failed = true;
    what = e.what();
    CHECK(e.code() == errc::transfer_failed);
  }
  const auto took = std::chrono::steady_clock::now() - submitted;
  REQUIRE(failed);
  MESSAGE("exporter A failed after ", std::chrono::duration<double, std::milli>(took).count(),
          " ms: ", what);
  const char* tls = std::getenv("UCX_TLS");
  const bool shared_memory = tls != nullptr && std::string(tls) == "sm";
  CHECK(took < deadline + (shared_memory ? ms(2000) : ms(0)) + ms(300));
  CHECK(what.find(ta.name()) != std::string::npos);
  CHECK(what.find(expect_in_message) != std::string::npos);
  CHECK_THROWS_AS(engine.submit(ta, local, ca), oasiskv::error);  // A stays dead
  CHECK_FALSE(engine.peer_failure(ta.peer()).empty());
  const auto st = engine.stats();
  // A's endpoint only. (No batch need have failed: the failure may reach a submit first.)
  CHECK(st.forced_closes == 1);
  for (int step = 0; step < 3; ++step) {  // B goes on
    engine.wait(engine.submit(tb, local, cb));
    CHECK(exact(local, ob, cb));
  }
  CHECK(tb.heartbeat() == 1);
}

// Waits until `pid` is stopped (a signal is delivered asynchronously: kill returns before the
// process has stopped).
bool stopped(pid_t pid) {
  const auto until = std::chrono::steady_clock::now() + ms(2000);
  while (std::chrono::steady_clock::now() < until) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    std::getline(stat, line);
    const auto close = line.rfind(')');
    if (close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'T') {
      return true;
    }
    std::this_thread::sleep_for(ms(1));
  }
  return false;
}

// A raw control session: the handshake, then `m`; returns the reply.
message raw_call(std::uint16_t port, const message& m) {
  fd_handle fd = connect_tcp("127.0.0.1", port, ms(2000));
  const auto deadline = steady::now() + ms(2000);
  client_handshake(fd.get(), disagg_test::token(), "raw", 0, deadline, "raw");
  send_all(fd.get(), encode(m, 3), deadline, "raw");
  return recv_frame(fd.get(), deadline, "raw").body;
}

}  // namespace

TEST_SUITE("failure") {
  TEST_CASE("SIGKILL of an exporter fails its sequences within the deadline; others go on") {
    exporter_failure(SIGKILL, "exporter");
  }

  TEST_CASE("SIGSTOP of an exporter fails its sequences at the deadline; others go on") {
    exporter_failure(SIGSTOP, "deadline");
  }

  TEST_CASE("a dead decode node's leases lapse; it releases nothing it does not own") {
    disagg_test::child ex;
    const std::uint16_t port = start(ex, 1, 600);
    disagg_test::child doomed;
    disagg_test::spawn(doomed, {DISAGG_PROC, "decode", std::to_string(port), "1", "60"});
    REQUIRE(doomed.line() == "opened");
    // Someone else's lease: refused to another session, and not releasable by it.
    const message r = raw_call(port, open_msg{1, 0});
    REQUIRE(std::holds_alternative<error_msg>(r));
    CHECK(std::get<error_msg>(r).code == static_cast<std::uint32_t>(errc::slot_in_flight));
    const message rel = raw_call(port, release_msg{1});
    REQUIRE(std::holds_alternative<error_msg>(rel));
    ::kill(doomed.pid, SIGKILL);
    std::this_thread::sleep_for(ms(1200));  // two lease periods without heartbeats
    ucx_engine engine;
    ucx_remote_tier tier(engine, client(port, "survivor"));
    try {
      tier.open(1);
      FAIL("the dead node's request should have been reclaimed");
    } catch (const oasiskv::error& e) {
      CHECK(e.code() == errc::unknown_sequence);
    }
    const opened_msg o = tier.open(2);  // never leased by the dead node: still there, intact
    host_tier local(layout, o.blocks.size());
    const auto c = table(o, 0, o.blocks.size());
    engine.wait(engine.submit(tier, local, c));
    CHECK(exact(local, o, c));
  }

  TEST_CASE("a control-channel timeout: the tier reconnects, keeps its leases, drops the open") {
    // The exporter stops (SIGSTOP) while an open is under way, past the control channel's
    // timeout: the call fails, and its late answer is never read as another call's. The next
    // call reopens the channel and resumes the session: the request opened before still reads
    // exactly, and the open the tier gave up on is released by that heartbeat instead of
    // staying leased.
    disagg_test::child ex;
    const std::uint16_t port = start(ex, 1);
    ucx_engine engine({ms(10000), 128});
    remote_tier_options o = client(port, "decode");
    o.io_timeout = ms(500);
    o.heartbeat = false;
    ucx_remote_tier tier(engine, o);
    const opened_msg first = tier.open(1, false);
    ::kill(ex.pid, SIGSTOP);
    REQUIRE(stopped(ex.pid));
    std::thread resume([&] {
      std::this_thread::sleep_for(ms(800));
      ::kill(ex.pid, SIGCONT);
    });
    bool gave_up = false;
    try {
      tier.open(2, false);
    } catch (const oasiskv::error&) {
      gave_up = true;  // the exporter leases it once it runs again
    }
    resume.join();
    REQUIRE(gave_up);
    std::this_thread::sleep_for(ms(200));  // the exporter answers, too late
    CHECK(tier.heartbeat() == 1);          // reconnected: request 1's lease is this session's again
    CHECK(tier.reconnects() == 1);
    host_tier local(layout, first.blocks.size());
    const auto c = table(first, 0, first.blocks.size());
    engine.wait(engine.submit(tier, local, c));
    CHECK(exact(local, first, c));
    // Request 2 was freed as abandoned, not left leased to this decode node for good.
    ucx_remote_tier other(engine, client(port, "other"));
    try {
      other.open(2, false);
      FAIL("the abandoned open should have been released");
    } catch (const oasiskv::error& e) {
      CHECK(e.code() == errc::unknown_sequence);
    }
    tier.release(1);
  }
}
