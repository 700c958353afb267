// SPDX-License-Identifier: Apache-2.0
// Soak, loopback only, bounded in time (OASISKV_SOAK_SECONDS, default 15): decode clients admit
// and decode requests against two exporters while one is SIGKILLed and restarted every few
// seconds and other peers send garbage to both. Throughout, every staged block must equal the
// exporter's bytes, and every failure must be one a client expects of a lost exporter. At the
// end no lease is left behind on the exporter that stayed up, and no file descriptor leaked.
#include <doctest/doctest.h>

#include <dirent.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "disagg/disagg_support.hpp"
#include "oasiskv/disagg/remote_sequence.hpp"

using namespace oasiskv::disagg;
using disagg_test::layout;
using oasiskv::errc;
using ms = std::chrono::milliseconds;

namespace {

constexpr std::uint32_t requests = 600, tokens = 100;  // per exporter: 7 blocks x 2 layers
constexpr int lease_ms = 1500;

std::uint16_t start(disagg_test::child& c, std::uint64_t first_seq) {
  disagg_test::spawn(c, {DISAGG_PROC, "export", std::to_string(requests), std::to_string(tokens),
                         std::to_string(lease_ms), "120", std::to_string(first_seq)});
  const std::string l = c.line();
  REQUIRE_MESSAGE(l.rfind("port ", 0) == 0, "exporter said: ", l);
  return static_cast<std::uint16_t>(std::stoul(l.substr(5)));
}

std::size_t open_fds() {
  std::size_t n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d) != nullptr) {
      ++n;
    }
    ::closedir(d);
  }
  return n;
}

remote_tier_options client(std::uint16_t port, const std::string& name) {
  remote_tier_options o;
  o.port = port;
  o.token = disagg_test::token();
  o.client = name;
  o.io_timeout = ms(1000);
  return o;
}

struct totals {
  std::atomic<std::uint64_t> finished{0}, failed{0}, blocks_checked{0}, bad_blocks{0};
  std::mutex mutex;
  std::map<std::string, std::uint64_t> failures;  // code -> count, unexpected ones flagged
};

}  // namespace

