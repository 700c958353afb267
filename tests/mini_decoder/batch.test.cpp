// SPDX-License-Identifier: Apache-2.0
// The batched engine: its outputs equal the single-sequence decoder's token for token while
// sequences join and leave at different steps (dense and oasis, stories260K and SmolLM2), with
// and without speculative decoding (greedy and seeded sampling), with prompts prefilled in
// chunks between decode steps; admission by fast-tier memory, and its errors.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <mini_decoder/batch/batch.hpp>
#include <mini_decoder/decode/decoder.hpp>

#include "models.hpp"
#include "support.hpp"

using namespace mini_decoder;
using mini_decoder::test::error_of;

namespace {

const model& stories_model() {
  static const auto m = load_model(std::string(MINI_DECODER_STORIES_DIR) + "/stories260K.bin");
  return *m;
}

struct job {
  std::vector<int> prompt;
  std::uint32_t max_tokens = 0;
  bool ignore_eos = false;
  std::uint32_t submit_at = 0;  // the engine step before which it is submitted
};

struct setup {
  attention_mode mode = attention_mode::dense;
  std::uint32_t budget_tokens = 1024, block_tokens = 16, context = 0;
  draft_kind draft = draft_kind::none;  // the batched engine's drafts (adaptive lengths)
  std::uint32_t draft_len = 15, draft_layers = 2;
  std::uint32_t step_tokens = 256;
  float temperature = 0.0f;
};

// The single-sequence decoder's tokens for a job; `spec`: with the engine's drafts (the same
// adaptive lengths), else plain decoding.
std::vector<int> single(const model& m, const setup& s, const job& j, bool spec = false,
                        std::uint64_t seed = 42) {
  decoder_options o;
  o.mode = s.mode;
  o.budget_tokens = s.budget_tokens;
  o.block_tokens = s.block_tokens;
  o.context = s.context;
  o.max_tokens = j.max_tokens;
  o.ignore_eos = j.ignore_eos;
  o.temperature = s.temperature;
  o.top_p = 0.9f;
  o.seed = seed;
  if (spec) {
    o.draft = s.draft;
    o.draft_len = s.draft_len;
    o.adaptive_draft = true;
    o.draft_layers = s.draft_layers;
  }
  decoder d(m, o);
  return d.generate(j.prompt);
}

batch_options engine_options(const setup& s, std::uint64_t fast_bytes) {
  batch_options o;
  o.mode = s.mode;
  o.budget_tokens = s.budget_tokens;
  o.block_tokens = s.block_tokens;
  o.context = s.context;
  o.fast_tier_bytes = fast_bytes;
  o.draft = s.draft;
  o.draft_len = s.draft_len;
  o.draft_layers = s.draft_layers;
  o.step_tokens = s.step_tokens;
  return o;
}

// Fast-tier bytes for all the jobs at once.
std::uint64_t room_for_all(const model& m, const setup& s, const std::vector<job>& jobs) {
  batch_engine probe(m, engine_options(s, std::uint64_t{1} << 30));
  std::uint64_t bytes = 0;
  for (const job& j : jobs) {
    bytes += probe.need(static_cast<std::uint32_t>(j.prompt.size()), j.max_tokens).fast_bytes;
  }
  return bytes;
}

struct batch_run {
  std::vector<std::vector<int>> outputs, streamed;
  std::size_t most_active = 0, most_waiting = 0;
  std::uint64_t steps = 0;
  batch_report report;
  std::vector<request_report> requests;
  std::vector<std::vector<token_logprobs>> logprobs;  // with sampling.logprobs >= 0
};

// Submits each job before step `submit_at` and steps until everything is done. Request i
// samples with seed 100 + i (where the setup samples).
batch_run run_batch(batch_engine& e, const std::vector<job>& jobs, float temperature = 0.0f,
                    const sampling_params& sampling = {}) {
  batch_run r;
  r.streamed.resize(jobs.size());
  r.logprobs.resize(jobs.size());
  std::vector<batch_engine::request_id> ids(jobs.size());
  std::size_t submitted = 0;
  for (std::uint32_t step = 0;; ++step) {
    for (std::size_t i = 0; i < jobs.size(); ++i) {
      if (jobs[i].submit_at == step) {
        batch_request q;
        q.prompt = jobs[i].prompt;
        q.max_tokens = jobs[i].max_tokens;
        q.ignore_eos = jobs[i].ignore_eos;
        q.temperature = temperature;
        q.top_p = 0.9f;
        q.seed = 100 + i;
        q.sampling = sampling;
        q.on_logprobs = [&r, i](const token_logprobs& lp) {
          r.logprobs[i].push_back(lp);
        };
        q.on_token = [&r, i](int t) {
          r.streamed[i].push_back(t);
          return true;
        };
        ids[i] = e.submit(std::move(q));
        ++submitted;
      }
    }
    const bool more = e.step();
    r.most_active = std::max(r.most_active, e.active());
    r.most_waiting = std::max(r.most_waiting, e.waiting());
    REQUIRE(e.fast_slots_reserved() <= e.fast_slots());
    if (step % 8 == 0) {
      e.audit();  // throws if the cache's bookkeeping is off
    }
    ++r.steps;
    if (!more && submitted == jobs.size()) {
      break;
    }
    REQUIRE(step < 10000);
  }
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    CHECK(e.done(ids[i]));
    r.outputs.push_back(e.output(ids[i]));
    r.requests.push_back(e.report(ids[i]));
  }
  CHECK(e.fast_slots_reserved() == 0);
  CHECK(e.audit() == 0);  // every sequence removed: no block left staged
  r.report = e.report();
  return r;
}

