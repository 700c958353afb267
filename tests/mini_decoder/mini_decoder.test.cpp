// SPDX-License-Identifier: Apache-2.0
// The mini-decoder on real models: reference outputs, speculative == plain, sparse == dense
// when the budget covers the context, and clear errors on bad input.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "decoder.hpp"

using namespace mini_decoder;

namespace {

const std::string stories_dir = MINI_DECODER_STORIES_DIR;  // tests/data/stories260K
const std::string stories = stories_dir + "/stories260K.bin";

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

const model& stories_model() {
  static const auto m = load_model(stories);
  return *m;
}

// llama2.c's output: the prompt's pieces after BOS, the generated pieces, a newline.
std::string render(const model& m, const std::vector<int>& prompt, const std::vector<int>& gen) {
  std::string s;
  int prev = -1;
  for (std::size_t i = 0; i < prompt.size(); ++i) {
    if (i > 0)
      s += m.tok->decode(prev, prompt[i]);
    prev = prompt[i];
  }
  for (int t : gen) {
    s += m.tok->decode(prev, t);
    prev = t;
  }
  return s + "\n";
}

std::vector<int> run(const model& m, const std::vector<int>& prompt, decoder_options o) {
  decoder d(m, o);
  return d.generate(prompt);
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const decoder_error& e) {
    return e.what();
  }
  return "(no error)";
}

std::string temp_file(const std::string& name, const std::string& bytes) {
  const auto p = std::filesystem::temp_directory_path() / ("mini_decoder_" + name);
  std::ofstream(p, std::ios::binary) << bytes;
  return p.string();
}

}  // namespace

TEST_CASE("stories260K greedy reproduces llama2.c's reference output") {
  const model& m = stories_model();
  CHECK(m.config.num_layers == 5);
  CHECK(m.config.num_heads == 8);
  CHECK(m.config.num_kv_heads == 4);
  const auto prompt = m.tok->encode("Once upon a time", true);
  decoder_options o;
  // llama2.c -n 256 forwards positions 0..255 and prints the token each one produces.
  o.max_tokens = 257 - static_cast<std::uint32_t>(prompt.size());
  const auto gen = run(m, prompt, o);
  CHECK(render(m, prompt, gen) == read_all(stories_dir + "/reference-greedy-n256.txt"));
}

TEST_CASE("greedy speculative decoding equals greedy decoding (dense, both draft kinds)") {
  const model& m = stories_model();
  const auto prompt = m.tok->encode("Once upon a time", true);
  decoder_options o;
  o.max_tokens = 200;
  const auto plain = run(m, prompt, o);
  for (const draft_kind k : {draft_kind::self, draft_kind::ngram}) {
    for (const std::uint32_t g : {1u, 4u, 7u}) {
      CAPTURE(to_string(k));
      CAPTURE(g);
      decoder_options s = o;
      s.draft = k;
      s.draft_len = g;
      s.draft_layers = 2;
      decoder d(m, s);
      const auto spec = d.generate(prompt);
      CHECK(spec == plain);
      CHECK(d.report().rounds < plain.size());  // some drafts were accepted
    }
  }
}

TEST_CASE("ignore_eos generates past the end token, the same tokens up to it") {
  const model& m = stories_model();
  const auto prompt = m.tok->encode("Once upon a time", true);
  decoder_options o;
  o.max_tokens = 500;
  const auto plain = run(m, prompt, o);
  REQUIRE(plain.size() < o.max_tokens);  // this story ends by itself
  o.ignore_eos = true;
  const auto all = run(m, prompt, o);
  CHECK(all.size() == o.max_tokens);
  REQUIRE(all.size() > plain.size());
  CHECK(std::equal(plain.begin(), plain.end(), all.begin()));
  CHECK(m.tok->is_end(all[plain.size()]));  // where the plain run stopped
  o.draft = draft_kind::ngram;              // drafts may cross the end token too
  CHECK(run(m, prompt, o) == all);
}

TEST_CASE("sampled speculative decoding equals sampled decoding (same seed)") {
  const model& m = stories_model();
  const auto prompt = m.tok->encode("Once upon a time", true);
  decoder_options o;
  o.max_tokens = 120;
  o.temperature = 0.8f;
  o.top_p = 0.9f;
  o.seed = 7;
  const auto plain = run(m, prompt, o);
  o.draft = draft_kind::ngram;
  CHECK(run(m, prompt, o) == plain);
}

