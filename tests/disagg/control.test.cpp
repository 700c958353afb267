// SPDX-License-Identifier: Apache-2.0
// The exporter's control channel against hostile and failing peers, over raw sockets beside a
// real decode node: peers that never speak, speak slowly, send a huge frame before hello, a
// second hello or no hello, and go silent after one; bad options. After each, a real decode
// node still opens and reads a request exactly, without waiting on the others.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "disagg/disagg_support.hpp"
#include "oasiskv/disagg/ucx_remote_tier.hpp"
#include "oasiskv/disagg/wire_summary.hpp"
#include "oasiskv/tier/host_tier.hpp"
#include "support/expect_error.hpp"

using namespace oasiskv::disagg;
using disagg_test::layout;
using oasiskv::errc;
using oasiskv::testing::expect_error;
using ms = std::chrono::milliseconds;

namespace {

exporter_options quick(std::uint32_t max_connections = 64) {
  exporter_options eo;
  eo.token = disagg_test::token();
  eo.io_timeout = ms(300);
  eo.max_connections = max_connections;
  return eo;
}

remote_tier_options client(std::uint16_t port) {
  remote_tier_options o;
  o.port = port;
  o.token = disagg_test::token();
  o.heartbeat = false;
  return o;
}

// A real decode node: hello, open, read every block, check each byte. Returns how long it took.
ms decode_once(std::uint16_t port, std::uint64_t seq) {
  const auto t0 = std::chrono::steady_clock::now();
  ucx_engine engine({ms(10000), 128});
  ucx_remote_tier tier(engine, client(port));
  const opened_msg o = tier.open(seq, false);
  oasiskv::host_tier local(layout, static_cast<std::uint32_t>(o.blocks.size()));
  std::vector<oasiskv::block_copy> copies;
  for (std::size_t i = 0; i < o.blocks.size(); ++i) {
    copies.push_back({o.blocks[i].slot, static_cast<oasiskv::slot_id>(i)});
  }
  engine.wait(engine.submit(tier, local, copies));
  std::vector<std::byte> want(layout.block_bytes());
  for (std::size_t i = 0; i < o.blocks.size(); ++i) {
    disagg_test::fill_block(want.data(), seq, static_cast<std::uint32_t>(i / o.blocks_per_layer),
                            static_cast<std::uint32_t>(i % o.blocks_per_layer), want.size());
    REQUIRE(std::memcmp(local.slot_data(copies[i].dst), want.data(), want.size()) == 0);
  }
  tier.release(seq);
  return std::chrono::duration_cast<ms>(std::chrono::steady_clock::now() - t0);
}

fd_handle raw(std::uint16_t port) {
  return connect_tcp("127.0.0.1", port, ms(2000));
}

void send_bytes(const fd_handle& fd, std::span<const std::byte> b) {
  send_all(fd.get(), b, steady::now() + ms(2000), "raw");
}

// Waits until the exporter closes `fd`; returns the frame it sent first, if any.
std::optional<received_frame> until_closed(const fd_handle& fd, ms timeout = ms(3000)) {
  std::optional<received_frame> first;
  const auto deadline = steady::now() + timeout;
  try {
    first = recv_frame(fd.get(), deadline, "raw");
  } catch (const oasiskv::error&) {
    return std::nullopt;  // closed (or timed out) before any frame
  }
  std::byte b;
  while (steady::now() < deadline) {
    pollfd p{fd.get(), POLLIN, 0};
    if (::poll(&p, 1, 50) == 1) {
      if (::recv(fd.get(), &b, 1, 0) <= 0) {
        return first;
      }
    }
  }
  FAIL("the exporter kept the connection open");
  return first;
}

std::string error_text(const std::optional<received_frame>& f) {
  if (!f) {
    return "(no frame)";
  }
  const auto* e = std::get_if<error_msg>(&f->body);
  return e ? e->text : "(not an error)";
}

}  // namespace