void check_equals_single(const model& m, const setup& s, const std::vector<job>& jobs,
                         const batch_run& r, bool spec = false) {
  REQUIRE(r.outputs.size() == jobs.size());
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    const std::vector<int> want = single(m, s, jobs[i], spec, 100 + i);
    INFO("request " << i << " (" << jobs[i].prompt.size() << " prompt tokens, max "
                    << jobs[i].max_tokens << ", mode " << to_string(s.mode) << ")");
    REQUIRE(!want.empty());
    CHECK(r.outputs[i] == want);
    CHECK(r.streamed[i] == want);
    const request_report& q = r.requests[i];
    CHECK(q.generated == want.size());
    CHECK(q.prompt_tokens == jobs[i].prompt.size());
    CHECK(q.token_seconds.size() + 1 == want.size());
    CHECK(q.first_token_seconds > 0.0);
    CHECK(q.first_token_seconds >= q.admitted_seconds);
    CHECK(q.delivery_seconds.size() <= q.token_seconds.size());
    CHECK(q.accepted <= q.drafted);
  }
  // Every decode step is counted once, by the sequences it ran.
  std::uint64_t steps = 0, tokens = 0;
  for (const concurrency_row& c : r.report.by_decoding) {
    steps += c.steps;
    tokens += c.tokens;
  }
  CHECK(steps == r.report.steps);
  CHECK(tokens == r.report.decode_tokens);
  CHECK(r.report.verify_rows == r.report.rounds + r.report.drafted);
}

std::vector<job> stories_jobs(const model& m) {
  const auto enc = [&](const char* text) {
    return m.tok->encode(text, true);
  };
  return {
      {enc("Once upon a time"), 90, true, 0},
      {enc("Lily had a red ball. She"), 40, false, 0},
      {enc("One day, a little boy named Tom went to the park with his mom and"), 70, true, 3},
      {enc("The cat"), 25, true, 3},
      {enc("The sun was shining and the birds"), 60, false, 11},
  };
}

}  // namespace

