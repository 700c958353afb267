// SPDX-License-Identifier: Apache-2.0
// The equal-memory throughput run (bench/throughput/throughput.cpp) on stories260K: the same
// fast-tier bytes admit more OasisKV requests than dense ones, both speculative, every request
// gets all its tokens, and the report's counts add up; the stall probe's chunks.
#include <doctest/doctest.h>

#include <string>

#include <mini_decoder/batch/batch.hpp>
#include <throughput/throughput.hpp>

#include "oasiskv/summary/cascade_summary.hpp"
#include "oasiskv/summary/qminmax_int2_summary.hpp"
#include "support.hpp"

using namespace mini_decoder;
using mini_decoder::test::error_of;

namespace {

const model& stories() {
  static const std::unique_ptr<model> m =
      load_model(std::string(MINI_DECODER_STORIES_DIR) + "/stories260K.bin");
  return *m;
}

std::string text() {
  std::string t;
  for (int i = 0; i < 40; ++i) {
    t += "Once upon a time there was a little girl named Lily. She liked to play in the park "
         "with her dog, and one day they found a big red ball under a tree. ";
  }
  return t;
}

}  // namespace

TEST_CASE("throughput: equal fast-tier bytes hold more OasisKV requests than dense ones") {
  const model& m = stories();
  const std::uint32_t requests = 6, prompt = 200, answer = 24;
  const auto prompts = throughput_prompts(m, text(), requests, prompt);
  REQUIRE(prompts.size() == requests);
  for (const auto& p : prompts) {
    CHECK(p.size() == prompt);
  }
  CHECK(prompts[0] != prompts[1]);  // windows of the text, not one prompt repeated
  throughput_options o;
  o.requests = requests;
  o.prompt_tokens = prompt;
  o.answer_tokens = answer;
  o.dense_sequences = 2;
  o.budget_tokens = 64;
  // The int8 bounds (3.3% of the KV): at this short context the default cascade's int4 keys
  // (17.4% with the bounds) would cost more fast memory than its staging saves.
  o.summary = summary_kind::qminmax;
  o.mode = attention_mode::dense;
  const throughput_result dense = run_throughput(m, prompts, o);
  o.mode = attention_mode::oasis;
  const throughput_result oasis = run_throughput(m, prompts, o);
  CHECK(dense.fast_tier_bytes == oasis.fast_tier_bytes);
  CHECK(dense.fast_tier_bytes == 2 * dense.sequence_fast_bytes);
  CHECK(dense.peak_active == 2);
  // 224 tokens are 14 blocks a layer dense; OasisKV stages 2 * 4 + 4 = 12 of them, plus the
  // summaries of the 14 (under one block a layer).
  CHECK(oasis.sequence_fast_bytes < dense.sequence_fast_bytes);
  CHECK(oasis.peak_active == dense.fast_tier_bytes / oasis.sequence_fast_bytes);
  for (const throughput_result* r : {&dense, &oasis}) {
    // The first token of each request comes from its prefill, the others from decode steps.
    CHECK(r->decode_tokens == std::uint64_t{requests} * (answer - 1));
    CHECK(r->decode_seconds > 0.0);
    CHECK(r->decode_tokens_per_second > 0.0);
    CHECK(r->first_token.p50 > 0.0);
    CHECK(r->first_token.p50 <= r->first_token.p99);
    CHECK(r->token.p50 <= r->token.max);
    const std::string j = to_json(*r);
    CHECK(j.front() == '{');
    CHECK(j.back() == '}');
    CHECK(j.find("\"decode_tokens_per_second\"") != std::string::npos);
    CHECK(j.find("\"by_decoding\": [{\"sequences\": 1") != std::string::npos);
    // Speculative: prompt lookup drafts on the repeated text, and some are accepted.
    CHECK(r->drafted > 0);
    CHECK(r->accepted > 0);
    CHECK(r->verify_rows == r->rounds + r->drafted);
    std::uint64_t tokens = 0;
    for (const concurrency_row& c : r->by_decoding) {
      tokens += c.tokens;
    }
    CHECK(tokens == r->decode_tokens);
    CHECK(r->by_decoding.size() == r->peak_active + 1);  // the largest batch decoded together
  }
}

