// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/decode/draft.hpp>

#include <algorithm>

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

}  // namespace mini_decoder