TEST_CASE("batch: step_batch equals step for each token, past 16 tokens") {
  const model& m = stories_model();
  const model_config& c = m.config;
  const std::uint32_t qd = c.num_heads * c.head_dim, kvd = c.num_kv_heads * c.head_dim;
  const std::uint32_t group = c.num_heads / c.num_kv_heads;
  // A stand-in attention that depends on each token alone: every head reads its group's value.
  const attention_fn own_value = [&](std::uint32_t, std::uint32_t n, const float*, const float*,
                                     const float* v, float* out) {
    for (std::uint32_t t = 0; t < n; ++t) {
      for (std::uint32_t h = 0; h < c.num_heads; ++h) {
        std::memcpy(out + std::size_t{t} * qd + std::size_t{h} * c.head_dim,
                    v + std::size_t{t} * kvd + std::size_t{h / group} * c.head_dim,
                    c.head_dim * sizeof(float));
      }
    }
  };
  constexpr std::uint32_t n = 21;
  std::vector<int> tokens(n);
  std::vector<std::uint32_t> positions(n);
  for (std::uint32_t i = 0; i < n; ++i) {
    tokens[i] = static_cast<int>((i * 37 + 5) % c.vocab_size);
    positions[i] = (i * 53) % 400;
  }
  transformer tf(m);
  std::vector<float> batched(std::size_t{n} * c.vocab_size), one(c.vocab_size);
  tf.step_batch(tokens.data(), positions.data(), n, own_value, batched.data());
  for (std::uint32_t i = 0; i < n; ++i) {
    tf.step(&tokens[i], 1, positions[i], c.num_layers, own_value, one.data());
    INFO("token " << i << " at position " << positions[i]);
    CHECK(std::vector<float>(batched.begin() + std::ptrdiff_t{i} * c.vocab_size,
                             batched.begin() + std::ptrdiff_t{i + 1} * c.vocab_size) == one);
  }
  // And a consecutive run through step equals the batch of the same positions.
  std::vector<std::uint32_t> run_pos(4);
  for (std::uint32_t i = 0; i < 4; ++i)
    run_pos[i] = 100 + i;
  std::vector<float> run_logits(4 * std::size_t{c.vocab_size}), batch_logits(run_logits.size());
  tf.step(tokens.data(), 4, 100, c.num_layers, own_value, run_logits.data());
  tf.step_batch(tokens.data(), run_pos.data(), 4, own_value, batch_logits.data());
  CHECK(run_logits == batch_logits);
  CHECK(error_of([&] {
          tf.step_batch(tokens.data(), positions.data(), 0, own_value, one.data());
        }).find("step_batch") != std::string::npos);
}

TEST_CASE("batch: stories260K equals the single-sequence decoder, dense and oasis") {
  const model& m = stories_model();
  const std::vector<job> jobs = stories_jobs(m);
  double dense_blocks_per_step = 0;
  for (const attention_mode mode : {attention_mode::dense, attention_mode::oasis}) {
    CAPTURE(to_string(mode));
    setup s;
    s.mode = mode;
    s.context = 256;
    s.budget_tokens = 48;  // 3 blocks: the longest sequences reach 6 blocks, so oasis selects
    batch_engine e(m, engine_options(s, room_for_all(m, s, jobs)));
    const batch_run r = run_batch(e, jobs);
    check_equals_single(m, s, jobs, r);
    CHECK(r.report.peak_active >= 4);  // sequences did run together
    CHECK(r.report.decode_tokens > 0);
    CHECK(r.report.decode_tokens_per_second() > 0.0);
    CHECK(e.active() == 0);
    CHECK(e.fast_slots_reserved() == 0);
    const oasiskv::cache_stats& st = r.report.cache;
    REQUIRE(st.sequence_steps > 0);
    const double per_step = double(st.selected_blocks) / double(st.sequence_steps);
    if (mode == attention_mode::dense) {
      dense_blocks_per_step = per_step;
    } else {
      // Sparse: per (sequence, layer) step at most the budget plus the window a lookahead adds,
      // and fewer blocks than dense attended.
      CHECK(per_step <= 3.0 + 2.0);
      CHECK(per_step < dense_blocks_per_step);
      CHECK(st.lookaheads > 0);
    }
  }
}

TEST_CASE("batch: SmolLM2 equals the single-sequence decoder, dense and oasis") {
  const model* m = &test::smollm2();
  const auto enc = [&](const char* text) {
    return m->tok->encode(m->tok->chat_prompt(text), true);
  };
  const std::vector<job> jobs = {
      {enc("What is the capital of France?"), 24, false, 0},
      {enc("Name three colours."), 16, true, 0},
      {enc("Write one sentence about the sea, and say why people like to visit it."), 32, true, 5},
  };
  double dense_blocks_per_step = 0;
  for (const attention_mode mode : {attention_mode::dense, attention_mode::oasis}) {
    CAPTURE(to_string(mode));
    setup s;
    s.mode = mode;
    s.context = 256;
    s.block_tokens = 8;
    s.budget_tokens = 24;  // 3 blocks of 8 tokens, against up to 9 blocks per sequence
    batch_engine e(*m, engine_options(s, room_for_all(*m, s, jobs)));
    const batch_run r = run_batch(e, jobs);
    check_equals_single(*m, s, jobs, r);
    CHECK(r.report.peak_active >= 2);
    const oasiskv::cache_stats& st = r.report.cache;
    REQUIRE(st.sequence_steps > 0);
    const double per_step = double(st.selected_blocks) / double(st.sequence_steps);
    if (mode == attention_mode::dense) {
      dense_blocks_per_step = per_step;
    } else {
      CHECK(per_step < dense_blocks_per_step);  // oasis attended fewer blocks: sparse
    }
  }
}

