// SPDX-License-Identifier: Apache-2.0
// The batched engine: its outputs equal the single-sequence decoder's token for token while
// sequences join and leave at different steps (dense and oasis, stories260K and SmolLM2),
// admission by fast-tier memory, and its errors.
#include <doctest/doctest.h>

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
};

std::vector<int> single(const model& m, const setup& s, const job& j) {
  decoder_options o;
  o.mode = s.mode;
  o.budget_tokens = s.budget_tokens;
  o.block_tokens = s.block_tokens;
  o.context = s.context;
  o.max_tokens = j.max_tokens;
  o.ignore_eos = j.ignore_eos;
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
};

// Submits each job before step `submit_at` and steps until everything is done.
batch_run run_batch(batch_engine& e, const std::vector<job>& jobs) {
  batch_run r;
  r.streamed.resize(jobs.size());
  std::vector<batch_engine::request_id> ids(jobs.size());
  std::size_t submitted = 0;
  for (std::uint32_t step = 0;; ++step) {
    for (std::size_t i = 0; i < jobs.size(); ++i) {
      if (jobs[i].submit_at == step) {
        batch_request q;
        q.prompt = jobs[i].prompt;
        q.max_tokens = jobs[i].max_tokens;
        q.ignore_eos = jobs[i].ignore_eos;
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
                         const batch_run& r) {
  REQUIRE(r.outputs.size() == jobs.size());
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    const std::vector<int> want = single(m, s, jobs[i]);
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
  }
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
