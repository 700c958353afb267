// SPDX-License-Identifier: Apache-2.0
// The mini-decoder on real models: reference outputs, speculative == plain, sparse == dense
// when the budget covers the context, a small budget's tokens equal attention computed here over
// the blocks it attended, and clear errors on bad input.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <mini_decoder/decode/decoder.hpp>

#include "oasiskv/core/dtype.hpp"
#include "support.hpp"

using namespace mini_decoder;
using mini_decoder::test::error_of;

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

std::string temp_file(const std::string& name, const std::string& bytes) {
  const auto p = std::filesystem::temp_directory_path() / ("mini_decoder_" + name);
  std::ofstream(p, std::ios::binary) << bytes;
  return p.string();
}

// One attend of the target model's cache in a sparse run: the blocks it attended, per table.
struct attend_record {
  std::uint32_t layer = 0, q_len = 0, length = 0;
  oasiskv::attended_blocks blocks;
};

// The shipped backend, every attend's block table logged.
class logging_backend final : public kv_backend {
 public:
  logging_backend(std::unique_ptr<kv_backend> inner, std::vector<attend_record>& log)
      : inner_(std::move(inner)), log_(log) {}
  void append(std::uint32_t l, const std::uint16_t* k, const std::uint16_t* v,
              std::uint32_t n) override {
    inner_->append(l, k, v, n);
  }
  void lookahead(std::uint32_t l, const float* q, std::uint32_t n) override {
    inner_->lookahead(l, q, n);
  }
  void attend(std::uint32_t l, const float* q, std::uint32_t q_len, float* out, float* lse,
              oasiskv::attended_blocks*) override {
    attend_record r{l, q_len, inner_->length(l), {}};
    inner_->attend(l, q, q_len, out, lse, &r.blocks);
    log_.push_back(std::move(r));
  }
  std::uint32_t length(std::uint32_t l) const override { return inner_->length(l); }
  oasiskv::cache_stats stats() const override { return inner_->stats(); }
  const oasiskv::kv_layout& layout() const override { return inner_->layout(); }
  std::uint64_t fast_tier_bytes() const override { return inner_->fast_tier_bytes(); }
  std::uint64_t capacity_tier_bytes() const override { return inner_->capacity_tier_bytes(); }
  std::uint64_t summary_bytes() const override { return inner_->summary_bytes(); }
  std::uint32_t budget_tokens() const override { return inner_->budget_tokens(); }

 private:
  std::unique_ptr<kv_backend> inner_;
  std::vector<attend_record>& log_;
};

