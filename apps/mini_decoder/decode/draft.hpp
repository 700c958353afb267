// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Speculative decoding's parts that need no cache: the draft kinds, prompt lookup (a
//! pure function of the text), each sequence's draft length, and acceptance. Self-speculation
//! (the model's first layers, with a cache of its own) is `self_drafter` (self_draft.hpp).
//! Shared by the single-sequence decoder and the batched engine.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <mini_decoder/decode/sampler.hpp>

namespace mini_decoder {

enum class draft_kind : std::uint8_t { none, self, ngram };
const char* to_string(draft_kind k);
draft_kind parse_draft(const std::string& s);  // throws decoder_error on an unknown name

//! Prompt lookup: the longest suffix of `context` (up to `max_ngram` tokens) that occurred
//! before, most recent occurrence first; proposes up to `g` tokens that followed it there.
std::vector<int> ngram_draft(const std::vector<int>& context, std::uint32_t g,
                             std::uint32_t max_ngram = 3);

//! How many tokens one sequence drafts per round: a fixed length, or one adapted to its recent
//! acceptance. The adaptive one estimates the chance `a` that the next draft is accepted (each
//! round a run of accepted drafts ended by one rejection, or not: decayed counts, a prior of 2
//! in 3) and drafts the longest run whose last token is still accepted with probability at least
//! `threshold` (`a^g >= threshold`). Where that is 0 it drafts nothing, but tries one token every
//! `probe_rounds` rounds, so that a sequence whose text turns predictable drafts again.
class draft_length {
 public:
  static constexpr float threshold = 0.35f;
  static constexpr std::uint32_t probe_rounds = 8;

  //! `max` in [0, 15]: the fixed length, or the adaptive one's cap.
  explicit draft_length(std::uint32_t max = 4, bool adaptive = false);
  //! The length of the next round (0 to max); call once a round.
  std::uint32_t next();
  //! What the round gave: `drafted` tokens proposed (fewer than `next()` where prompt lookup
  //! found less), `accepted` of them taken.
  void update(std::uint32_t drafted, std::uint32_t accepted);
  //! The estimated chance that a draft is accepted.
  float acceptance() const { return (hits_ + 2.0f) / (hits_ + misses_ + 3.0f); }

 private:
  std::uint32_t max_;
  bool adaptive_;
  float hits_ = 0.0f, misses_ = 0.0f;  // decayed counts of accepted and rejected drafts
  std::uint32_t idle_ = 0;             // rounds without a draft since the last probe
};

//! A round's outcome: `accepted` drafts taken, then `next`, the target's own token after them.
struct acceptance {
  std::uint32_t accepted = 0;
  int next = 0;
};

//! Samples the verification's rows in order (`logits` [drafts + 1][vocab]), one draw each as a
//! plain run samples each position, and accepts the longest prefix of `drafts` that the samples
//! equal: greedy and seeded sampling give the tokens a plain run gives. Each token sampled is
//! kept (the accepted drafts and the next), so each is counted by `sampler::accept` before the
//! next row is sampled, as a plain run counts it. With `logprobs` (and the sampler's
//! `logprobs >= 0`), it is set to the kept tokens' log-probabilities, in order.
acceptance accept_drafts(sampler& s, const float* logits, std::uint32_t vocab,
                         std::span<const int> drafts,
                         std::vector<token_logprobs>* logprobs = nullptr);

}  // namespace mini_decoder
