// SPDX-License-Identifier: Apache-2.0
// The tokenizers (apps/mini_decoder/tokenizer) against the quadratic algorithms they replaced,
// kept here as references: the same tokens for prose, code, digits, white space, special tokens,
// invalid UTF-8 and long repetitive words. Then what a server needs of them: time bounded by the
// input (a 64,000-letter word took 18.6 s, under a lock every request shared), `encode_at_most`
// refusing a text over a limit without tokenizing it whole, a word cache that stays bounded
// whatever the words (it grew by 127 MiB for 10 requests of 60,000 distinct words), and
// concurrent use from several threads.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <mini_decoder/io/gguf.hpp>
#include <mini_decoder/tokenizer/tokenizer.hpp>

using namespace mini_decoder;

namespace {

const std::string smollm2_path =
    std::string(MINI_DECODER_MODELS) + "/SmolLM2-135M-Instruct.Q4_1.gguf";
const std::string stories_tok = std::string(MINI_DECODER_STORIES_DIR) + "/tok512.bin";

const gguf_file& smollm2_gguf() {
  REQUIRE_MESSAGE(
      std::filesystem::exists(smollm2_path),
      "SmolLM2 model not found at " << smollm2_path << ": fetch it with scripts/fetch-models.sh");
  static const gguf_file g(smollm2_path);
  return g;
}

const tokenizer& bpe() {
  static const std::unique_ptr<tokenizer> t = make_bpe_tokenizer(smollm2_gguf());
  return *t;
}

const tokenizer& llama2c() {
  static const std::unique_ptr<tokenizer> t = make_llama2c_tokenizer(stories_tok, 512);
  return *t;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void append_utf8(std::string& s, std::uint32_t cp) {
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    s.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::vector<std::uint32_t> code_points_of(const std::string& s) {
  std::vector<std::uint32_t> out;
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
    out.push_back(v);
    i += len;
  }
  return out;
}

// The GPT-2 BPE as the tokenizer computed it before: rescan every pair for the lowest rank,
// merge each of its occurrences left to right, again until no pair has a rank.
class reference_bpe {
 public:
  explicit reference_bpe(const gguf_file& g) {
    tokens_ = g.get("tokenizer.ggml.tokens").strings;
    const auto& merges = g.get("tokenizer.ggml.merges").strings;
    for (std::size_t i = 0; i < tokens_.size(); ++i) {
      ids_.emplace(tokens_[i], static_cast<int>(i));
    }
    for (std::size_t i = 0; i < merges.size(); ++i) {
      ranks_.emplace(merges[i], static_cast<int>(i));
    }
    const auto& types = g.get("tokenizer.ggml.token_type").ints;
    for (std::size_t i = 0; i < types.size() && i < tokens_.size(); ++i) {
      if (types[i] == 3 || types[i] == 4) {
        specials_.push_back(static_cast<int>(i));
      }
    }
    std::uint32_t extra = 256;
    for (std::uint32_t b = 0; b < 256; ++b) {
      const bool keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
      append_utf8(byte_sym_[b], keep ? b : extra++);
    }
  }

  std::vector<int> encode(const std::string& text) const {
    std::vector<int> out;
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

 private:
  void encode_text(const std::string& text, std::vector<int>& out) const {
    if (text.empty()) {
      return;
    }
    for (const std::string& word : pretokenize_smollm(text)) {
      std::vector<std::string> sym;
      for (unsigned char b : word) {
        sym.push_back(byte_sym_[b]);
      }
      for (;;) {
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
      for (const std::string& s : sym) {
        const auto it = ids_.find(s);
        if (it != ids_.end()) {
          out.push_back(it->second);
        } else {
          for (const std::uint32_t cp : code_points_of(s)) {
            std::string one;
            append_utf8(one, cp);
            const auto jt = ids_.find(one);
            if (jt != ids_.end()) {
              out.push_back(jt->second);
            }
          }
        }
      }
    }
  }

  std::vector<std::string> tokens_;
  std::unordered_map<std::string, int> ids_, ranks_;
  std::vector<int> specials_;
  std::string byte_sym_[256];
};

// llama2.c's tokenizer as it was: merge the best-scoring adjacent pair (the leftmost of equals),
// rescanning every pair after each merge.
class reference_llama2c {
 public:
  explicit reference_llama2c(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    REQUIRE(in);
    std::int32_t max_len = 0;
    in.read(reinterpret_cast<char*>(&max_len), 4);
    pieces_.resize(512);
    scores_.resize(512);
    for (std::size_t i = 0; i < 512; ++i) {
      std::int32_t len = 0;
      in.read(reinterpret_cast<char*>(&scores_[i]), 4);
      in.read(reinterpret_cast<char*>(&len), 4);
      pieces_[i].resize(static_cast<std::size_t>(len));
      in.read(pieces_[i].data(), len);
      lookup_.emplace(pieces_[i], static_cast<int>(i));
    }
  }

  std::vector<int> encode(const std::string& text) const {
    std::vector<int> t{1};
    if (!text.empty()) {
      t.push_back(find(" "));
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
          t.push_back(b + 3);
        }
      }
      cp.clear();
    }
    for (;;) {
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

 private:
  int find(const std::string& s) const {
    const auto it = lookup_.find(s);
    return it == lookup_.end() ? -1 : it->second;
  }
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int> lookup_;
};

// Texts both tokenizers must agree with their references on.
std::vector<std::string> corpus() {
  std::vector<std::string> t = {
      "",
      "Once upon a time, there was a little girl named Lily. She loved to play outside.",
      "The quick brown fox jumps over the lazy dog 1234567890 times!!!",
      "def f(x):\n    return x ** 2  # squares\n\n\tprint(f(3))",
      "   leading and trailing spaces   \n\n\n",
      "It's, we're, they'll, I'd, you've: contractions'",
      "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
      "<|im_start|><|im_end|><|endoftext|><not_special>",
      "Ünïcödé: naïve café, 日本語のテキスト, Ελληνικά, русский, emoji 😀🎉",
      std::string("bad utf-8: \xff\xfe \xc3 \xe2\x82 end"),
      std::string("nul\0inside", 10),
      "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
      "abababababababababababababababababababababababababababab",
      "thethethethethethethethethethethethethethethethethethe",
      "............................................................",
      "1111111111111111 2222 3.14159 1e10 0x7fff",
  };
  std::mt19937 rng(7);
  // Long repetitive and random words: where a merge creates pairs of the rank being merged.
  for (const char* alphabet : {"a", "ab", "abc", "the", "aeiou", "xyzw", "ll"}) {
    for (std::size_t len : {17u, 300u, 1500u}) {
      std::string w;
      const std::size_t k = std::strlen(alphabet);
      for (std::size_t i = 0; i < len; ++i) {
        w.push_back(alphabet[rng() % k]);
      }
      t.push_back(w);
    }
  }
  for (int i = 0; i < 20; ++i) {  // random bytes, printable and not
    std::string w;
    const std::size_t len = 1 + rng() % 400;
    for (std::size_t j = 0; j < len; ++j) {
      w.push_back(static_cast<char>(i % 2 == 0 ? 32 + rng() % 95 : rng() % 256));
    }
    t.push_back(w);
  }
  return t;
}

}  // namespace

TEST_CASE("tokenizer: BPE equals the quadratic BPE it replaced, token for token") {
  const reference_bpe ref(smollm2_gguf());
  for (const std::string& text : corpus()) {
    CAPTURE(text);
    CHECK(bpe().encode(text, false) == ref.encode(text));
  }
  // With BOS and the cache warm: the same again.
  for (const std::string& text : corpus()) {
    CHECK(bpe().encode(text, false) == ref.encode(text));
  }
}

TEST_CASE("tokenizer: llama2.c's equals the quadratic merge loop it replaced") {
  const reference_llama2c ref(stories_tok);
  for (const std::string& text : corpus()) {
    CAPTURE(text);
    CHECK(llama2c().encode(text, true) == ref.encode(text));
  }
}

TEST_CASE("tokenizer: a 64,000-letter word takes time bounded by its length") {
  // Before: 18.6 s for this word (5 s for 16,000 letters, about 110 s for 128,000), quadratic
  // and under the lock every request shared. Now O(n log n): well under a second here; the bound
  // leaves room for a loaded machine and the sanitizers.
  std::mt19937 rng(1);
  std::string word;
  for (int i = 0; i < 64000; ++i) {
    word.push_back(static_cast<char>('a' + rng() % 26));
  }
  auto t0 = std::chrono::steady_clock::now();
  const std::vector<int> ids = bpe().encode(word, false);
  const double bpe_s = seconds_since(t0);
  CHECK(ids.size() > 64000 / 16);
  CHECK(bpe_s < 5.0);
  MESSAGE("BPE, 64,000 letters: " << bpe_s << " s, " << ids.size() << " tokens");
  // The same word under a limit it exceeds: refused at once, from its length alone.
  t0 = std::chrono::steady_clock::now();
  CHECK(!bpe().encode_at_most(word + word + word + word, false, 2048));
  CHECK(seconds_since(t0) < 1.0);

  // llama2.c has no pre-tokenizer: the whole text is one merge sequence.
  std::string prose;
  while (prose.size() < 64000) {
    prose += "Once upon a time, there was a little girl named Lily. ";
  }
  t0 = std::chrono::steady_clock::now();
  const std::vector<int> lt = llama2c().encode(prose, true);
  const double l2c_s = seconds_since(t0);
  CHECK(lt.size() > 1000);
  CHECK(l2c_s < 5.0);
  MESSAGE("llama2.c, 64,000 bytes: " << l2c_s << " s, " << lt.size() << " tokens");
}

TEST_CASE("tokenizer: encode_at_most is encode under its limit and refuses beyond it") {
  for (const tokenizer* t : {&bpe(), &llama2c()}) {
    for (const std::string& text : corpus()) {
      CAPTURE(text);
      const std::vector<int> all = t->encode(text, true);
      const auto same = t->encode_at_most(text, true, all.size());
      REQUIRE(same);
      CHECK(*same == all);
      CHECK(t->encode_at_most(text, true, all.size() + 100) == all);
      if (!all.empty()) {
        CHECK(!t->encode_at_most(text, true, all.size() - 1));
      }
    }
    // 16 MiB of ordinary words against a limit of 8192 tokens: refused from the length alone.
    std::string big;
    while (big.size() < (std::size_t{16} << 20)) {
      big += "the cat sat on the mat and looked at the dog. ";
    }
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(!t->encode_at_most(big, true, 8192));
    CHECK(seconds_since(t0) < 2.0);
  }
  // A text a little over the limit, within the length bound: the words are counted as they are
  // encoded, and the refusal comes at the word that passes the limit.
  std::string words;
  for (int i = 0; i < 3000; ++i) {
    words += " w" + std::to_string(i);
  }
  const std::size_t n = bpe().encode(words, false).size();
  CHECK(!bpe().encode_at_most(words, false, n / 2));
  CHECK(bpe().encode_at_most(words, false, n)->size() == n);
}

TEST_CASE("tokenizer: the BPE word cache stays bounded whatever the words") {
  // 10 requests of 60,000 distinct words each (600,000 words): before, the cache kept every one.
  std::mt19937 rng(3);
  const std::size_t before = bpe().cache_bytes();
  std::size_t most = 0;
  for (int r = 0; r < 10; ++r) {
    std::string text;
    for (int w = 0; w < 60000; ++w) {
      text += ' ';
      for (int k = 0; k < 8; ++k) {
        text.push_back(static_cast<char>('a' + rng() % 26));
      }
    }
    CHECK(!bpe().encode(text, false).empty());
    most = std::max(most, bpe().cache_bytes());
  }
  MESSAGE("word cache: " << before << " bytes before, at most " << most << " after");
  CHECK(most > 0);                               // it caches
  CHECK(most <= (std::size_t{4} << 20) + 4096);  // and stays within its 4 MiB
  // The words still come out right after all that eviction.
  const reference_bpe ref(smollm2_gguf());
  const std::string again = "Once upon a time, there was a little girl named Lily.";
  CHECK(bpe().encode(again, false) == ref.encode(again));
}

TEST_CASE("tokenizer: several threads encode at once and each gets its own tokens") {
  const std::vector<std::string> texts = corpus();
  std::vector<std::vector<int>> want_bpe, want_l2c;
  for (const std::string& t : texts) {
    want_bpe.push_back(bpe().encode(t, true));
    want_l2c.push_back(llama2c().encode(t, true));
  }
  std::vector<int> wrong(4, 0);
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      for (int round = 0; round < 3; ++round) {
        for (std::size_t i = 0; i < texts.size(); ++i) {
          const std::size_t j = (i * 7 + static_cast<std::size_t>(k)) % texts.size();
          wrong[static_cast<std::size_t>(k)] += bpe().encode(texts[j], true) != want_bpe[j];
          wrong[static_cast<std::size_t>(k)] += llama2c().encode(texts[j], true) != want_l2c[j];
          (void)bpe().decode(-1, static_cast<int>(j));
        }
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  CHECK(wrong == std::vector<int>(4, 0));
}
