// SPDX-License-Identifier: Apache-2.0
// GPT-2 style byte-level BPE from GGUF metadata (tokenizer.ggml.tokens / merges / token_type).
#include <algorithm>
#include <array>
#include <functional>
#include <limits>
#include <mutex>
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

// The words a BPE tokenizer has already encoded, bounded and safe to share between threads: 16
// shards, each under its own lock (held for a lookup or an insertion, never while encoding) and
// in two generations: a word is inserted into the young one, a word found in the old one moves
// to the young one, and when the young one is full it becomes the old one and the old one is
// dropped. Memory stays under `bytes` whatever the words; the words in use stay.
class word_cache {
 public:
  static constexpr std::size_t max_word = 256;  // longer words are not cached

  explicit word_cache(std::size_t bytes) : shard_bytes_(bytes / shards / 2) {}

  bool find(const std::string& w, std::vector<int>& out) {
    shard& s = shard_of(w);
    std::lock_guard<std::mutex> lk(s.m);
    if (const auto it = s.young.find(w); it != s.young.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return true;
    }
    const auto it = s.old.find(w);
    if (it == s.old.end()) {
      return false;
    }
    out.insert(out.end(), it->second.begin(), it->second.end());
    std::vector<int> ids = std::move(it->second);
    s.old_bytes -= cost(w, ids);
    s.old.erase(it);
    put(s, w, std::move(ids));
    return true;
  }

  void insert(const std::string& w, std::vector<int> ids) {
    if (w.size() > max_word) {
      return;
    }
    shard& s = shard_of(w);
    std::lock_guard<std::mutex> lk(s.m);
    if (s.young.count(w) == 0 && s.old.count(w) == 0) {
      put(s, w, std::move(ids));
    }
  }

  std::size_t bytes() const {
    std::size_t b = 0;
    for (const shard& s : shards_) {
      std::lock_guard<std::mutex> lk(s.m);
      b += s.young_bytes + s.old_bytes;
    }
    return b;
  }