TEST_CASE("batch: admission holds at most what the fast-tier budget fits") {
  const model& m = stories_model();
  const auto enc = [&](const char* text) {
    return m.tok->encode(text, true);
  };
  // Every request ends at 64 tokens (4 blocks), so each needs the same fast-tier memory.
  std::vector<job> jobs;
  for (const char* text : {"Once upon a time", "Lily had a red ball. She", "The cat",
                           "One day, a little boy named Tom went", "The dog ran"}) {
    job j{enc(text), 0, true, 0};
    j.max_tokens = 64 - static_cast<std::uint32_t>(j.prompt.size());
    jobs.push_back(j);
  }
  jobs[1].ignore_eos = false;
  jobs[4].submit_at = 7;
  for (const attention_mode mode : {attention_mode::dense, attention_mode::oasis}) {
    CAPTURE(to_string(mode));
    setup s;
    s.mode = mode;
    s.context = 128;
    s.budget_tokens = 32;
    std::uint64_t one = 0, block = 0;
    {
      batch_engine probe(m, engine_options(s, std::uint64_t{1} << 30));
      const sequence_need nd = probe.need(5, 59);
      one = nd.fast_bytes;
      block = nd.fast_bytes / nd.fast_slots;
      for (const job& j : jobs) {
        REQUIRE(probe.need(static_cast<std::uint32_t>(j.prompt.size()), j.max_tokens).fast_bytes ==
                one);
      }
    }
    // Two requests and most of a third: exactly two fit.
    batch_engine e(m, engine_options(s, 3 * one - block));
    const batch_run r = run_batch(e, jobs);
    CHECK(r.most_active == 2);
    CHECK(r.report.peak_active == 2);
    CHECK(r.most_waiting >= 2);  // the others waited for memory
    check_equals_single(m, s, jobs, r);
    CHECK(r.requests[2].admitted_seconds > r.requests[0].admitted_seconds);
  }
}

TEST_CASE("batch: a request that can never fit is refused; the others complete") {
  const model& m = stories_model();
  const auto enc = [&](const char* text) {
    return m.tok->encode(text, true);
  };
  setup s;
  s.context = 256;
  const std::vector<job> jobs = {{enc("Once upon a time"), 40, true, 0},
                                 {enc("The cat"), 30, true, 0}};
  batch_engine probe(m, engine_options(s, std::uint64_t{1} << 30));
  const std::uint64_t budget = room_for_all(m, s, jobs);
  batch_engine e(m, engine_options(s, budget));
  batch_request first;
  first.prompt = jobs[0].prompt;
  first.max_tokens = jobs[0].max_tokens;
  first.ignore_eos = true;
  const auto id0 = e.submit(first);
  e.step();  // admitted and decoding
  REQUIRE(e.active() == 1);

  batch_request big;
  big.prompt = enc("Once upon a time");
  big.max_tokens = 200;
  const sequence_need nd =
      probe.need(static_cast<std::uint32_t>(big.prompt.size()), big.max_tokens);
  REQUIRE(nd.fast_bytes > budget);
  const std::string refused = error_of([&] { e.submit(big); });
  CHECK(refused.find(std::to_string(nd.fast_bytes)) != std::string::npos);
  CHECK(refused.find(std::to_string(budget)) != std::string::npos);
  CHECK(refused.find("never") != std::string::npos);
  CHECK(e.active() == 1);
  CHECK(e.waiting() == 0);

  batch_request too_long;
  too_long.prompt = enc("Once upon a time");
  too_long.max_tokens = 256;
  const std::string beyond = error_of([&] { e.submit(too_long); });
  CHECK(beyond.find("context of 256") != std::string::npos);
  CHECK(beyond.find(std::to_string(too_long.prompt.size() + 256)) != std::string::npos);

  batch_request second;
  second.prompt = jobs[1].prompt;
  second.max_tokens = jobs[1].max_tokens;
  second.ignore_eos = true;
  const auto id1 = e.submit(second);
  e.run();
  CHECK(e.done(id0));
  CHECK(e.done(id1));
  CHECK(e.output(id0) == single(m, s, jobs[0]));
  CHECK(e.output(id1) == single(m, s, jobs[1]));
  CHECK(e.output(id0).size() == 40);
  e.forget(id0);
  CHECK(error_of([&] { (void)e.output(id0); }).find("no request") != std::string::npos);
}

