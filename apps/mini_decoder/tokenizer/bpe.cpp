// SPDX-License-Identifier: Apache-2.0
// GPT-2 style byte-level BPE from GGUF metadata (tokenizer.ggml.tokens / merges / token_type).
#include <algorithm>
#include <limits>
#include <unordered_map>

#include <mini_decoder/io/error.hpp>
#include <mini_decoder/io/gguf.hpp>
#include <mini_decoder/tokenizer/tokenizer.hpp>

namespace mini_decoder {
namespace {

void append_utf8(std::string& s, std::uint32_t cp) {
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    s.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    s.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Decodes UTF-8 into code points with their byte offsets; invalid bytes become single units.
struct code_points {
  std::vector<std::uint32_t> cp;
  std::vector<std::size_t> at;  // byte offset of each, plus the end
};
code_points decode_utf8(const std::string& s) {
  code_points r;
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::size_t len = c < 0x80         ? 1
                      : (c >> 5) == 6  ? 2
                      : (c >> 4) == 14 ? 3
                      : (c >> 3) == 30 ? 4
                                       : 1;
    if (i + len > s.size()) {
      len = 1;
    }
    std::uint32_t v = len == 1 ? c : c & (0x7F >> len);
    for (std::size_t k = 1; k < len; ++k) {
      v = (v << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    }
    r.cp.push_back(v);
    r.at.push_back(i);
    i += len;
  }
  r.at.push_back(s.size());
  return r;
}

bool is_space(std::uint32_t c) {
  return c == ' ' || (c >= 9 && c <= 13) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}
bool is_digit(std::uint32_t c) {
  return c >= '0' && c <= '9';
}
bool is_letter(std::uint32_t c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= 0x80 && !is_space(c));
}
bool is_other(std::uint32_t c) {
  return !is_space(c) && !is_letter(c) && !is_digit(c);
}

// The GPT-2 pattern over one segment (digits already split off).
void gpt2_split(const code_points& p, std::size_t b, std::size_t e, const std::string& text,
                std::vector<std::string>& out) {
  const auto& c = p.cp;
  auto run = [&](std::size_t i, auto pred) {
    while (i < e && pred(c[i]))
      ++i;
    return i;
  };
  for (std::size_t i = b; i < e;) {
    std::size_t j = i;
    if (c[i] == '\'' && i + 1 < e) {
      const std::uint32_t a = c[i + 1], a2 = i + 2 < e ? c[i + 2] : 0;
      if (a == 's' || a == 't' || a == 'm' || a == 'd') {
        j = i + 2;
      } else if ((a == 'r' && a2 == 'e') || (a == 'v' && a2 == 'e') || (a == 'l' && a2 == 'l')) {
        j = i + 3;
      }
    }
    if (j == i) {
      const std::size_t k = c[i] == ' ' && i + 1 < e ? i + 1 : i;
      if (is_letter(c[k])) {
        j = run(k, is_letter);
      } else if (is_digit(c[k])) {
        j = run(k, is_digit);
      } else if (is_other(c[k])) {
        j = run(k, is_other);
      }
    }
    if (j == i) {  // white space: \s+(?!\S) then \s+
      const std::size_t k = run(i, is_space);
      j = (k == e || k - i == 1) ? k : k - 1;
    }
    out.push_back(text.substr(p.at[i], p.at[j] - p.at[i]));
    i = j;
  }
}

class bpe_tokenizer final : public tokenizer {
 public:
  explicit bpe_tokenizer(const gguf_file& g) {
    const std::string kind = g.get_string("tokenizer.ggml.model");
    if (kind != "gpt2") {
      fail("GGUF file '", g.path(), "' has tokenizer '", kind, "'; only 'gpt2' BPE is supported");
    }
    tokens_ = g.get("tokenizer.ggml.tokens").strings;
    const auto& merges = g.get("tokenizer.ggml.merges").strings;
    if (tokens_.empty() || merges.empty()) {
      fail("GGUF file '", g.path(), "' has no tokenizer tokens or merges");
    }
    for (std::size_t i = 0; i < tokens_.size(); ++i) {
      ids_.emplace(tokens_[i], static_cast<int>(i));
    }
    for (std::size_t i = 0; i < merges.size(); ++i) {
      ranks_.emplace(merges[i], static_cast<int>(i));
    }
    if (g.has("tokenizer.ggml.token_type")) {
      const auto& types = g.get("tokenizer.ggml.token_type").ints;
      for (std::size_t i = 0; i < types.size() && i < tokens_.size(); ++i) {
        if (types[i] == 3 || types[i] == 4) {  // control and user-defined: matched whole
          specials_.push_back(static_cast<int>(i));
        }
      }
    }
    bos_ = static_cast<int>(g.get_int("tokenizer.ggml.bos_token_id", -1));
    eos_ = static_cast<int>(g.get_int("tokenizer.ggml.eos_token_id", -1));
    add_bos_ = g.get_int("tokenizer.ggml.add_bos_token", 0) != 0;
    if (const auto it = ids_.find("<|endoftext|>"); it != ids_.end()) {
      eot_ = it->second;
    }
    // GPT-2's bytes_to_unicode: printable bytes stand for themselves, the rest map past 255.
    std::uint32_t extra = 256;
    for (std::uint32_t b = 0; b < 256; ++b) {
      const bool keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
      const std::uint32_t cp = keep ? b : extra++;
      byte_sym_[b].clear();
      append_utf8(byte_sym_[b], cp);
      sym_byte_[cp] = static_cast<unsigned char>(b);
    }
  }

