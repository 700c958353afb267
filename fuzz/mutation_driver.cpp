// SPDX-License-Identifier: Apache-2.0
// A deterministic random-mutation driver for compilers without libFuzzer (gcc): starts from the
// target's seeds (`fuzz_seeds`) and applies bit flips, byte overwrites, truncations, insertions,
// length-field edits and splices for a bounded time. Usage: <target> [seconds]
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

// The target's seed inputs (defined beside its LLVMFuzzerTestOneInput).
std::vector<std::vector<std::uint8_t>> fuzz_seeds();

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 30.0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  std::mt19937_64 rng(20261129);
  const auto corpus = fuzz_seeds();
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
  std::printf("%s: %llu mutated inputs in %.0f s, no crash\n", argv[0],
              static_cast<unsigned long long>(runs), seconds);
  return 0;
}