 private:
  static constexpr std::size_t shards = 16;
  struct shard {
    mutable std::mutex m;
    std::unordered_map<std::string, std::vector<int>> young, old;
    std::size_t young_bytes = 0, old_bytes = 0;
  };
  // A word's bytes, its ids and about what a hash map node and its vectors add.
  static std::size_t cost(const std::string& w, const std::vector<int>& ids) {
    return w.size() + ids.size() * sizeof(int) + 96;
  }
  shard& shard_of(const std::string& w) { return shards_[std::hash<std::string>{}(w) % shards]; }
  void put(shard& s, const std::string& w, std::vector<int> ids) {
    const std::size_t c = cost(w, ids);
    if (s.young_bytes + c > shard_bytes_) {
      s.old = std::move(s.young);
      s.old_bytes = s.young_bytes;
      s.young.clear();
      s.young_bytes = 0;
    }
    s.young.emplace(w, std::move(ids));
    s.young_bytes += c;
  }
  std::size_t shard_bytes_;
  std::array<shard, shards> shards_;
};

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
      max_token_bytes_ = std::max(max_token_bytes_, tokens_[i].size());
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
    std::unordered_map<std::string, int> extra_ids;
    std::uint32_t extra = 256;
    for (std::uint32_t b = 0; b < 256; ++b) {
      const bool keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
      const std::uint32_t cp = keep ? b : extra++;
      byte_sym_[b].clear();
      append_utf8(byte_sym_[b], cp);
      sym_byte_[cp] = static_cast<unsigned char>(b);
      byte_id_[b] = symbol(byte_sym_[b], extra_ids);
    }
    // Each merge "A B" as the pair of symbol ids (A, B) -> its rank and the symbol AB. A line
    // with no space, or more than one, names no pair of symbols (they hold no space): skipped.
    for (std::size_t i = 0; i < merges.size(); ++i) {
      const std::string& m = merges[i];
      const std::size_t sp = m.find(' ');
      if (sp == std::string::npos || m.find(' ', sp + 1) != std::string::npos) {
        continue;
      }
      const std::string a = m.substr(0, sp), b = m.substr(sp + 1);
      merges_.emplace(key(symbol(a, extra_ids), symbol(b, extra_ids)),
                      merge{static_cast<int>(i), symbol(a + b, extra_ids)});
    }
  }

  std::vector<int> encode(const std::string& text, bool add_bos) const override {
    std::vector<int> out;
    encode_into(text, add_bos, std::numeric_limits<std::size_t>::max(), out);
    return out;
  }

  std::optional<std::vector<int>> encode_at_most(const std::string& text, bool add_bos,
                                                 std::size_t limit) const override {
    std::vector<int> out;
    if (!encode_into(text, add_bos, limit, out)) {
      return std::nullopt;
    }
    return out;
  }

  std::size_t cache_bytes() const override { return cache_.bytes(); }

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
  struct merge {
    int rank;
    int result;  // the merged symbol
  };
  static std::uint64_t key(int a, int b) {
    return (std::uint64_t{static_cast<std::uint32_t>(a)} << 32) | static_cast<std::uint32_t>(b);
  }
  // A symbol's id: its vocabulary token, or an id past the vocabulary for a string a merge names
  // that the vocabulary lacks (it falls back to its bytes' symbols at the end, as before).
  int symbol(const std::string& s, std::unordered_map<std::string, int>& extra_ids) {
    if (const auto it = ids_.find(s); it != ids_.end()) {
      return it->second;
    }
    const auto [it, added] =
        extra_ids.emplace(s, static_cast<int>(tokens_.size() + extra_symbols_.size()));
    if (added) {
      extra_symbols_.push_back(s);
    }
    return it->second;
  }

  // Appends the tokens of `text` to `out` (BOS first when asked); false, as soon as it is known,
  // when they would be more than `limit`. Every token covers at most `max_token_bytes_` bytes of
  // the text, which bounds the count from below before any word is encoded.
  bool encode_into(const std::string& text, bool add_bos, std::size_t limit,
                   std::vector<int>& out) const {
    if (add_bos && add_bos_ && bos_ >= 0) {
      out.push_back(bos_);
    }
    if (out.size() > limit || (text.size() + max_token_bytes_ - 1) / max_token_bytes_ >
                                  limit - std::min(limit, out.size())) {
      return false;
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
        if (!encode_text(text.substr(start, i - start), limit, out)) {
          return false;
        }
        out.push_back(special);
        i += special_len;
        start = i;
      } else {
        ++i;
      }
    }
    return encode_text(text.substr(start), limit, out) && out.size() <= limit;
  }

  bool encode_text(const std::string& text, std::size_t limit, std::vector<int>& out) const {
    if (text.empty()) {
      return true;
    }
    for (const std::string& word : pretokenize_smollm(text)) {
      if (out.size() > limit ||
          (word.size() + max_token_bytes_ - 1) / max_token_bytes_ > limit - out.size()) {
        return false;
      }
      if (cache_.find(word, out)) {
        continue;
      }
      const std::size_t before = out.size();
      merge_word(word, out);
      cache_.insert(word,
                    std::vector<int>(out.begin() + static_cast<std::ptrdiff_t>(before), out.end()));
    }
    return out.size() <= limit;
  }

  // GPT-2's BPE on one word: merge every occurrence of the lowest-ranked adjacent pair, left to
  // right, until no pair has a rank. In O(n log n): the symbols are a linked list over the
  // word's bytes (a merged symbol keeps its left byte's position), the candidate pairs a heap by
  // (rank, position) whose stale entries are skipped when popped, and each rank's occurrences
  // are merged in one pass before the pairs they create are pushed, as the quadratic rescan
  // this replaces did.
  void merge_word(const std::string& word, std::vector<int>& out) const {
    const auto n = static_cast<int>(word.size());
    std::vector<int> sym(word.size()), next(word.size());
    std::vector<int> prev(word.size());
    std::vector<char> alive(word.size(), 1);
    for (int i = 0; i < n; ++i) {
      sym[i] = byte_id_[static_cast<unsigned char>(word[static_cast<std::size_t>(i)])];
      prev[i] = i - 1;
      next[i] = i + 1 < n ? i + 1 : -1;
    }
    struct candidate {
      int rank, pos, right, left_sym, right_sym, result;
    };
    const auto later = [](const candidate& a, const candidate& b) {
      return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
    };
    std::vector<candidate> heap;
    const auto pair_at = [&](int p) {  // the pair that starts at symbol p, if it has a rank
      if (p < 0 || next[p] < 0) {
        return;
      }
      const int q = next[p];
      const auto it = merges_.find(key(sym[p], sym[q]));
      if (it != merges_.end()) {
        heap.push_back({it->second.rank, p, q, sym[p], sym[q], it->second.result});
        std::push_heap(heap.begin(), heap.end(), later);
      }
    };
    for (int i = 0; i + 1 < n; ++i) {
      pair_at(i);
    }
    std::vector<candidate> pass;
    std::vector<int> merged;
    while (!heap.empty()) {
      const int rank = heap.front().rank;
      pass.clear();
      while (!heap.empty() && heap.front().rank == rank) {  // in order of position
        std::pop_heap(heap.begin(), heap.end(), later);
        pass.push_back(heap.back());
        heap.pop_back();
      }
      merged.clear();
      for (const candidate& c : pass) {
        if (!alive[c.pos] || !alive[c.right] || next[c.pos] != c.right ||
            sym[c.pos] != c.left_sym || sym[c.right] != c.right_sym) {
          continue;  // stale: a symbol of the pair was merged since
        }
        sym[c.pos] = c.result;
        alive[c.right] = 0;
        next[c.pos] = next[c.right];
        if (next[c.pos] >= 0) {
          prev[next[c.pos]] = c.pos;
        }
        merged.push_back(c.pos);
      }
      for (const int p : merged) {
        pair_at(prev[p]);
        pair_at(p);
      }
    }
    for (int p = 0; p >= 0 && p < n; p = next[p]) {
      const auto id = static_cast<std::size_t>(sym[p]);
      if (id < tokens_.size()) {
        out.push_back(sym[p]);
        continue;
      }
      // A merge result outside the vocabulary: fall back to its bytes' symbols.
      for (const std::uint32_t cp : decode_utf8(extra_symbols_[id - tokens_.size()]).cp) {
        std::string one;
        append_utf8(one, cp);
        const auto jt = ids_.find(one);
        if (jt != ids_.end()) {
          out.push_back(jt->second);
        }
      }
    }
  }

  std::vector<std::string> tokens_;
  std::unordered_map<std::string, int> ids_;
  std::unordered_map<std::uint64_t, merge> merges_;
  std::vector<std::string> extra_symbols_;  // symbols past the vocabulary, by id - vocab
  std::vector<int> specials_;
  std::string byte_sym_[256];
  int byte_id_[256] = {};
  std::unordered_map<std::uint32_t, unsigned char> sym_byte_;
  std::size_t max_token_bytes_ = 1;  // the most bytes of text one token covers
  int bos_ = -1, eos_ = -1, eot_ = -1;
  bool add_bos_ = false;
  mutable word_cache cache_{std::size_t{4} << 20};  // words seen before
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