// The independent model: every appended K,V kept here (f16 widened to f32), and attention
// computed in double over exactly the blocks the logged run attended at the same call, causal
// within the context. Nothing of the library runs but the f16 widening.
class replay_backend final : public kv_backend {
 public:
  replay_backend(const cache_config& c, const std::vector<attend_record>& log)
      : c_(c),
        layout_{c.num_layers, c.num_q_heads,  c.num_kv_heads,
                c.head_dim,   c.block_tokens, oasiskv::dtype::f16},
        kv_dim_(c.num_kv_heads * c.head_dim),
        k_(c.num_layers),
        v_(c.num_layers),
        log_(log) {}
  void append(std::uint32_t l, const std::uint16_t* k, const std::uint16_t* v,
              std::uint32_t n) override {
    for (std::size_t i = 0; i < std::size_t{n} * kv_dim_; ++i) {
      k_[l].push_back(oasiskv::f16{k[i]}.to_float());
      v_[l].push_back(oasiskv::f16{v[i]}.to_float());
    }
  }
  void lookahead(std::uint32_t, const float*, std::uint32_t) override {}
  void attend(std::uint32_t l, const float* q, std::uint32_t q_len, float* out, float* lse,
              oasiskv::attended_blocks*) override {
    REQUIRE_MESSAGE(calls_ < log_.size(), "the replay made more attends than the logged run");
    const attend_record& r = log_[calls_++];
    const std::uint32_t len = length(l);
    REQUIRE(r.layer == l);
    REQUIRE(r.q_len == q_len);
    REQUIRE(r.length == len);
    const std::uint32_t bt = c_.block_tokens, hd = c_.head_dim;
    const std::uint32_t group = c_.num_q_heads / c_.num_kv_heads;
    const double scale = 1.0 / std::sqrt(double(hd));
    std::vector<double> s, acc(hd);
    std::vector<std::uint32_t> tokens;
    for (std::uint32_t j = 0; j < q_len; ++j) {
      const std::uint32_t pos = len - q_len + j;
      for (std::uint32_t h = 0; h < c_.num_q_heads; ++h) {
        const std::uint32_t kvh = h / group;
        const auto table = r.blocks.table(0, r.blocks.tables_per_seq == 1 ? 0 : kvh);
        tokens.clear();
        for (const std::uint32_t b : table) {
          if (b * bt >= len) {
            FAIL("the logged table names block ", b, " of a ", len, "-token context");
          }
          for (std::uint32_t t = b * bt; t < std::min(len, (b + 1) * bt) && t <= pos; ++t) {
            tokens.push_back(t);
          }
        }
        const std::size_t row = std::size_t{j} * c_.num_q_heads + h;
        const float* qv = q + row * hd;
        s.assign(tokens.size(), 0.0);
        double mx = -INFINITY;
        for (std::size_t i = 0; i < tokens.size(); ++i) {
          const float* kv = k_[l].data() + std::size_t{tokens[i]} * kv_dim_ + std::size_t{kvh} * hd;
          double dot = 0;
          for (std::uint32_t x = 0; x < hd; ++x) {
            dot += double(qv[x]) * kv[x];
          }
          s[i] = scale * dot;
          mx = std::max(mx, s[i]);
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        double den = 0;
        for (std::size_t i = 0; i < tokens.size(); ++i) {
          const double e = std::exp(s[i] - mx);
          const float* vv = v_[l].data() + std::size_t{tokens[i]} * kv_dim_ + std::size_t{kvh} * hd;
          for (std::uint32_t x = 0; x < hd; ++x) {
            acc[x] += e * vv[x];
          }
          den += e;
        }
        for (std::uint32_t x = 0; x < hd; ++x) {
          out[row * hd + x] = tokens.empty() ? 0.0f : static_cast<float>(acc[x] / den);
        }
        lse[row] = tokens.empty() ? -INFINITY : static_cast<float>(mx + std::log(den));
      }
    }
  }
  std::uint32_t length(std::uint32_t l) const override {
    return static_cast<std::uint32_t>(k_[l].size() / kv_dim_);
  }
  oasiskv::cache_stats stats() const override { return {}; }
  const oasiskv::kv_layout& layout() const override { return layout_; }
  std::uint64_t fast_tier_bytes() const override { return 0; }
  std::uint64_t capacity_tier_bytes() const override { return 0; }
  std::uint64_t summary_bytes() const override { return 0; }
  std::uint32_t budget_tokens() const override { return c_.budget_tokens; }
  std::size_t calls() const { return calls_; }

 private:
  cache_config c_;
  oasiskv::kv_layout layout_;
  std::uint32_t kv_dim_;
  std::vector<std::vector<float>> k_, v_;
  const std::vector<attend_record>& log_;
  std::size_t calls_ = 0;
};

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

TEST_CASE("draft_length: fixed, or adapted to the acceptance, down to 0 and probing again") {
  draft_length fixed(4);
  for (int i = 0; i < 5; ++i) {
    CHECK(fixed.next() == 4);
    fixed.update(4, 0);
  }
  draft_length good(15, true);
  const std::uint32_t start = good.next();
  CHECK(start >= 1);
  CHECK(start < 15);
  for (int i = 0; i < 12; ++i) {
    const std::uint32_t g = good.next();
    good.update(g, g);  // every draft accepted: the length grows to the cap
  }
  CHECK(good.next() == 15);
  CHECK(good.acceptance() > 0.9f);
  draft_length bad(15, true);
  for (int i = 0; i < 12; ++i) {
    const std::uint32_t g = bad.next();
    bad.update(g, 0);  // every first draft rejected: down to 0
  }
  std::uint32_t drafted = 0;
  for (std::uint32_t i = 0; i < 2 * draft_length::probe_rounds; ++i) {
    drafted += bad.next();
  }
  CHECK(drafted == 2);  // a 1-token probe every probe_rounds rounds
  bad.update(0, 0);     // nothing drafted: nothing learnt
  CHECK(bad.acceptance() < draft_length::threshold);
  CHECK(error_of([] { draft_length(16); }).find("16") != std::string::npos);
}

TEST_CASE("a kept prefill generates what a fresh one does, in every mode") {
  const model& m = stories_model();
  const auto prompt = m.tok->encode("Once upon a time", true);
  decoder_options o;
  o.max_tokens = 60;
  o.draft = draft_kind::self;
  o.draft_layers = 2;
  o.adaptive_draft = true;
  decoder first(m, o);
  const prefilled_prompt p = first.prefill(prompt);
  for (const attention_mode mode : {attention_mode::dense, attention_mode::oasis}) {
    CAPTURE(to_string(mode));
    decoder_options s = o;
    s.mode = mode;
    s.budget_tokens = 32;
    decoder fresh(m, s), kept(m, s);
    CHECK(kept.generate(p) == fresh.generate(prompt));
    CHECK(kept.report().prefill_seconds == p.seconds);
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

// Generates from `prompt` with `o` while logging every attend call, then again with each call
// answered by attention computed independently over the blocks it attended (replay_backend),
// and checks that the replay gives the same tokens from the same calls. Returns the first run.
struct logged_run {
  std::vector<int> tokens;
  std::vector<attend_record> log;
  generation_report report;
};
logged_run run_logged_and_replayed(const model& m, const std::vector<int>& prompt,
                                   decoder_options o) {
  logged_run out;
  o.backend = [&out](const cache_config& c) {
    return std::make_unique<logging_backend>(make_kv_backend(c), out.log);
  };
  decoder d(m, o);
  out.tokens = d.generate(prompt);
  out.report = d.report();
  replay_backend* replay = nullptr;
  o.backend = [&out, &replay](const cache_config& c) {
    auto b = std::make_unique<replay_backend>(c, out.log);
    replay = b.get();
    return b;
  };
  decoder r(m, o);
  CHECK(r.generate(prompt) == out.tokens);
  REQUIRE(replay != nullptr);
  CHECK(replay->calls() == out.log.size());
  return out;
}

TEST_CASE(
    "a small budget's tokens equal attention computed independently over the blocks it attended") {
  const model& m = stories_model();
  const auto prompt = m.tok->encode("Once upon a time", true);
  decoder_options base;
  base.max_tokens = 200;
  base.block_tokens = 16;
  base.budget_tokens = 64;  // 4 of up to 13 blocks
  base.draft_layers = 2;
  base.ignore_eos = true;
  for (const attention_mode mode : {attention_mode::oasis, attention_mode::quest,
                                    attention_mode::recency, attention_mode::on_demand}) {
    for (const draft_kind k : {draft_kind::none, draft_kind::self}) {
      CAPTURE(to_string(mode));
      CAPTURE(to_string(k));
      decoder_options o = base;
      o.mode = mode;
      o.draft = k;
      const logged_run run = run_logged_and_replayed(m, prompt, o);
      REQUIRE(run.tokens.size() == base.max_tokens);
      // The selection was sparse: past twice the budget, no table held every block.
      std::size_t past_budget = 0, whole_tables = 0;
      for (const attend_record& r : run.log) {
        const std::uint32_t held = (r.length + base.block_tokens - 1) / base.block_tokens;
        if (r.length > 2 * base.budget_tokens) {
          ++past_budget;
          for (std::uint32_t t = 0; t < r.blocks.tables_per_seq; ++t) {
            whole_tables += r.blocks.table(0, t).size() >= held ? 1 : 0;
          }
        }
      }
      CHECK(past_budget > 20);
      CHECK(whole_tables == 0);
    }
  }
}

TEST_CASE(
    "every --summary selects sparsely, and its tokens equal attention over what it attended") {
  const model& m = stories_model();
  const auto prompt = m.tok->encode("Once upon a time", true);
  decoder_options o;
  o.mode = attention_mode::oasis;
  o.max_tokens = 160;
  o.block_tokens = 16;
  o.budget_tokens = 64;
  o.ignore_eos = true;
  std::vector<std::uint64_t> bytes;
  for (const summary_kind k : {summary_kind::qminmax, summary_kind::minmax, summary_kind::int2,
                               summary_kind::int4, summary_kind::cascade, summary_kind::int8}) {
    CAPTURE(to_string(k));
    CHECK(parse_summary(to_string(k)) == k);
    o.summary = k;
    const logged_run run = run_logged_and_replayed(m, prompt, o);
    REQUIRE(run.tokens.size() == o.max_tokens);
    std::size_t sparse_tables = 0;
    for (const attend_record& r : run.log) {
      const std::uint32_t held = (r.length + o.block_tokens - 1) / o.block_tokens;
      sparse_tables += held > 8 && r.blocks.table(0, 0).size() == 4 ? 1 : 0;
    }
    CHECK(sparse_tables > 100);
    bytes.push_back(run.report.summary_bytes);
  }
  // Per block: int8 bounds < f16 bounds < int8 bounds and a 2-bit code per key element < an int4
  // key per token < the int8 bounds and the int4 keys (the cascade) < an int8 key per token.
  REQUIRE(bytes.size() == 6);
  CHECK(bytes[0] > 0);
  for (std::size_t i = 1; i < bytes.size(); ++i) {
    CHECK(bytes[i - 1] < bytes[i]);
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
    // A GGUF v3 header with no metadata and one tensor of ggml type 13 (Q5_K).
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
    put(std::uint32_t{13});
    put(std::uint64_t{0});
    b += std::string(1024, '\0');
    const auto p = temp_file("q5k.gguf", b);
    const auto e = error_of([&] { load_model(p); });
    CHECK(e.find("quant type 13") != std::string::npos);
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
    const std::string e = error_of([] { parse_summary("int3"); });
    CHECK(e.find("unknown --summary 'int3'") != std::string::npos);
    CHECK(e.find("(int2|cascade|minmax|qminmax|int8|int4)") != std::string::npos);
    CHECK(error_of([] {
            parse_mode("sparse");
          }).find("(dense, oasis, quest, recency, on-demand)") != std::string::npos);
  }
}
