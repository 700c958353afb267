// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Shared by the disaggregation tests and their helper process: a layout, a token, a
//! deterministic KV pattern, and spawning a helper with a bounded lifetime.
#pragma once

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "oasiskv/disagg/kv_exporter.hpp"

extern char** environ;

namespace disagg_test {

inline const oasiskv::kv_layout layout{2, 4, 2, 64, 16, oasiskv::dtype::f16};  // 8 KiB blocks

inline oasiskv::disagg::token_type token(char fill = 'k') {
  oasiskv::disagg::token_type t;
  for (std::size_t i = 0; i < t.size(); ++i) {
    t[i] = static_cast<std::byte>(fill + static_cast<char>(i % 7));
  }
  return t;
}

//! The byte at `offset` of block (seq, layer, block): a hash, so a misplaced or torn block shows.
inline std::byte pattern(std::uint64_t seq, std::uint32_t layer, std::uint32_t block,
                         std::size_t offset) {
  std::uint64_t x = seq * 0x9e3779b97f4a7c15ull ^ (std::uint64_t{layer} << 40) ^
                    (std::uint64_t{block} << 20) ^ (offset / 8);
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  return static_cast<std::byte>((x >> ((offset % 8) * 8)) & 0xff);
}

inline void fill_block(std::byte* out, std::uint64_t seq, std::uint32_t layer, std::uint32_t block,
                       std::size_t bytes) {
  for (std::size_t i = 0; i < bytes; ++i) {
    out[i] = pattern(seq, layer, block, i);
  }
}

//! Like `fill_block`, but every element a finite f16 in [-2, 2] (attention over it is
//! meaningful): KV a model could have written.
inline void fill_kv_block(std::byte* out, std::uint64_t seq, std::uint32_t layer,
                          std::uint32_t block, std::size_t bytes) {
  for (std::size_t i = 0; i + 1 < bytes; i += 2) {
    const unsigned bits = std::to_integer<unsigned>(pattern(seq, layer, block, i)) |
                          (std::to_integer<unsigned>(pattern(seq, layer, block, i + 1)) << 8);
    const oasiskv::f16 v =
        oasiskv::f16::from_float(static_cast<float>(static_cast<int>(bits % 2001) - 1000) / 500.0f);
    std::memcpy(out + i, &v, 2);
  }
}

//! Publishes request `seq` of `tokens` tokens with the pattern (`kv`: with `fill_kv_block`).
inline void publish_pattern(oasiskv::disagg::kv_exporter& e, std::uint64_t seq,
                            std::uint32_t tokens, bool kv = false) {
  const auto slots = e.allocate(seq, tokens);
  const std::uint32_t blocks = e.layout().blocks_for(tokens);
  for (std::size_t i = 0; i < slots.size(); ++i) {
    (kv ? fill_kv_block : fill_block)(
        e.slot_data(slots[i]), seq, static_cast<std::uint32_t>(i / blocks),
        static_cast<std::uint32_t>(i % blocks), e.layout().block_bytes());
  }
  e.publish(seq);
}

//! A helper process; SIGKILLed and reaped by the destructor if still running.
struct child {
  pid_t pid = -1;
  int out = -1;  // its stdout
  child() = default;
  child(const child&) = delete;
  child& operator=(const child&) = delete;
  ~child() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);  // delivered to a stopped process too; no SIGCONT, which would let it
                             // run on against endpoints the test has closed
      ::waitpid(pid, nullptr, 0);
    }
    if (out >= 0) {
      ::close(out);
    }
  }
  //! Reads one line of the child's stdout (bounded wait).
  std::string line(std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
    std::string s;
    const auto until = std::chrono::steady_clock::now() + timeout;
    char c;
    while (std::chrono::steady_clock::now() < until) {
      pollfd p{out, POLLIN, 0};
      if (::poll(&p, 1, 100) == 1) {
        if (::read(out, &c, 1) != 1) {
          break;
        }
        if (c == '\n') {
          return s;
        }
        s += c;
      }
    }
    return s;
  }
};

inline void spawn(child& c, const std::vector<std::string>& args) {
  int fds[2];
  if (::pipe(fds) != 0) {
    throw std::runtime_error("pipe failed");
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_addclose(&fa, fds[0]);
  std::vector<char*> argv;
  for (const auto& a : args) {
    argv.push_back(const_cast<char*>(a.c_str()));
  }
  argv.push_back(nullptr);
  const int rc = posix_spawn(&c.pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  ::close(fds[1]);
  c.out = fds[0];
  if (rc != 0) {
    c.pid = -1;
    throw std::runtime_error("posix_spawn of " + args[0] + " failed");
  }
}

}  // namespace disagg_test
