// SPDX-License-Identifier: Apache-2.0
// Fuzz target of the exporter's control channel as a peer sees it: a real `kv_exporter` in this
// process, and each input sent over a fresh TCP connection as a sequence of byte runs (whole
// frames, parts of frames, garbage, huge lengths, a second hello, messages out of order). The
// first byte's low bit says whether the connection completes the handshake first (so the
// authenticated dispatch is reached). The exporter must never crash, and after every 64 inputs
// a well-behaved decode node must still complete the handshake and get a heartbeat answered.
//
// Input layout after the first byte: runs of [u16 length (little-endian)][length bytes].
#include <sys/socket.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <vector>

#include "oasiskv/disagg/kv_exporter.hpp"
#include "oasiskv/disagg/ucx_remote_tier.hpp"
#include "seed_messages.hpp"

namespace {

using namespace oasiskv::disagg;
using ms = std::chrono::milliseconds;

token_type fuzz_token() {
  token_type t;
  for (std::size_t i = 0; i < t.size(); ++i) {
    t[i] = static_cast<std::byte>(0x20 + i);
  }
  return t;
}

kv_exporter& exporter() {
  static kv_exporter* ex = [] {
    exporter_options o;
    o.token = fuzz_token();
    o.io_timeout = ms(200);
    o.lease = ms(60000);
    auto* e = new kv_exporter(fuzz::seed_layout, 256, o);  // lives for the process
    for (std::uint64_t seq = 1; seq <= 4; ++seq) {
      const auto slots = e->allocate(seq, 40);
      for (const oasiskv::slot_id s : slots) {
        std::memset(e->slot_data(s), static_cast<int>(seq), fuzz::seed_layout.block_bytes());
      }
      e->publish(seq);
    }
    return e;
  }();
  return *ex;
}

// A well-behaved decode node's exchange: the handshake, then a heartbeat. Aborts if refused.
void check_alive() {
  const auto deadline = steady::now() + ms(3000);
  fd_handle fd = connect_tcp("127.0.0.1", exporter().port(), ms(3000));
  client_handshake(fd.get(), fuzz_token(), "liveness", 0, deadline, "liveness");
  send_all(fd.get(), encode(heartbeat_msg{}, 3), deadline, "liveness");
  const received_frame f = recv_frame(fd.get(), deadline, "liveness");
  if (!std::holds_alternative<heartbeat_ack_msg>(f.body)) {
    std::fprintf(stderr, "exporter_dispatch: the exporter stopped serving decode nodes\n");
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static std::uint64_t inputs = 0;
  if (size < 1) {
    return 0;
  }
  try {
    const auto deadline = steady::now() + ms(1000);
    fd_handle fd = connect_tcp("127.0.0.1", exporter().port(), ms(1000));
    if (data[0] & 1) {
      client_handshake(fd.get(), fuzz_token(), "fuzz", 0, deadline, "fuzz");
    }
    std::size_t at = 1;
    while (at + 2 <= size) {
      const std::size_t n =
          std::min<std::size_t>(data[at] | (std::size_t{data[at + 1]} << 8), size - at - 2);
      at += 2;
      if (::send(fd.get(), data + at, n, MSG_NOSIGNAL) < 0) {
        break;  // the exporter closed the connection: what it does with a bad peer
      }
      at += n;
    }
    // Done sending: the exporter sees the end of the stream; read what it answers until it
    // closes the connection.
    ::shutdown(fd.get(), SHUT_WR);
    std::byte buf[4096];
    while (steady::now() < deadline + ms(1000)) {
      pollfd p{fd.get(), POLLIN, 0};
      if (::poll(&p, 1, 100) != 1 || ::recv(fd.get(), buf, sizeof buf, 0) <= 0) {
        break;
      }
    }
  } catch (const oasiskv::error&) {
    // The connection was refused or cut: the exporter's answer to a bad peer.
  }
  if (++inputs % 64 == 0) {
    check_alive();
  }
  return 0;
}

// Seeds: message sequences a peer could send, before and after the handshake.
std::vector<std::vector<std::uint8_t>> fuzz_seeds() {
  using namespace oasiskv::disagg;
  auto input = [](bool authenticate, const std::vector<message>& ms_) {
    std::vector<std::uint8_t> in{static_cast<std::uint8_t>(authenticate ? 1 : 0)};
    std::uint64_t id = 10;
    for (const message& m : ms_) {
      const auto f = encode(m, id++);
      in.push_back(static_cast<std::uint8_t>(f.size() & 0xff));
      in.push_back(static_cast<std::uint8_t>(f.size() >> 8));
      for (std::byte b : f) {
        in.push_back(static_cast<std::uint8_t>(b));
      }
    }
    return in;
  };
  std::vector<std::vector<std::uint8_t>> out;
  for (const message& m : fuzz::seed_messages()) {
    out.push_back(input(false, {m}));
    out.push_back(input(true, {m}));
  }
  out.push_back(input(true, {open_msg{1, 1}, heartbeat_msg{{1}}, release_msg{1}}));
  out.push_back(input(true, {open_msg{2, 0}, open_msg{2, 0}, heartbeat_msg{{}}}));
  out.push_back(input(true, {open_msg{99, 1}, release_msg{3}}));
  out.push_back(input(false, {hello_msg{{}, "x", 0}, auth_msg{}}));
  out.push_back(input(false, {hello_msg{{}, "x", 7}, hello_msg{{}, "y", 0}}));
  return out;
}
