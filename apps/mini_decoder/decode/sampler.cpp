// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/decode/sampler.hpp>

#include <algorithm>
#include <cmath>

#include <mini_decoder/io/error.hpp>

namespace mini_decoder {

int argmax(const float* logits, std::uint32_t vocab) {
  int best = 0;
  for (std::uint32_t i = 1; i < vocab; ++i) {
    if (logits[i] > logits[best]) {
      best = static_cast<int>(i);
    }
  }
  return best;
}

sampler::sampler(float temperature, float top_p, std::uint64_t seed)
    : temperature_(temperature), top_p_(top_p), state_(seed) {
  if (temperature < 0.0f || !(top_p > 0.0f && top_p <= 1.0f)) {
    fail("--temperature = ", temperature, " must be >= 0 and --top-p = ", top_p,
         " must be in (0, 1]");
  }
}

double sampler::next_uniform() {
  // splitmix64: the same stream on every platform and standard library.
  std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

int sampler::sample(const float* logits, std::uint32_t vocab) {
  if (greedy()) {
    return argmax(logits, vocab);
  }
  const float mx = *std::max_element(logits, logits + vocab);
  probs_.resize(vocab);
  double sum = 0.0;
  for (std::uint32_t i = 0; i < vocab; ++i) {
    const float p = std::exp((logits[i] - mx) / temperature_);
    probs_[i] = {p, static_cast<int>(i)};
    sum += p;
  }
  const double u = next_uniform();
  if (top_p_ >= 1.0f) {
    double acc = 0.0;
    for (std::uint32_t i = 0; i < vocab; ++i) {
      acc += probs_[i].first / sum;
      if (u < acc) {
        return probs_[i].second;
      }
    }
    return static_cast<int>(vocab - 1);
  }
  std::sort(probs_.begin(), probs_.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  double kept = 0.0;
  std::size_t n = 0;
  while (n < probs_.size() && kept < top_p_ * sum) {
    kept += probs_[n++].first;
  }
  double acc = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    acc += probs_[i].first / kept;
    if (u < acc) {
      return probs_[i].second;
    }
  }
  return probs_[n - 1].second;
}

}  // namespace mini_decoder