TEST_CASE("batch: bad parameters give clear errors") {
  const model& m = stories_model();
  setup s;
  s.context = 128;
  CHECK(error_of([&] { batch_engine e(m, engine_options(s, 0)); }).find("0 bytes") !=
        std::string::npos);
  CHECK(error_of([&] { batch_engine e(m, engine_options(s, 100)); }).find("holds 0 blocks") !=
        std::string::npos);
  {
    batch_options o = engine_options(s, 1 << 20);
    o.mode = attention_mode::quest;
    CHECK(error_of([&] { batch_engine e(m, o); }).find("dense or oasis") != std::string::npos);
    o.mode = attention_mode::oasis;
    o.budget_tokens = 0;
    CHECK(error_of([&] { batch_engine e(m, o); }).find("--budget = 0") != std::string::npos);
    o.budget_tokens = 32;
    o.max_batch = 0;
    CHECK(error_of([&] { batch_engine e(m, o); }).find("max_batch") != std::string::npos);
  }
  batch_engine e(m, engine_options(s, 1 << 20));
  batch_request r;
  CHECK(error_of([&] { e.submit(r); }).find("prompt is empty") != std::string::npos);
  r.prompt = m.tok->encode("Once upon a time", true);
  r.max_tokens = 0;
  CHECK(error_of([&] { e.submit(r); }).find("max_tokens must be at least 1") != std::string::npos);
  r.max_tokens = 4;
  r.prompt.push_back(static_cast<int>(m.config.vocab_size));
  CHECK(error_of([&] { e.submit(r); }).find("outside the vocabulary") != std::string::npos);
  r.prompt.pop_back();
  r.top_p = 0.0f;
  CHECK(error_of([&] { e.submit(r); }).find("--top-p") != std::string::npos);
  CHECK(e.waiting() == 0);
  CHECK(error_of([&] { (void)e.output(12345); }).find("no request 12345") != std::string::npos);
}

TEST_CASE("batch: speculative rounds (prompt lookup, self drafts) equal plain greedy decoding") {
  const model& m = stories_model();
  const std::vector<job> jobs = stories_jobs(m);
  for (const draft_kind k : {draft_kind::ngram, draft_kind::self}) {
    CAPTURE(std::string(to_string(k)));
    setup s;
    s.context = 256;
    s.draft = k;
    batch_engine e(m, engine_options(s, room_for_all(m, s, jobs)));
    const batch_run r = run_batch(e, jobs);
    check_equals_single(m, s, jobs, r);  // the decoder without drafts
    CHECK(r.report.peak_active >= 4);
    CHECK(r.report.drafted > 0);
    CHECK(r.report.accepted > 0);
    // Fewer steps than tokens: accepted drafts commit several tokens a step.
    std::uint64_t longest = 0;
    for (const auto& o : r.outputs) {
      longest = std::max<std::uint64_t>(longest, o.size());
    }
    CHECK(r.report.steps < longest + 11);
    CHECK(r.report.rounds < r.report.decode_tokens);
  }
}

TEST_CASE("batch: speculative OasisKV equals the single-sequence decoder with the same drafts") {
  const model& m = stories_model();
  const std::vector<job> jobs = stories_jobs(m);
  for (const draft_kind k : {draft_kind::ngram, draft_kind::self}) {
    CAPTURE(std::string(to_string(k)));
    setup s;
    s.mode = attention_mode::oasis;
    s.context = 256;
    s.budget_tokens = 48;  // 3 of up to 6 blocks: sparse, so the lookahead queries matter
    s.draft = k;
    batch_engine e(m, engine_options(s, room_for_all(m, s, jobs)));
    const batch_run r = run_batch(e, jobs);
    check_equals_single(m, s, jobs, r, true);
    const oasiskv::cache_stats& st = r.report.cache;
    CHECK(st.lookaheads > 0);
    CHECK(double(st.selected_blocks) / double(st.sequence_steps) <= 3.0 + 2.0);
    CHECK(r.report.accepted > 0);
  }
}