TEST_CASE("exporter: peers that never say hello fill no slot for long") {
  exporter_options eo = quick(8);
  eo.io_timeout = ms(2000);  // room for a decode node's start-up on a loaded machine
  kv_exporter ex(layout, 64, eo);
  disagg_test::publish_pattern(ex, 1, 100);
  std::vector<fd_handle> silent;
  const auto t0 = steady::now();
  for (int i = 0; i < 8; ++i) {
    silent.push_back(raw(ex.port()));
  }
  // Every connection is taken: a decode node is refused now...
  CHECK_THROWS_AS(decode_once(ex.port(), 1), oasiskv::error);
  REQUIRE(steady::now() - t0 < ms(2000));  // (refused, not timed out)
  // ...and served once the silent ones have had their io_timeout.
  std::this_thread::sleep_until(t0 + ms(2300));
  CHECK(decode_once(ex.port(), 1) < ms(2000));
  CHECK(ex.stats().refused >= 8);
  for (const fd_handle& fd : silent) {
    CHECK_FALSE(until_closed(fd).has_value());  // closed without a word
  }
}

TEST_CASE("exporter: a peer sending a frame byte by byte does not delay others") {
  // A long io_timeout: an exporter that waited on the slow frame would stall the decode node
  // for all of it.
  exporter_options eo = quick();
  eo.io_timeout = ms(2000);
  kv_exporter ex(layout, 64, eo);
  disagg_test::publish_pattern(ex, 1, 100);
  const auto hello = encode(hello_msg{{}, "slow", 0}, 1);
  fd_handle slow = raw(ex.port());
  std::atomic<bool> done{false};
  std::thread dribble([&] {
    for (std::size_t i = 0; i < hello.size() && !done; ++i) {
      if (::send(slow.get(), hello.data() + i, 1, MSG_NOSIGNAL) != 1) {
        break;
      }
      std::this_thread::sleep_for(ms(40));
    }
  });
  std::this_thread::sleep_for(ms(50));  // the slow frame is begun
  const ms took = decode_once(ex.port(), 1);
  CHECK(took < ms(1500));  // not after the slow peer's io_timeout
  done = true;
  dribble.join();
  until_closed(slow);  // its frame took longer than io_timeout: closed
  const auto until = steady::now() + ms(2000);
  while (ex.stats().refused == 0 && steady::now() < until) {  // counted just after the close
    std::this_thread::sleep_for(ms(5));
  }
  CHECK(ex.stats().refused >= 1);
}

TEST_CASE("exporter: a huge frame before hello is refused before any of it is read") {
  kv_exporter ex(layout, 64, quick());
  disagg_test::publish_pattern(ex, 1, 100);
  // A valid header announcing a 64 MiB hello, and no payload.
  std::vector<std::byte> h = encode(hello_msg{{}, "x", 0}, 7);
  h.resize(header_bytes);
  const std::uint32_t big = limits::max_payload;
  std::memcpy(h.data() + 16, &big, 4);  // payload_bytes (little-endian)
  fd_handle fd = raw(ex.port());
  send_bytes(fd, h);
  const auto reply = until_closed(fd, ms(1000));
  CHECK(error_text(reply).find("a frame of 67108864 payload bytes before hello") !=
        std::string::npos);
  CHECK(decode_once(ex.port(), 1) < ms(2000));
}

TEST_CASE("exporter: no hello, a wrong proof, a second handshake: refused and closed") {
  kv_exporter ex(layout, 64, quick());
  disagg_test::publish_pattern(ex, 1, 100);
  const auto deadline = [] {
    return steady::now() + ms(2000);
  };
  {
    fd_handle fd = raw(ex.port());
    send_bytes(fd, encode(open_msg{1, 0}, 1));
    CHECK(error_text(until_closed(fd)).find("the handshake starts with hello") !=
          std::string::npos);
  }
  {
    // A peer without the token: it learns a nonce and a proof it cannot check, nothing else.
    fd_handle fd = raw(ex.port());
    send_bytes(fd, encode(hello_msg{{}, "impostor", 0}, 1));
    CHECK(std::holds_alternative<challenge_msg>(recv_frame(fd.get(), deadline(), "raw").body));
    send_bytes(fd, encode(auth_msg{}, 2));
    CHECK(error_text(until_closed(fd)).find("no valid proof of the token in auth") !=
          std::string::npos);
  }
  {
    // A decode node with another token refuses the exporter before sending its own proof.
    fd_handle fd = raw(ex.port());
    expect_error(
        [&] { client_handshake(fd.get(), disagg_test::token('z'), "d", 0, deadline(), "raw"); },
        errc::invalid_argument, "could not prove the exporter's token: not the exporter");
  }
  {
    fd_handle fd = raw(ex.port());
    const hello_ack_msg ack =
        client_handshake(fd.get(), disagg_test::token(), "twice", 0, deadline(), "raw");
    CHECK(ack.num_slots == 64);
    send_bytes(fd, encode(hello_msg{{}, "twice", 0}, 3));
    CHECK(error_text(until_closed(fd)).find("a second handshake") != std::string::npos);
  }
  {
    fd_handle fd = raw(ex.port());  // garbage: a bad magic
    std::vector<std::byte> junk(header_bytes, std::byte{0x41});
    send_bytes(fd, junk);
    CHECK(error_text(until_closed(fd)).find("bad magic") != std::string::npos);
  }
  CHECK(ex.stats().refused >= 3);
  CHECK(decode_once(ex.port(), 1) < ms(2000));
}

