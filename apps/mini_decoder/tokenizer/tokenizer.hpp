// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Tokenizers read from the model files: GPT-2 byte-level BPE (GGUF metadata) and the
//! llama2.c SentencePiece-like tokenizer (tok512.bin).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace mini_decoder {

class gguf_file;

//! A model's tokenizer. Every member is safe to call from any number of threads at once (a
//! server tokenizes requests on several threads while its engine thread decodes), and encoding
//! takes time O(n log n) in the text's length.
class tokenizer {
 public:
  virtual ~tokenizer() = default;
  //! Token ids of `text`, with the model's BOS first when `add_bos` (and the model uses one).
  virtual std::vector<int> encode(const std::string& text, bool add_bos) const = 0;
  //! `encode`, or nullopt when the tokens (BOS included) would be more than `limit`: known,
  //! without tokenizing the text whole, as soon as the tokens so far or a lower bound from the
  //! bytes left exceed it. The work is then bounded by `limit`, not by the text's length.
  virtual std::optional<std::vector<int>> encode_at_most(const std::string& text, bool add_bos,
                                                         std::size_t limit) const {
    std::vector<int> t = encode(text, add_bos);
    if (t.size() > limit) {
      return std::nullopt;
    }
    return t;
  }
  //! Bytes held by the tokenizer's caches now (bounded; 0 for one without a cache).
  virtual std::size_t cache_bytes() const { return 0; }
  //! The bytes `token` prints as, following `prev` (llama2.c strips the space after BOS).
  virtual std::string decode(int prev, int token) const = 0;
  //! True for tokens that end a generation (EOS, end of turn, llama2.c's BOS).
  virtual bool is_end(int token) const = 0;
  //! `user` wrapped in the model's chat template, ready to encode; throws if it has none.
  virtual std::string chat_prompt(const std::string& user) const = 0;
  virtual bool adds_bos() const = 0;
  virtual std::uint32_t vocab_size() const = 0;
};

std::unique_ptr<tokenizer> make_bpe_tokenizer(const gguf_file& g);
std::unique_ptr<tokenizer> make_llama2c_tokenizer(const std::string& path, std::uint32_t vocab);

//! GPT-2's pre-tokenizer as SmolLM uses it (digits split one by one, then the GPT-2 pattern).
//! Non-ASCII code points count as letters: close to \p{L} for text, exact for ASCII.
std::vector<std::string> pretokenize_smollm(const std::string& text);

}  // namespace mini_decoder