TEST_CASE("batch: seeded sampling with drafts equals a plain sampled run") {
  const model& m = stories_model();
  const std::vector<job> jobs = stories_jobs(m);
  setup s;
  s.context = 256;
  s.temperature = 0.8f;
  s.draft = draft_kind::ngram;
  batch_engine e(m, engine_options(s, room_for_all(m, s, jobs)));
  const batch_run r = run_batch(e, jobs, s.temperature);
  check_equals_single(m, s, jobs, r);  // the decoder sampling without drafts, same seeds
  CHECK(r.report.drafted > 0);
  s.draft = draft_kind::none;
  batch_engine plain(m, engine_options(s, room_for_all(m, s, jobs)));
  CHECK(run_batch(plain, jobs, s.temperature).outputs == r.outputs);
}

TEST_CASE("batch: penalties and log-probabilities with drafts equal a plain run's") {
  // The penalties count every token kept, the accepted drafts included, before the next row is
  // sampled: a speculative round must see the counts a plain run sees at each position.
  const model& m = stories_model();
  const std::vector<job> jobs = stories_jobs(m);
  setup s;
  s.context = 256;
  sampling_params p;
  p.presence_penalty = 0.6f;
  p.frequency_penalty = 0.4f;
  p.logprobs = 2;
  s.draft = draft_kind::ngram;
  batch_engine spec(m, engine_options(s, room_for_all(m, s, jobs)));
  const batch_run r = run_batch(spec, jobs, 0.0f, p);
  CHECK(r.report.accepted > 0);  // drafts were kept: rounds of more than one token
  s.draft = draft_kind::none;
  batch_engine plain(m, engine_options(s, room_for_all(m, s, jobs)));
  const batch_run want = run_batch(plain, jobs, 0.0f, p);
  CHECK(r.outputs == want.outputs);
  // The penalties act: without them some answer differs.
  batch_engine free(m, engine_options(s, room_for_all(m, s, jobs)));
  CHECK(run_batch(free, jobs).outputs != want.outputs);
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    INFO("request " << i);
    REQUIRE(r.logprobs[i].size() == r.outputs[i].size());  // one per token delivered
    REQUIRE(want.logprobs[i].size() == want.outputs[i].size());
    for (std::size_t t = 0; t < r.outputs[i].size(); ++t) {
      const token_logprobs& a = r.logprobs[i][t];
      const token_logprobs& b = want.logprobs[i][t];
      CHECK(a.token == r.outputs[i][t]);
      CHECK(b.token == a.token);
      CHECK(a.logprob <= 0.0f);
      CHECK(std::fabs(a.logprob - b.logprob) < 1e-3f);  // a NaN fails
      REQUIRE(a.top.size() == 2);
      CHECK(a.top[0].second >= a.top[1].second);
    }
  }
}

TEST_CASE(
    "batch: SmolLM2 speculative, dense and OasisKV, equals the decoder with the same drafts") {
  const model* m = &test::smollm2();
  const auto enc = [&](const char* text) {
    return m->tok->encode(m->tok->chat_prompt(text), true);
  };
  const std::vector<job> jobs = {
      {enc("Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown"), 16,
       true, 0},
      {enc("Name three colours."), 12, true, 1},
  };
  for (const attention_mode mode : {attention_mode::dense, attention_mode::oasis}) {
    CAPTURE(to_string(mode));
    setup s;
    s.mode = mode;
    s.context = 256;
    s.block_tokens = 8;
    s.budget_tokens = 24;
    s.draft = mode == attention_mode::dense ? draft_kind::ngram : draft_kind::self;
    s.draft_layers = 6;
    batch_engine e(*m, engine_options(s, room_for_all(*m, s, jobs)));
    const batch_run r = run_batch(e, jobs);
    check_equals_single(*m, s, jobs, r, true);
    CHECK(r.report.peak_active >= 2);
    CHECK(r.report.drafted > 0);
  }
}

