// SPDX-License-Identifier: Apache-2.0
// A deterministic random-mutation driver for compilers without libFuzzer (gcc): starts from one
// valid frame of each message type and applies bit flips, byte overwrites, truncations,
// insertions and length-field edits for a bounded time. Usage: fuzz_control_protocol [seconds]
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "oasiskv/disagg/protocol.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {
std::vector<std::vector<std::uint8_t>> seeds() {
  using namespace oasiskv::disagg;
  const oasiskv::kv_layout l{2, 4, 2, 64, 16, oasiskv::dtype::f16};
  hello_ack_msg a;
  a.session = 1;
  a.lease_ms = 100;
  a.layout = l;
  a.num_slots = 4;
  a.slot_bytes = l.block_bytes();
  a.arena = {4096, 4 * l.block_bytes(), std::vector<std::byte>(24, std::byte{1})};
  a.generations = {8192, 32, std::vector<std::byte>(24, std::byte{2})};
  a.worker_address.assign(30, std::byte{3});
  opened_msg o;
  o.seq = 1;
  o.tokens = 20;
  o.num_layers = 2;
  o.blocks_per_layer = 2;
  o.blocks = {{0, 1}, {1, 1}, {2, 1}, {3, 1}};
  o.summary_bytes = 8;
  o.summaries.assign(32, std::byte{7});
  std::vector<message> ms{hello_msg{{}, "d"}, a,
                          open_msg{1, 1},     o,
                          heartbeat_msg{},    heartbeat_ack_msg{1, 1},
                          release_msg{1},     released_msg{1},
                          error_msg{3, "x"}};
  std::vector<std::vector<std::uint8_t>> out;
  for (const message& m : ms) {
    const auto f = encode(m, 5);
    std::vector<std::uint8_t> frame{0};  // even first byte: frame mode
    for (std::byte b : f) {
      frame.push_back(static_cast<std::uint8_t>(b));
    }
    out.push_back(frame);
    std::vector<std::uint8_t> direct(2 + f.size() - header_bytes);
    direct[0] = 1;  // odd first byte: direct payload mode
    direct[1] = static_cast<std::uint8_t>(m.index());
    for (std::size_t i = header_bytes; i < f.size(); ++i) {
      direct[2 + i - header_bytes] = static_cast<std::uint8_t>(f[i]);
    }
    out.push_back(direct);
  }
  return out;
}
}  // namespace

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 30.0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  std::mt19937_64 rng(20261129);
  const auto corpus = seeds();
  std::uint64_t runs = 0;
  for (const auto& s : corpus) {
    LLVMFuzzerTestOneInput(s.data(), s.size());
  }
  while (std::chrono::steady_clock::now() < until) {
    for (int batch = 0; batch < 1000; ++batch, ++runs) {
      std::vector<std::uint8_t> in = corpus[rng() % corpus.size()];
      const int edits = 1 + static_cast<int>(rng() % 4);
      for (int e = 0; e < edits && !in.empty(); ++e) {
        const std::size_t at = rng() % in.size();
        switch (rng() % 6) {
          case 0:
            in[at] ^= static_cast<std::uint8_t>(1u << (rng() % 8));
            break;
          case 1:
            in[at] = static_cast<std::uint8_t>(rng());
            break;
          case 2:
            in.resize(at);
            break;
          case 3:
            in.insert(in.begin() + static_cast<std::ptrdiff_t>(at),
                      static_cast<std::uint8_t>(rng()));
            break;
          case 4: {  // a plausible but wrong 32-bit length or count
            const std::uint32_t v = static_cast<std::uint32_t>(rng() % 3 == 0 ? rng() : rng() % 64);
            for (int i = 0; i < 4 && at + static_cast<std::size_t>(i) < in.size(); ++i) {
              in[at + static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(v >> (8 * i));
            }
            break;
          }
          default: {  // splice the tail of another seed
            const auto& o = corpus[rng() % corpus.size()];
            in.resize(at);
            in.insert(in.end(), o.begin() + static_cast<std::ptrdiff_t>(rng() % o.size()), o.end());
          }
        }
      }
      LLVMFuzzerTestOneInput(in.data(), in.size());
    }
  }
  std::printf("fuzz_control_protocol: %llu mutated inputs in %.0f s, no crash\n",
              static_cast<unsigned long long>(runs), seconds);
  return 0;
}
