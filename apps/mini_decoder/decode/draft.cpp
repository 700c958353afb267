// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/decode/draft.hpp>

#include <algorithm>
#include <cmath>

#include <mini_decoder/decode/sampler.hpp>
#include <mini_decoder/io/error.hpp>

namespace mini_decoder {

const char* to_string(draft_kind k) {
  switch (k) {
    case draft_kind::none:
      return "none";
    case draft_kind::self:
      return "self";
    case draft_kind::ngram:
      return "ngram";
  }
  return "?";
}

draft_kind parse_draft(const std::string& s) {
  for (auto k : {draft_kind::none, draft_kind::self, draft_kind::ngram}) {
    if (s == to_string(k)) {
      return k;
    }
  }
  fail("unknown --draft '", s, "' (self, ngram, none)");
}

std::vector<int> ngram_draft(const std::vector<int>& context, std::uint32_t g,
                             std::uint32_t max_ngram) {
  const std::size_t n = context.size();
  for (std::uint32_t k = std::min<std::size_t>(max_ngram, n > 0 ? n - 1 : 0); k >= 1; --k) {
    const auto suffix = context.end() - k;
    // Most recent earlier occurrence: search backwards, excluding the suffix itself.
    for (std::size_t start = n - k; start-- > 0;) {
      if (std::equal(suffix, context.end(), context.begin() + static_cast<std::ptrdiff_t>(start))) {
        const std::size_t from = start + k;
        const std::size_t to = std::min(n, from + g);
        if (to > from) {
          return {context.begin() + static_cast<std::ptrdiff_t>(from),
                  context.begin() + static_cast<std::ptrdiff_t>(to)};
        }
      }
    }
  }
  return {};
}

draft_length::draft_length(std::uint32_t max, bool adaptive) : max_(max), adaptive_(adaptive) {
  if (max > 15) {
    fail("a draft length of ", max, " is beyond 15 (a verification is at most 16 tokens)");
  }
}

std::uint32_t draft_length::next() {
  if (!adaptive_ || max_ == 0) {
    return max_;
  }
  const float a = acceptance();
  // The longest g with a^g >= threshold: g <= log(threshold) / log(a).
  const float longest = a >= 1.0f ? static_cast<float>(max_) : std::log(threshold) / std::log(a);
  const auto g = static_cast<std::uint32_t>(std::min(static_cast<float>(max_), longest));
  if (g > 0) {
    idle_ = 0;
    return g;
  }
  if (++idle_ >= probe_rounds) {
    idle_ = 0;
    return 1;
  }
  return 0;
}

void draft_length::update(std::uint32_t drafted, std::uint32_t accepted) {
  if (drafted == 0) {
    return;  // nothing proposed: nothing learnt
  }
  constexpr float decay = 0.8f;  // a round's weight halves in about three rounds
  hits_ = decay * hits_ + static_cast<float>(accepted);
  misses_ = decay * misses_ + (accepted < drafted ? 1.0f : 0.0f);
}

acceptance accept_drafts(sampler& s, const float* logits, std::uint32_t vocab,
                         std::span<const int> drafts, std::vector<token_logprobs>* logprobs) {
  acceptance r;
  if (logprobs) {
    logprobs->clear();
  }
  for (std::size_t i = 0; i <= drafts.size(); ++i) {
    const int t = s.sample(logits + i * std::size_t{vocab}, vocab);
    s.accept(t);
    if (logprobs && s.wants_logprobs()) {
      logprobs->push_back(s.last());
    }
    if (i < drafts.size() && t == drafts[i]) {
      ++r.accepted;
      continue;
    }
    r.next = t;
    break;
  }
  return r;
}

}  // namespace mini_decoder