// A long prompt arriving while another request decodes is prefilled in chunks of the step's
// budget: the running request gets a token every step meanwhile, and both answers are the
// decoder's.
TEST_CASE("batch: a long prompt is prefilled in chunks between the running sequences' steps") {
  const model& m = stories_model();
  std::string text;
  for (int i = 0; i < 10; ++i) {
    text += "Lily and Ben went to the park. They played on the swings and saw a big dog. ";
  }
  const std::vector<int> long_prompt = m.tok->encode(text, true);
  REQUIRE(long_prompt.size() > 4 * transformer::prefill_rows);
  const std::vector<job> jobs = {{m.tok->encode("Once upon a time", true), 60, true, 0},
                                 {long_prompt, 20, true, 3}};
  for (const draft_kind k : {draft_kind::none, draft_kind::ngram}) {
    CAPTURE(std::string(to_string(k)));
    setup s;
    s.context = 512;
    s.draft = k;
    s.step_tokens = 96;  // the decode rows first, then a 64-token chunk (or the prompt's last)
    batch_engine e(m, engine_options(s, room_for_all(m, s, jobs)));
    batch_request first;
    first.prompt = jobs[0].prompt;
    first.max_tokens = jobs[0].max_tokens;
    first.ignore_eos = true;
    std::size_t streamed = 0;
    first.on_token = [&](int) {
      ++streamed;
      return true;
    };
    const auto id0 = e.submit(first);
    for (int i = 0; i < 3; ++i) {
      e.step();
    }
    batch_request second;
    second.prompt = jobs[1].prompt;
    second.max_tokens = jobs[1].max_tokens;
    second.ignore_eos = true;
    const auto id1 = e.submit(second);
    std::uint64_t chunks = 0;
    while (!e.done(id1)) {
      const std::size_t before = streamed;
      const std::uint64_t prefilled = e.report().prefill_tokens, rows = e.report().verify_rows;
      const bool decoding = !e.done(id0);
      e.step();
      // The step's tokens: decode rows and prefill, within the budget.
      CHECK(e.report().prefill_tokens - prefilled + e.report().verify_rows - rows <= s.step_tokens);
      chunks += e.report().prefill_tokens > prefilled ? 1 : 0;
      if (decoding) {
        CHECK(streamed > before);  // the running request was not held up
      }
      REQUIRE(e.report().steps < 1000);
    }
    e.run();
    CHECK(chunks >= long_prompt.size() / transformer::prefill_rows);
    CHECK(e.report().prefill_chunks >= chunks);
    CHECK(e.output(id0) == single(m, s, jobs[0]));
    // The chunks' products may round differently from one whole prefill (transformer::prefill);
    // on this tiny model they choose the same tokens.
    CHECK(e.output(id1) == single(m, s, jobs[1]));
    CHECK(e.report(id1).first_token_seconds > 0.0);
    CHECK(e.audit() == 0);
  }
}

TEST_CASE("batch: self drafts count the draft model's blocks in admission; too big is refused") {
  const model& m = stories_model();
  setup s;
  s.context = 256;
  s.draft = draft_kind::self;
  batch_engine probe(m, engine_options(s, std::uint64_t{1} << 30));
  const sequence_need nd = probe.need(16, 48);
  CHECK(nd.draft_slots == 2 * 4);  // 2 draft layers of 64 tokens: 4 blocks each
  s.draft = draft_kind::none;
  batch_engine plain(m, engine_options(s, std::uint64_t{1} << 30));
  CHECK(plain.need(16, 48).fast_slots + nd.draft_slots == nd.fast_slots);
  s.draft = draft_kind::self;
  const std::vector<job> jobs = {{m.tok->encode("Once upon a time", true), 40, true, 0},
                                 {m.tok->encode("The cat", true), 30, true, 0}};
  const std::uint64_t budget = room_for_all(m, s, jobs);
  batch_engine e(m, engine_options(s, budget));
  batch_request big;
  big.prompt = m.tok->encode("Once upon a time", true);
  big.max_tokens = 200;
  CHECK(error_of([&] { e.submit(big); }).find("never") != std::string::npos);
  const batch_run r = run_batch(e, jobs);
  check_equals_single(m, s, jobs, r);
  CHECK(r.report.peak_active == 2);
}
