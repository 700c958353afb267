// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Greedy and temperature / top-p sampling with a seeded, portable generator.
#pragma once

#include <cstdint>
#include <vector>

namespace mini_decoder {

class sampler {
 public:
  //! temperature 0: greedy (argmax, first of equals). top_p in (0, 1]: nucleus sampling.
  sampler(float temperature, float top_p, std::uint64_t seed);
  //! One token from `logits` [vocab]. Draws exactly one random number when sampling, so a
  //! speculative run that samples each verified position consumes the same stream as a plain one.
  int sample(const float* logits, std::uint32_t vocab);
  bool greedy() const { return temperature_ <= 0.0f; }

 private:
  double next_uniform();  // [0, 1)
  float temperature_, top_p_;
  std::uint64_t state_;
  std::vector<std::pair<float, int>> probs_;
};

int argmax(const float* logits, std::uint32_t vocab);

}  // namespace mini_decoder
