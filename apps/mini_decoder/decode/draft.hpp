// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Draft sources for speculative decoding. Self-speculation (the model's first layers)
//! lives in the decoder, which owns the caches; prompt lookup is a pure function of the text.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mini_decoder {

enum class draft_kind : std::uint8_t { none, self, ngram };
const char* to_string(draft_kind k);
draft_kind parse_draft(const std::string& s);  // throws decoder_error on an unknown name

//! Prompt lookup: the longest suffix of `context` (up to `max_ngram` tokens) that occurred
//! before, most recent occurrence first; proposes up to `g` tokens that followed it there.
std::vector<int> ngram_draft(const std::vector<int>& context, std::uint32_t g,
                             std::uint32_t max_ngram = 3);

}  // namespace mini_decoder
