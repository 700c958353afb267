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
#include <string>
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

// A raw control session: hello, then `m`; returns the reply.
message raw_call(std::uint16_t port, const message& m) {
  fd_handle fd = connect_tcp("127.0.0.1", port, ms(2000));
  const auto deadline = steady::now() + ms(2000);
  send_all(fd.get(), encode(hello_msg{disagg_test::token(), "raw"}, 1), deadline, "raw");
  recv_frame(fd.get(), deadline, "raw");
  send_all(fd.get(), encode(m, 2), deadline, "raw");
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
}