TEST_CASE("stall probe: a long prompt is admitted in chunks, or whole without a step budget") {
  const model& m = stories();
  const std::vector<int> stream = m.tok->encode("Once upon a time", true);
  const std::vector<int> long_prompt = throughput_prompts(m, text(), 1, 300)[0];
  throughput_options o;
  o.mode = attention_mode::oasis;
  o.budget_tokens = 64;
  o.summary = summary_kind::qminmax;
  o.context = 512;
  for (const std::uint32_t step_tokens : {0u, 64u}) {
    CAPTURE(step_tokens);
    o.step_tokens = step_tokens;
    const stall_result r = run_stall_probe(m, stream, long_prompt, o);
    CHECK(r.stream_tokens > 16);
    CHECK(r.median_gap > 0.0);
    CHECK(r.worst_gap >= r.median_gap);
    CHECK(r.long_first_token > 0.0);
    if (step_tokens == 0) {
      CHECK(r.prefill_chunks == 1);
    } else {
      CHECK(r.prefill_chunks >= 300u / 64u + 1u);  // the decode rows leave less than 64 a step
    }
    const std::string j = to_json(r);
    CHECK(j.find("\"worst_over_median\"") != std::string::npos);
    CHECK(j.find("\"long_prompt_tokens\": 300") != std::string::npos);
  }
}

TEST_CASE("batched admission counts each sequence's block summaries as fast memory") {
  const model& m = stories();
  const model_config& c = m.config;
  const oasiskv::kv_layout l{c.num_layers, c.num_heads, c.num_kv_heads,
                             c.head_dim,   16,          oasiskv::dtype::f16};
  batch_options bo;
  bo.mode = attention_mode::oasis;
  bo.fast_tier_bytes = 64ull << 20;
  bo.budget_tokens = 64;            // 4 blocks: 2 * 4 + 4 = 12 staged a layer
  const std::uint64_t blocks = 14;  // 200 + 24 tokens
  for (const summary_kind k : {summary_kind::qminmax, summary_kind::cascade, summary_kind::int2}) {
    CAPTURE(to_string(k));
    bo.summary = k;
    const batch_engine e(m, bo);
    const sequence_need nd = e.need(200, 24);
    const std::uint64_t per_block =
        k == summary_kind::qminmax   ? oasiskv::quantized_minmax_summary(l, 1).bytes_per_block()
        : k == summary_kind::cascade ? oasiskv::qminmax_int4_cascade(l, 1).bytes_per_block()
                                     : oasiskv::qminmax_int2_summary(l, 1).bytes_per_block();
    CHECK(nd.summary_bytes == blocks * c.num_layers * per_block);
    CHECK(nd.fast_slots ==
          12ull * c.num_layers + (nd.summary_bytes + l.block_bytes() - 1) / l.block_bytes());
    CHECK(nd.fast_bytes == nd.fast_slots * l.block_bytes());
  }
  bo.mode = attention_mode::dense;
  CHECK(batch_engine(m, bo).need(200, 24).summary_bytes == 0);
}

TEST_CASE("throughput: bad options are refused with the values named") {
  const model& m = stories();
  CHECK(error_of([&] { throughput_prompts(m, "a few words", 2, 500); }).find("500") !=
        std::string::npos);
  CHECK(error_of([&] { throughput_prompts(m, text(), 0, 50); }).find("0 requests") !=
        std::string::npos);
  const auto prompts = throughput_prompts(m, text(), 1, 50);
  throughput_options o;
  o.answer_tokens = 0;
  CHECK(error_of([&] { run_throughput(m, prompts, o); }).find("0 answer tokens") !=
        std::string::npos);
  o.answer_tokens = 8;
  o.mode = attention_mode::quest;
  CHECK(error_of([&] { run_throughput(m, prompts, o); }).find("quest") != std::string::npos);
}
