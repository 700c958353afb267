// SPDX-License-Identifier: Apache-2.0
// The llama2.c tokenizer: SentencePiece-like pieces with merge scores, byte fallback, BOS = 1.
#include <cctype>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <unordered_map>

#include <mini_decoder/io/error.hpp>
#include <mini_decoder/tokenizer/tokenizer.hpp>

namespace mini_decoder {
namespace {

class llama2c_tokenizer final : public tokenizer {
 public:
  llama2c_tokenizer(const std::string& path, std::uint32_t vocab) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      fail("cannot open llama2.c tokenizer '", path,
           "' (pass --tokenizer, or put tok<vocab>.bin beside the model)", fetch_hint);
    }
    std::int32_t max_len = 0;
    in.read(reinterpret_cast<char*>(&max_len), 4);
    pieces_.resize(vocab);
    scores_.resize(vocab);
    for (std::uint32_t i = 0; i < vocab; ++i) {
      std::int32_t len = 0;
      in.read(reinterpret_cast<char*>(&scores_[i]), 4);
      in.read(reinterpret_cast<char*>(&len), 4);
      if (!in || len < 0 || len > 4096) {
        fail("llama2.c tokenizer '", path, "' is truncated or corrupt at token ", i);
      }
      pieces_[i].resize(static_cast<std::size_t>(len));
      in.read(pieces_[i].data(), len);
      if (!in) {
        fail("llama2.c tokenizer '", path, "' is truncated at token ", i);
      }
      lookup_.emplace(pieces_[i], static_cast<int>(i));  // first wins, like a stable search
    }
  }

  std::vector<int> encode(const std::string& text, bool add_bos) const override {
    std::vector<int> t;
    if (add_bos) {
      t.push_back(1);
    }
    if (!text.empty()) {
      t.push_back(find(" "));  // SentencePiece's dummy prefix
    }
    std::string cp;
    for (std::size_t i = 0; i < text.size(); ++i) {
      const auto c = static_cast<unsigned char>(text[i]);
      if ((c & 0xC0) != 0x80) {
        cp.clear();
      }
      cp.push_back(static_cast<char>(c));
      if (i + 1 < text.size() && (static_cast<unsigned char>(text[i + 1]) & 0xC0) == 0x80 &&
          cp.size() < 4) {
        continue;
      }
      if (const int id = find(cp); id >= 0) {
        t.push_back(id);
      } else {
        for (unsigned char b : cp) {
          t.push_back(b + 3);  // byte fallback: <0x00> is token 3
        }
      }
      cp.clear();
    }
    for (;;) {  // merge the best-scoring adjacent pair until none is in the vocabulary
      float best = -1e10f;
      int best_id = -1;
      std::size_t at = 0;
      for (std::size_t i = 0; i + 1 < t.size(); ++i) {
        const int id = find(pieces_[static_cast<std::size_t>(t[i])] +
                            pieces_[static_cast<std::size_t>(t[i + 1])]);
        if (id >= 0 && scores_[static_cast<std::size_t>(id)] > best) {
          best = scores_[static_cast<std::size_t>(id)];
          best_id = id;
          at = i;
        }
      }
      if (best_id < 0) {
        break;
      }
      t[at] = best_id;
      t.erase(t.begin() + static_cast<std::ptrdiff_t>(at) + 1);
    }
    return t;
  }

  std::string decode(int prev, int token) const override {
    if (token < 0 || static_cast<std::size_t>(token) >= pieces_.size()) {
      return {};
    }
    std::string piece = pieces_[static_cast<std::size_t>(token)];
    if (prev == 1 && !piece.empty() && piece[0] == ' ') {
      piece.erase(0, 1);
    }
    unsigned int byte = 0;
    if (piece.size() == 6 && std::sscanf(piece.c_str(), "<0x%02X>", &byte) == 1) {
      piece = std::string(1, static_cast<char>(byte));
    }
    // llama2.c prints a lone byte only if it is printable or white space.
    if (piece.size() == 1) {
      const auto b = static_cast<unsigned char>(piece[0]);
      if (!(std::isprint(b) || std::isspace(b))) {
        return {};
      }
    }
    return piece;
  }

  bool is_end(int token) const override { return token == 1; }  // llama2.c stops at BOS
  std::string chat_prompt(const std::string&) const override {
    fail("this llama2.c model has no chat template; drop --chat");
  }
  bool adds_bos() const override { return true; }
  std::uint32_t vocab_size() const override { return static_cast<std::uint32_t>(pieces_.size()); }

 private:
  int find(const std::string& s) const {
    const auto it = lookup_.find(s);
    return it == lookup_.end() ? -1 : it->second;
  }
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int> lookup_;
};

}  // namespace

std::unique_ptr<tokenizer> make_llama2c_tokenizer(const std::string& path, std::uint32_t vocab) {
  return std::make_unique<llama2c_tokenizer>(path, vocab);
}

}  // namespace mini_decoder