TEST_CASE("decode node: an impostor at the exporter's address gets no token and no trust") {
  // A listener that answers the handshake without the token: the decode node refuses it, and
  // what it sent never carried the token.
  std::uint16_t port = 0;
  fd_handle listener = listen_tcp("127.0.0.1", 0, port);
  std::vector<std::byte> seen;
  std::thread impostor([&] {
    fd_handle c(::accept(listener.get(), nullptr, nullptr));
    const auto d = steady::now() + ms(2000);
    received_frame f = recv_frame(c.get(), d, "impostor");
    seen = encode(f.body, 1);
    send_all(c.get(), encode(challenge_msg{}, 1), d, "impostor");
    std::byte b;
    ::recv(c.get(), &b, 1, 0);  // until the decode node hangs up
  });
  ucx_engine engine({ms(10000), 128});
  expect_error([&] { ucx_remote_tier tier(engine, client(port)); }, errc::invalid_argument,
               "could not prove the exporter's token: not the exporter");
  impostor.join();
  const auto t = disagg_test::token();
  CHECK(std::search(seen.begin(), seen.end(), t.begin(), t.end()) == seen.end());
}

TEST_CASE("exporter: an authenticated peer gone silent is closed after the idle timeout") {
  exporter_options eo = quick();
  eo.idle_timeout = ms(300);
  kv_exporter ex(layout, 64, eo);
  fd_handle fd = raw(ex.port());
  client_handshake(fd.get(), disagg_test::token(), "quiet", 0, steady::now() + ms(2000), "raw");
  const auto t0 = steady::now();
  CHECK_FALSE(until_closed(fd).has_value());
  const auto took = std::chrono::duration_cast<ms>(steady::now() - t0);
  CHECK(took >= ms(250));
  CHECK(took < ms(1500));
  CHECK(ex.stats().timed_out == 1);
}

TEST_CASE("exporter: options that would leave it open to anyone, or never time out, are refused") {
  exporter_options eo = quick();
  eo.token = {};
  expect_error([&] { kv_exporter ex(layout, 8, eo); }, errc::invalid_argument,
               "exporter_options.token is all zero");
  eo = quick();
  eo.lease = ms(0);
  expect_error([&] { kv_exporter ex(layout, 8, eo); }, errc::invalid_argument,
               "exporter_options.lease (ms) = 0 must be positive");
  eo = quick();
  eo.io_timeout = ms(0);
  expect_error([&] { kv_exporter ex(layout, 8, eo); }, errc::invalid_argument,
               "exporter_options.io_timeout (ms) = 0");
  eo = quick(0);
  expect_error([&] { kv_exporter ex(layout, 8, eo); }, errc::invalid_argument,
               "exporter_options.max_connections = 0");
}

TEST_CASE("exporter: summaries arrive in chunks, so no frame bounds a prompt's length") {
  // 4 KiB chunks: a 100-token request's 2 x 7 summaries of 512 bytes take two frames after the
  // opened one. (Llama-3-8B at 8k tokens: 65.5 MB of summaries, over one frame's 64 MiB, now
  // four 16 MiB chunks.)
  exporter_options eo = quick();
  eo.summary_chunk_bytes = 4096;
  kv_exporter ex(layout, 64, eo);
  disagg_test::publish_pattern(ex, 1, 100);
  ucx_engine engine({ms(10000), 128});
  ucx_remote_tier tier(engine, client(ex.port()));
  const opened_msg o = tier.open(1, true);
  const std::size_t sb = summary_bytes(layout);
  REQUIRE(o.summaries.size() == o.blocks.size() * sb);
  REQUIRE(o.summaries.size() > 4096);  // more than one chunk
  std::vector<std::byte> block(layout.block_bytes()), want(sb);
  for (std::size_t i = 0; i < o.blocks.size(); ++i) {
    const auto l = static_cast<std::uint32_t>(i / o.blocks_per_layer);
    const auto b = static_cast<std::uint32_t>(i % o.blocks_per_layer);
    disagg_test::fill_block(block.data(), 1, l, b, block.size());
    const std::uint32_t filled =
        b + 1 < o.blocks_per_layer ? layout.tokens_per_block : 100 - b * layout.tokens_per_block;
    summarize_block(layout, block.data(), filled, want.data());
    CHECK(std::memcmp(o.summaries.data() + i * sb, want.data(), sb) == 0);
  }
  tier.release(1);
  eo.summary_chunk_bytes = limits::max_summary_chunk + 1;
  expect_error([&] { kv_exporter bad(layout, 8, eo); }, errc::invalid_argument,
               "exporter_options.summary_chunk_bytes");
}

