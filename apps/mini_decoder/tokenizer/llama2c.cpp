// SPDX-License-Identifier: Apache-2.0
// The llama2.c tokenizer: SentencePiece-like pieces with merge scores, byte fallback, BOS = 1.
#include <algorithm>
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
      max_piece_ = std::max(max_piece_, pieces_[i].size());
    }
  }

  std::vector<int> encode(const std::string& text, bool add_bos) const override {
    return encode_with(text, add_bos);
  }

  // Every token covers at most `max_piece_` bytes of the text: that bounds the count from below
  // before anything is merged.
  std::optional<std::vector<int>> encode_at_most(const std::string& text, bool add_bos,
                                                 std::size_t limit) const override {
    if ((text.size() + max_piece_ - 1) / max_piece_ > limit) {
      return std::nullopt;
    }
    std::vector<int> t = encode_with(text, add_bos);
    if (t.size() > limit) {
      return std::nullopt;
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
  // The pieces of `text` (code points, or their bytes where the vocabulary lacks one), then
  // merges: repeatedly the adjacent pair whose concatenation is the best-scoring piece, the
  // leftmost of equals, until no concatenation is a piece. In O(n log n): the tokens are a
  // linked list, the candidate pairs a heap by (score, position) whose stale entries are
  // skipped when popped; the result is the quadratic rescan's, pair for pair.
  std::vector<int> encode_with(const std::string& text, bool add_bos) const {
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
    const auto n = static_cast<int>(t.size());
    std::vector<int> next(t.size()), prev(t.size());
    std::vector<char> alive(t.size(), 1);
    for (int i = 0; i < n; ++i) {
      prev[i] = i - 1;
      next[i] = i + 1 < n ? i + 1 : -1;
    }
    struct candidate {
      float score;
      int pos, right, left_tok, right_tok, result;
    };
    const auto worse = [](const candidate& a, const candidate& b) {
      return a.score != b.score ? a.score < b.score : a.pos > b.pos;
    };
    std::vector<candidate> heap;
    const auto pair_at = [&](int p) {  // the pair that starts at token p, if it is a piece
      if (p < 0 || next[p] < 0) {
        return;
      }
      const int q = next[p];
      const int id = find(pieces_[static_cast<std::size_t>(t[static_cast<std::size_t>(p)])] +
                          pieces_[static_cast<std::size_t>(t[static_cast<std::size_t>(q)])]);
      // A score of -1e10 or below (or NaN) never merges, as in llama2.c.
      if (id >= 0 && scores_[static_cast<std::size_t>(id)] > -1e10f) {
        heap.push_back({scores_[static_cast<std::size_t>(id)], p, q, t[static_cast<std::size_t>(p)],
                        t[static_cast<std::size_t>(q)], id});
        std::push_heap(heap.begin(), heap.end(), worse);
      }
    };
    for (int i = 0; i + 1 < n; ++i) {
      pair_at(i);
    }
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), worse);
      const candidate c = heap.back();
      heap.pop_back();
      const auto p = static_cast<std::size_t>(c.pos), q = static_cast<std::size_t>(c.right);
      if (!alive[p] || !alive[q] || next[p] != c.right || t[p] != c.left_tok ||
          t[q] != c.right_tok) {
        continue;  // stale: a token of the pair was merged since
      }
      t[p] = c.result;
      alive[q] = 0;
      next[p] = next[q];
      if (next[p] >= 0) {
        prev[static_cast<std::size_t>(next[p])] = c.pos;
      }
      pair_at(prev[p]);
      pair_at(c.pos);
    }
    std::vector<int> out;
    for (int p = 0; p >= 0 && p < n; p = next[static_cast<std::size_t>(p)]) {
      out.push_back(t[static_cast<std::size_t>(p)]);
    }
    return out;
  }

  int find(const std::string& s) const {
    const auto it = lookup_.find(s);
    return it == lookup_.end() ? -1 : it->second;
  }
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int> lookup_;
  std::size_t max_piece_ = 1;  // the longest piece: the most bytes of text one token covers
};

}  // namespace

std::unique_ptr<tokenizer> make_llama2c_tokenizer(const std::string& path, std::uint32_t vocab) {
  return std::make_unique<llama2c_tokenizer>(path, vocab);
}

}  // namespace mini_decoder