TEST_CASE("soak: decode clients, one exporter killed and restarted, garbage peers") {
  const char* env = std::getenv("OASISKV_SOAK_SECONDS");
  const double seconds = env != nullptr ? std::atof(env) : 15.0;
  const std::size_t fds_before = open_fds();
  disagg_test::child a, b;
  std::atomic<std::uint16_t> port_a{start(a, 1)};
  const std::uint16_t port_b = start(b, 100001);
  std::atomic<std::uint64_t> next_a{1}, next_b{100001};  // requests not yet taken
  std::atomic<bool> stop{false};
  std::atomic<int> restarts{0};
  totals t;
  std::mutex a_mutex;  // the child handle of A, replaced on restart

  auto client_loop = [&](int id) {
    std::mt19937 rng(static_cast<unsigned>(id));
    std::normal_distribution<float> nd;
    ucx_engine engine({ms(500), 128});
    std::map<bool, std::unique_ptr<ucx_remote_tier>> tiers;  // on_a -> tier
    std::map<bool, std::uint16_t> tier_port;
    std::vector<float> q(layout.num_q_heads * layout.head_dim);
    std::vector<std::uint32_t> sel;
    std::vector<oasiskv::block_ref> refs;
    std::vector<std::byte> want(layout.block_bytes());
    while (!stop) {
      const bool on_a = rng() % 2 == 0;
      const std::uint16_t port = on_a ? port_a.load() : port_b;
      const std::uint64_t seq = on_a ? next_a++ : next_b++;
      if ((on_a && seq > requests) || (!on_a && seq > 100000 + requests)) {
        std::this_thread::sleep_for(ms(5));  // all taken (A's come back with its restart)
        continue;
      }
      try {
        if (!tiers[on_a] || tier_port[on_a] != port) {
          tiers[on_a].reset();
          tiers[on_a] = std::make_unique<ucx_remote_tier>(
              engine, client(port, "soak-" + std::to_string(id) + (on_a ? "-a" : "-b")));
          tier_port[on_a] = port;
        }
        admission_options o;
        o.budget_tokens = 48;  // 3 of the 6 remote blocks per layer
        remote_sequence rs(*tiers[on_a], seq, o);
        for (int step = 0; step < 20; ++step) {  // a decode: steps a few ms apart
          std::this_thread::sleep_for(ms(2));
          for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
            for (float& x : q) {
              x = nd(rng);
            }
            rs.select(l, q.data(), sel);
            refs.clear();
            rs.stage(l, sel, refs);
            for (const oasiskv::block_ref& r : refs) {
              if (r.index >= tokens / layout.tokens_per_block) {
                continue;  // the local tail
              }
              disagg_test::fill_block(want.data(), seq, l, r.index, want.size());
              t.bad_blocks += std::memcmp(rs.pool().slot(r.slot), want.data(), want.size()) != 0;
              ++t.blocks_checked;
            }
          }
        }
        ++t.finished;
      } catch (const oasiskv::error& e) {
        ++t.failed;
        // A lost exporter shows as a failed transfer, a control channel that is gone, or (after
        // a restart) a request the new process has not published or another client took.
        const bool expected = e.code() == errc::transfer_failed || e.code() == errc::io_error ||
                              e.code() == errc::unknown_sequence ||
                              e.code() == errc::slot_in_flight;
        std::lock_guard lock(t.mutex);
        ++t.failures[std::string(expected ? "" : "UNEXPECTED ") +
                     std::string(oasiskv::to_string(e.code())) +
                     (expected ? "" : std::string(": ") + e.what())];
        tiers[on_a].reset();  // a tier whose exporter failed is not reused
      }
    }
  };

  std::vector<std::thread> clients;
  for (int i = 0; i < 3; ++i) {
    clients.emplace_back(client_loop, i);
  }
  std::thread garbage([&] {
    std::mt19937 rng(99);
    while (!stop) {
      try {
        fd_handle fd = connect_tcp("127.0.0.1", rng() % 2 ? port_a.load() : port_b, ms(500));
        std::vector<std::byte> junk(1 + rng() % 200);
        for (auto& x : junk) {
          x = static_cast<std::byte>(rng());
        }
        if (rng() % 3 == 0) {  // sometimes a valid header first
          const auto h = encode(hello_msg{{}, "garbage", 0}, 1);
          junk.insert(junk.begin(), h.begin(), h.begin() + header_bytes);
        }
        send_all(fd.get(), junk, steady::now() + ms(200), "garbage");
      } catch (const oasiskv::error&) {
      }
      std::this_thread::sleep_for(ms(10));
    }
  });
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(ms(2500));
    if (std::chrono::steady_clock::now() >= until) {
      break;
    }
    std::lock_guard lock(a_mutex);
    ::kill(a.pid, SIGKILL);
    ::waitpid(a.pid, nullptr, 0);
    a.pid = -1;
    ::close(a.out);
    a.out = -1;
    port_a = start(a, 1);
    next_a = 1;  // the new process publishes requests 1.. again, with the same bytes
    ++restarts;
  }
  stop = true;
  for (auto& c : clients) {
    c.join();
  }
  garbage.join();

  MESSAGE("soak: ", seconds, " s, ", restarts.load(), " restarts of A; ", t.finished.load(),
          " requests decoded, ", t.failed.load(), " failed, ", t.blocks_checked.load(),
          " staged blocks checked");
  for (const auto& [what, n] : t.failures) {
    MESSAGE("  failures: ", n, " x ", what);
    CHECK(what.rfind("UNEXPECTED", 0) != 0);
  }
  CHECK(t.bad_blocks == 0);
  CHECK(t.blocks_checked > 0);
  CHECK(t.finished > 0);
  // The exporter that stayed up holds no lease after one lease period: every request is either
  // consumed (released) or free to open.
  std::this_thread::sleep_for(ms(lease_ms + 500));
  {
    ucx_engine engine({ms(2000), 128});
    ucx_remote_tier tier(engine, client(port_b, "auditor"));
    std::uint64_t leased = 0, open_ok = 0;
    for (std::uint64_t seq = 100001; seq <= 100000 + requests; ++seq) {
      try {
        tier.open(seq, false);
        tier.release(seq);
        ++open_ok;
      } catch (const oasiskv::error& e) {
        leased += e.code() == errc::slot_in_flight;
      }
    }
    MESSAGE("B after the soak: ", open_ok, " requests still free to open, ", leased, " leased");
    CHECK(leased == 0);
  }
  CHECK(open_fds() <= fds_before + 4);  // the children's pipes are still open; no leak beyond
}