TEST_CASE("OasisKV with a budget covering the whole context equals dense") {
  const model& m = stories_model();
  const auto prompt = m.tok->encode("Once upon a time", true);
  decoder_options o;
  o.max_tokens = 200;
  o.block_tokens = 16;
  const auto dense = run(m, prompt, o);
  for (const attention_mode mode : {attention_mode::oasis, attention_mode::quest,
                                    attention_mode::recency, attention_mode::on_demand}) {
    for (const draft_kind k : {draft_kind::none, draft_kind::self}) {
      CAPTURE(to_string(mode));
      CAPTURE(to_string(k));
      decoder_options s = o;
      s.mode = mode;
      s.budget_tokens = 512;
      s.draft = k;
      s.draft_layers = 2;
      CHECK(run(m, prompt, s) == dense);
    }
  }
}

TEST_CASE("a small budget runs sparse and counts its transfers") {
  const model& m = stories_model();
  const auto prompt = m.tok->encode("Once upon a time", true);
  decoder_options o;
  o.mode = attention_mode::oasis;
  o.budget_tokens = 64;
  o.block_tokens = 16;
  o.max_tokens = 300;
  o.draft = draft_kind::self;
  o.draft_layers = 2;
  decoder d(m, o);
  const auto gen = d.generate(prompt);
  CHECK(gen.size() > 100);
  const auto& r = d.report();
  CHECK(r.cache.lookaheads > 0);
  CHECK(r.cache.step.hits > 0);
  CHECK(r.cache.hit_rate() > 0.5);
  CHECK(r.fast_tier_bytes < r.dense_kv_bytes);
  CHECK(double(r.cache.selected_blocks) / r.cache.sequence_steps <= 4.0 + 2.0);
}

TEST_CASE("bad input gives one clear error") {
  SUBCASE("missing file") {
    const auto e = error_of([] { load_model("/nonexistent/model.gguf"); });
    CHECK(e.find("cannot open model file") != std::string::npos);
    CHECK(e.find("fetch-models.sh") != std::string::npos);
  }
  SUBCASE("truncated llama2.c checkpoint") {
    const std::string bytes = read_all(stories);
    const auto p = temp_file("trunc.bin", bytes.substr(0, bytes.size() / 2));
    std::filesystem::copy_file(stories_dir + "/tok512.bin",
                               std::filesystem::path(p).parent_path() / "tok512.bin",
                               std::filesystem::copy_options::overwrite_existing);
    CHECK(error_of([&] { load_model(p); }).find("truncated") != std::string::npos);
  }
  SUBCASE("corrupt GGUF magic") {
    const auto p = temp_file("bad.gguf", std::string("GGUX\3\0\0\0", 8) + std::string(64, '\0'));
    CHECK(error_of([&] { load_model(p); }).find("bad magic") != std::string::npos);
  }
  SUBCASE("truncated GGUF header") {
    const auto p = temp_file("short.gguf", std::string("GGUF\3\0\0\0\1\0", 10));
    CHECK(error_of([&] { load_model(p); }).find("truncated") != std::string::npos);
  }
  SUBCASE("unknown quant type") {
    // A GGUF v3 header with no metadata and one tensor of ggml type 12 (Q4_K).
    std::string b("GGUF", 4);
    auto put = [&](auto v) {
      b.append(reinterpret_cast<const char*>(&v), sizeof(v));
    };
    put(std::uint32_t{3});
    put(std::uint64_t{1});
    put(std::uint64_t{0});
    put(std::uint64_t{4});
    b += "blk0";
    put(std::uint32_t{1});
    put(std::uint64_t{256});
    put(std::uint32_t{12});
    put(std::uint64_t{0});
    b += std::string(1024, '\0');
    const auto p = temp_file("q4k.gguf", b);
    const auto e = error_of([&] { load_model(p); });
    CHECK(e.find("quant type 12") != std::string::npos);
  }
  SUBCASE("prompt longer than the context") {
    const model& m = stories_model();
    std::vector<int> prompt(600, 5);
    decoder_options o;
    CHECK(error_of([&] { run(m, prompt, o); }).find("context") != std::string::npos);
  }
  SUBCASE("budget below the minimum") {
    const model& m = stories_model();
    decoder_options o;
    o.mode = attention_mode::oasis;
    o.budget_tokens = 16;
    o.block_tokens = 16;
    const auto e = error_of([&] { run(m, m.tok->encode("Once", true), o); });
    CHECK(e.find("below the minimum") != std::string::npos);
  }
  SUBCASE("unknown mode and draft names") {
    CHECK(error_of([] { parse_mode("sparse"); }).find("unknown --mode") != std::string::npos);
    CHECK(error_of([] { parse_draft("big"); }).find("unknown --draft") != std::string::npos);
  }
}