  std::vector<int> encode(const std::string& text, bool add_bos) const override {
    std::vector<int> out;
    if (add_bos && add_bos_ && bos_ >= 0) {
      out.push_back(bos_);
    }
    std::size_t start = 0;
    for (std::size_t i = 0; i < text.size();) {
      int special = -1;
      std::size_t special_len = 0;
      if (text[i] == '<') {
        for (int s : specials_) {
          const std::string& t = tokens_[static_cast<std::size_t>(s)];
          if (t.size() > special_len && text.compare(i, t.size(), t) == 0) {
            special = s;
            special_len = t.size();
          }
        }
      }
      if (special >= 0) {
        encode_text(text.substr(start, i - start), out);
        out.push_back(special);
        i += special_len;
        start = i;
      } else {
        ++i;
      }
    }
    encode_text(text.substr(start), out);
    return out;
  }

  std::string decode(int, int token) const override {
    if (token < 0 || static_cast<std::size_t>(token) >= tokens_.size()) {
      return {};
    }
    if (std::find(specials_.begin(), specials_.end(), token) != specials_.end()) {
      return {};  // control tokens do not print
    }
    const code_points p = decode_utf8(tokens_[static_cast<std::size_t>(token)]);
    std::string s;
    for (std::uint32_t cp : p.cp) {
      const auto it = sym_byte_.find(cp);
      if (it != sym_byte_.end()) {
        s.push_back(static_cast<char>(it->second));
      }
    }
    return s;
  }

  bool is_end(int token) const override { return token == eos_ || token == eot_; }
  std::string chat_prompt(const std::string& user) const override {
    if (ids_.count("<|im_start|>") == 0) {
      fail("this model's vocabulary has no <|im_start|>: no ChatML chat template");
    }
    return "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
           "Face<|im_end|>\n<|im_start|>user\n" +
           user + "<|im_end|>\n<|im_start|>assistant\n";
  }
  bool adds_bos() const override { return add_bos_; }
  std::uint32_t vocab_size() const override { return static_cast<std::uint32_t>(tokens_.size()); }

 private:
  void encode_text(const std::string& text, std::vector<int>& out) const {
    if (text.empty()) {
      return;
    }
    for (const std::string& word : pretokenize_smollm(text)) {
      if (const auto it = cache_.find(word); it != cache_.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        continue;
      }
      std::vector<std::string> sym;
      for (unsigned char b : word) {
        sym.push_back(byte_sym_[b]);
      }
      for (;;) {  // merge every occurrence of the lowest-ranked pair
        int best = std::numeric_limits<int>::max();
        for (std::size_t i = 0; i + 1 < sym.size(); ++i) {
          const auto it = ranks_.find(sym[i] + " " + sym[i + 1]);
          if (it != ranks_.end() && it->second < best) {
            best = it->second;
          }
        }
        if (best == std::numeric_limits<int>::max()) {
          break;
        }
        std::vector<std::string> next;
        for (std::size_t i = 0; i < sym.size(); ++i) {
          if (i + 1 < sym.size()) {
            const auto it = ranks_.find(sym[i] + " " + sym[i + 1]);
            if (it != ranks_.end() && it->second == best) {
              next.push_back(sym[i] + sym[i + 1]);
              ++i;
              continue;
            }
          }
          next.push_back(sym[i]);
        }
        sym = std::move(next);
      }
      std::vector<int> ids;
      for (const std::string& s : sym) {
        const auto it = ids_.find(s);
        if (it != ids_.end()) {
          ids.push_back(it->second);
        } else {  // a merge result outside the vocabulary: fall back to its bytes' symbols
          for (const std::uint32_t cp : decode_utf8(s).cp) {
            std::string one;
            append_utf8(one, cp);
            const auto jt = ids_.find(one);
            if (jt != ids_.end())
              ids.push_back(jt->second);
          }
        }
      }
      out.insert(out.end(), ids.begin(), ids.end());
      cache_.emplace(word, std::move(ids));
    }
  }

  std::vector<std::string> tokens_;
  std::unordered_map<std::string, int> ids_;
  std::unordered_map<std::string, int> ranks_;
  std::vector<int> specials_;
  std::string byte_sym_[256];
  std::unordered_map<std::uint32_t, unsigned char> sym_byte_;
  int bos_ = -1, eos_ = -1, eot_ = -1;
  bool add_bos_ = false;
  mutable std::unordered_map<std::string, std::vector<int>> cache_;  // words seen before
};

}  // namespace

std::vector<std::string> pretokenize_smollm(const std::string& text) {
  const code_points p = decode_utf8(text);
  std::vector<std::string> out;
  const std::size_t n = p.cp.size();
  std::size_t seg = 0;
  for (std::size_t i = 0; i <= n; ++i) {
    if (i == n || is_digit(p.cp[i])) {  // "\p{N}": each digit is a piece of its own
      if (i > seg) {
        gpt2_split(p, seg, i, text, out);
      }
      if (i < n) {
        out.push_back(text.substr(p.at[i], p.at[i + 1] - p.at[i]));
      }
      seg = i + 1;
    }
  }
  return out;
}

std::unique_ptr<tokenizer> make_bpe_tokenizer(const gguf_file& g) {
  return std::make_unique<bpe_tokenizer>(g);
}

}  // namespace mini_decoder
