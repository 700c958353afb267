// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/decode/sampler.hpp>

#include <algorithm>
#include <cmath>
#include <limits>

#include <mini_decoder/io/error.hpp>

#include "oasiskv/cpu/math.hpp"

namespace mini_decoder {

// The first largest logit (NaN never), by the library's vector argmax: greedy decoding runs it
// over the whole vocabulary once per verified row, on the step's serial path.
int argmax(const float* logits, std::uint32_t vocab) {
  return static_cast<int>(oasiskv::cpu::detail::argmax(logits, vocab));
}

token_logprobs log_softmax_of(const float* logits, std::uint32_t vocab, int token, int top) {
  token_logprobs r;
  r.token = token;
  float mx = -std::numeric_limits<float>::infinity();
  for (std::uint32_t i = 0; i < vocab; ++i) {
    mx = std::max(mx, logits[i]);
  }
  double sum = 0.0;
  for (std::uint32_t i = 0; i < vocab; ++i) {
    sum += std::exp(static_cast<double>(logits[i]) - mx);
  }
  const double lse = mx + std::log(sum);
  r.logprob = static_cast<float>(logits[token] - lse);
  if (top > 0) {
    const auto k = std::min<std::uint32_t>(static_cast<std::uint32_t>(top), vocab);
    // The k largest in one pass: a sorted list of at most k (k is small: at most 20 or so).
    const auto before = [&](int a, int b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    };
    std::vector<int> best;
    best.reserve(k + 1);
    for (std::uint32_t i = 0; i < vocab; ++i) {
      const int id = static_cast<int>(i);
      if (best.size() == k && !before(id, best.back())) {
        continue;
      }
      best.insert(std::upper_bound(best.begin(), best.end(), id, before), id);
      if (best.size() > k) {
        best.pop_back();
      }
    }
    for (const int id : best) {
      r.top.emplace_back(id, static_cast<float>(logits[id] - lse));
    }
  }
  return r;
}

sampler::sampler(float temperature, float top_p, std::uint64_t seed)
    : sampler(sampling_params{temperature, top_p, 0, 0.0f, 0.0f, {}, seed, -1}) {}

sampler::sampler(const sampling_params& p) : p_(p), state_(p.seed) {
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature) ||
      !(p.top_p > 0.0f && p.top_p <= 1.0f)) {
    fail("--temperature = ", p.temperature, " must be >= 0 and --top-p = ", p.top_p,
         " must be in (0, 1]");
  }
  if (!std::isfinite(p.presence_penalty) || !std::isfinite(p.frequency_penalty)) {
    fail("sampling: the presence and frequency penalties must be finite");
  }
  for (const auto& [token, bias] : p.logit_bias) {
    if (token < 0 || !std::isfinite(bias)) {
      fail("sampling: logit_bias of token ", token, " = ", bias,
           ": tokens are >= 0 and biases finite");
    }
  }
  if (p.logprobs < -1) {
    fail("sampling: logprobs = ", p.logprobs, " must be -1 (none) or more");
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

void sampler::accept(int token) {
  if ((p_.presence_penalty == 0.0f && p_.frequency_penalty == 0.0f) || token < 0) {
    return;
  }
  const auto t = static_cast<std::size_t>(token);
  if (counts_.size() <= t) {
    counts_.resize(t + 1, 0);
  }
  ++counts_[t];
}

// The logits with penalties, bias and top_k applied (a copy), or `logits` itself when none is.
const float* sampler::adjusted(const float* logits, std::uint32_t vocab) {
  const bool penalize = p_.presence_penalty != 0.0f || p_.frequency_penalty != 0.0f;
  const bool truncate = p_.top_k > 0 && p_.top_k < vocab;
  if (!penalize && p_.logit_bias.empty() && !truncate) {
    return logits;
  }
  work_.assign(logits, logits + vocab);
  if (penalize) {
    for (std::size_t t = 0; t < counts_.size() && t < vocab; ++t) {
      if (counts_[t] > 0) {
        work_[t] -= static_cast<float>(counts_[t]) * p_.frequency_penalty + p_.presence_penalty;
      }
    }
  }
  for (const auto& [token, bias] : p_.logit_bias) {
    if (static_cast<std::uint32_t>(token) < vocab) {
      work_[static_cast<std::size_t>(token)] += bias;
    }
  }
  if (truncate) {
    order_.resize(vocab);
    for (std::uint32_t i = 0; i < vocab; ++i) {
      order_[i] = static_cast<int>(i);
    }
    const auto before = [&](int a, int b) {
      return work_[static_cast<std::size_t>(a)] > work_[static_cast<std::size_t>(b)] ||
             (work_[static_cast<std::size_t>(a)] == work_[static_cast<std::size_t>(b)] && a < b);
    };
    std::nth_element(order_.begin(), order_.begin() + p_.top_k - 1, order_.end(), before);
    const float low = -std::numeric_limits<float>::infinity();
    for (std::uint32_t i = p_.top_k; i < vocab; ++i) {
      work_[static_cast<std::size_t>(order_[i])] = low;  // after the k-th: dropped
    }
  }
  return work_.data();
}

int sampler::draw(const float* logits, std::uint32_t vocab) {
  const float temperature = p_.temperature, top_p = p_.top_p;
  const float mx = *std::max_element(logits, logits + vocab);
  probs_.resize(vocab);
  double sum = 0.0;
  for (std::uint32_t i = 0; i < vocab; ++i) {
    const float p = std::exp((logits[i] - mx) / temperature);
    probs_[i] = {p, static_cast<int>(i)};
    sum += p;
  }
  const double u = next_uniform();
  if (top_p >= 1.0f) {
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
  while (n < probs_.size() && kept < top_p * sum) {
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

int sampler::sample(const float* raw, std::uint32_t vocab) {
  const float* logits = adjusted(raw, vocab);
  int chosen = 0;
  if (greedy()) {
    chosen = argmax(logits, vocab);
  } else {
    chosen = draw(logits, vocab);
  }
  if (p_.logprobs >= 0) {
    last_ = log_softmax_of(raw, vocab, chosen, p_.logprobs);
  }
  return chosen;
}

}  // namespace mini_decoder