TEST_CASE("exporter: a peer that never reads its replies stalls neither prefill nor others") {
  // Replies wait in the connection's buffer, sent as the socket takes them and outside the
  // exporter's lock: prefill publishes and other decode nodes are served meanwhile, and the
  // connection is closed once a reply has waited io_timeout.
  kv_exporter ex(layout, 4096, quick());
  disagg_test::publish_pattern(ex, 1, 100);
  fd_handle fd = raw(ex.port());
  client_handshake(fd.get(), disagg_test::token(), "deaf", 0, steady::now() + ms(2000), "raw");
  const auto ask = encode(heartbeat_msg{}, 5);
  std::vector<std::byte> many;
  for (int i = 0; i < 10000; ++i) {
    many.insert(many.end(), ask.begin(), ask.end());
  }
  // Requests until every buffer on the way is full: the kernel's, then the exporter's reply
  // backlog, after which the exporter stops reading this peer.
  std::size_t sent = 0;
  for (auto quiet_since = steady::now(); steady::now() - quiet_since < ms(300);) {
    const ssize_t n = ::send(fd.get(), many.data(), many.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sent += static_cast<std::size_t>(n);
      quiet_since = steady::now();
    } else {
      std::this_thread::sleep_for(ms(5));
    }
  }
  MESSAGE("a peer that reads nothing got ", sent, " request bytes in before it was stopped");
  const auto t0 = steady::now();
  disagg_test::publish_pattern(ex, 2, 1000);  // prefill goes on
  CHECK(steady::now() - t0 < ms(500));
  CHECK(decode_once(ex.port(), 2) < ms(2000));  // so does another decode node
  until_closed(fd, ms(5000));
}

TEST_CASE("exporter: publishing a large request does not hold decode nodes waiting") {
  // publish summarises every block of the request (seconds for gigabytes of KV), without the
  // exporter's lock: heartbeats are answered meanwhile, each far sooner than the publish takes.
  exporter_options eo = quick();
  eo.io_timeout = ms(5000);
  const std::uint32_t tokens = 8192 * 16;  // 16384 blocks, 128 MiB
  kv_exporter ex(layout, 2 * layout.blocks_for(tokens) + 64, eo);
  disagg_test::publish_pattern(ex, 1, 100);
  ucx_engine engine({ms(10000), 128});
  ucx_remote_tier tier(engine, client(ex.port()));
  const auto slots = ex.allocate(2, tokens);
  for (const oasiskv::slot_id s : slots) {
    std::memset(ex.slot_data(s), 0x3c, layout.block_bytes());
  }
  std::atomic<bool> publishing{true};
  const auto t0 = steady::now();
  std::thread prefill([&] {
    ex.publish(2);
    publishing = false;
  });
  ms worst{0};
  int during = 0;
  while (publishing) {
    const auto h0 = steady::now();
    tier.heartbeat();
    worst = std::max(worst, std::chrono::duration_cast<ms>(steady::now() - h0));
    during += publishing ? 1 : 0;
  }
  prefill.join();
  const auto took = std::chrono::duration_cast<ms>(steady::now() - t0);
  MESSAGE("publish of 16384 blocks: ", took.count(), " ms; ", during,
          " heartbeats answered meanwhile, the slowest in ", worst.count(), " ms");
  CHECK(during > 0);
  if (took > ms(100)) {  // long enough for a lock held through it to show
    CHECK(worst < took / 2);
  }
  CHECK(tier.open(2, true).summaries.size() == slots.size() * summary_bytes(layout));
  tier.release(2);
}
