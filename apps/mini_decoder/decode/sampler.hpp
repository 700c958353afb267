// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Greedy and temperature / top-p / top-k sampling with a seeded, portable generator;
//! presence and frequency penalties, logit bias, and the log-probabilities of what it samples.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace mini_decoder {

//! How a token is chosen from the logits, as OpenAI's API names the parameters.
struct sampling_params {
  float temperature = 0.0f;  //!< 0: greedy (argmax, first of equals)
  float top_p = 1.0f;        //!< nucleus sampling mass, in (0, 1]
  std::uint32_t top_k = 0;   //!< only the k largest logits (first of equals); 0: all
  //! Subtracted from the logit of every token generated so far (OpenAI's `presence_penalty`).
  float presence_penalty = 0.0f;
  //! Subtracted from a token's logit once per time it was generated (`frequency_penalty`).
  float frequency_penalty = 0.0f;
  std::vector<std::pair<int, float>> logit_bias;  //!< added to these tokens' logits
  std::uint64_t seed = 42;
  //! Log-probabilities reported for each token (`sampler::last`): -1 none, 0 the sampled token's
  //! own, n > 0 also the n most likely tokens'.
  int logprobs = -1;
};

//! A sampled token's log-probabilities: `log_softmax` of the model's logits as computed, before
//! temperature, penalties, bias and truncation (as OpenAI and vLLM report them).
struct token_logprobs {
  int token = -1;
  float logprob = 0.0f;
  std::vector<std::pair<int, float>> top;  //!< most likely first (of equals: the lower id)
};

class sampler {
 public:
  //! temperature 0: greedy (argmax, first of equals). top_p in (0, 1]: nucleus sampling.
  sampler(float temperature, float top_p, std::uint64_t seed);
  //! All of `p`. Throws `decoder_error` for a temperature < 0 or not finite, a top_p outside
  //! (0, 1], a penalty or bias that is not finite, a bias on a negative token id or a logprobs
  //! count below -1.
  explicit sampler(const sampling_params& p);
  //! One token from `logits` [vocab]. Draws exactly one random number when sampling, so a
  //! speculative run that samples each verified position consumes the same stream as a plain one.
  //! Penalties and bias change a copy of the logits; top_k keeps the k largest; then greedy, or
  //! temperature and top_p. With `logprobs >= 0`, `last()` then holds the token's log-probs.
  int sample(const float* logits, std::uint32_t vocab);
  //! Counts `token` as generated, for the penalties: called for each token the sequence keeps,
  //! before the next is sampled.
  void accept(int token);
  //! The log-probabilities of the token `sample` returned last (with `logprobs >= 0`).
  const token_logprobs& last() const { return last_; }
  bool greedy() const { return p_.temperature <= 0.0f; }
  bool wants_logprobs() const { return p_.logprobs >= 0; }

 private:
  double next_uniform();                               // [0, 1)
  int draw(const float* logits, std::uint32_t vocab);  // temperature and top_p: one number
  const float* adjusted(const float* logits, std::uint32_t vocab);
  sampling_params p_;
  std::uint64_t state_;
  std::vector<std::pair<float, int>> probs_;
  std::vector<float> work_;            // the logits after penalties, bias and top_k
  std::vector<std::uint32_t> counts_;  // times each token was generated (with penalties)
  std::vector<int> order_;
  token_logprobs last_;
};

int argmax(const float* logits, std::uint32_t vocab);

//! `log_softmax(logits)[token]` and, with `top > 0`, the `top` most likely tokens' (most likely
//! first, of equals the lower id), in double precision.
token_logprobs log_softmax_of(const float* logits, std::uint32_t vocab, int token, int top);

}  // namespace mini_decoder
