// SPDX-License-Identifier: Apache-2.0
#include <throughput/throughput.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include <mini_decoder/io/error.hpp>
#include <mini_decoder/model/transformer.hpp>

namespace mini_decoder {

namespace {

std::string json(const latency_summary& s) {
  return fmt::format(R"({{"p50": {:.6f}, "p90": {:.6f}, "p99": {:.6f}, "max": {:.6f}}})", s.p50,
                     s.p90, s.p99, s.max);
}

// The engine both runs build: everything but the fast tier's bytes.
batch_options engine_options(const throughput_options& o) {
  batch_options bo;
  bo.mode = o.mode;
  bo.summary = o.summary;
  bo.budget_tokens = o.budget_tokens;
  bo.max_batch = o.max_batch;
  bo.attention_threads = o.attention_threads;
  bo.draft = o.draft;
  bo.draft_len = o.draft_len;
  bo.draft_layers = o.draft_layers;
  bo.step_tokens = o.step_tokens;
  bo.context = o.context;
  bo.rope_scale = o.rope_scale;
  return bo;
}

}  // namespace

std::vector<std::vector<int>> throughput_prompts(const model& m, const std::string& text,
                                                 std::uint32_t requests,
                                                 std::uint32_t prompt_tokens) {
  if (requests == 0 || prompt_tokens < 2) {
    fail("throughput: ", requests, " requests of ", prompt_tokens,
         " prompt tokens (need at least 1 request of 2 tokens)");
  }
  const std::vector<int> all = m.tok->encode(text, false);
  const bool bos = m.tok->adds_bos();
  const std::uint32_t body = prompt_tokens - (bos ? 1u : 0u);
  if (all.size() < body) {
    fail("throughput: the text has ", all.size(), " tokens, fewer than the ", body,
         " that a prompt of ", prompt_tokens, " tokens takes from it");
  }
  // Windows start `stride` tokens apart so that the prompts differ even when they overlap.
  const std::size_t span = all.size() - body + 1;
  const std::size_t stride = std::max<std::size_t>(1, span / requests);
  const std::vector<int> with_bos = m.tok->encode("", true);
  std::vector<std::vector<int>> prompts(requests);
  for (std::uint32_t i = 0; i < requests; ++i) {
    const std::size_t from = (std::size_t{i} * stride) % span;
    std::vector<int>& p = prompts[i];
    if (bos) {
      p = with_bos;
      p.resize(1);
    }
    p.insert(p.end(), all.begin() + static_cast<std::ptrdiff_t>(from),
             all.begin() + static_cast<std::ptrdiff_t>(from + body));
  }
  return prompts;
}

throughput_result run_throughput(const model& m, const std::vector<std::vector<int>>& prompts,
                                 const throughput_options& o) {
  if (prompts.empty() || o.answer_tokens == 0) {
    fail("throughput: ", prompts.size(), " prompts and ", o.answer_tokens,
         " answer tokens (need at least one of each)");
  }
  if (o.mode != attention_mode::dense && o.mode != attention_mode::oasis) {
    fail("throughput: --mode ", to_string(o.mode), " (the batched engine runs dense or oasis)");
  }
  std::uint32_t longest = 0;
  for (const auto& p : prompts) {
    longest = std::max(longest, static_cast<std::uint32_t>(p.size()));
  }
  const model_config& c = m.config;
  throughput_result r;
  r.options = o;
  r.fast_tier_bytes = o.fast_tier_bytes;
  batch_options bo;
  // f16 K and V of one block of `block_tokens` tokens, as the engine's cache lays them out.
  const std::uint64_t block_bytes =
      std::uint64_t{bo.block_tokens} * c.num_kv_heads * c.head_dim * 2 * sizeof(std::uint16_t);
  const bool sized_here = r.fast_tier_bytes == 0;
  if (sized_here) {
    if (o.dense_sequences == 0) {
      fail("throughput: a fast tier for 0 dense sequences");
    }
    // The dense need of the longest request (every block of every layer, and the self-draft
    // model's blocks), dense_sequences times.
    const std::uint64_t blocks =
        (std::uint64_t{longest} + o.answer_tokens + bo.block_tokens - 1) / bo.block_tokens;
    const std::uint64_t layers = c.num_layers + (o.draft == draft_kind::self ? o.draft_layers : 0u);
    r.fast_tier_bytes = std::uint64_t{o.dense_sequences} * blocks * layers * block_bytes;
  }
  bo = engine_options(o);
  bo.fast_tier_bytes = r.fast_tier_bytes;
  batch_engine engine(m, bo);
  r.sequence_fast_bytes = engine.need(longest, o.answer_tokens).fast_bytes;
  if (sized_here && o.mode == attention_mode::dense &&
      r.sequence_fast_bytes * o.dense_sequences != r.fast_tier_bytes) {
    fail("throughput: the fast tier sized for ", o.dense_sequences, " dense sequences (",
         r.fast_tier_bytes, " bytes) disagrees with the engine's need of ", r.sequence_fast_bytes,
         " bytes per sequence");
  }

  using clock_type = std::chrono::steady_clock;
  const auto t0 = clock_type::now();
  std::vector<batch_engine::request_id> ids;
  for (const auto& p : prompts) {
    batch_request req;
    req.prompt = p;
    req.max_tokens = o.answer_tokens;
    req.ignore_eos = true;
    ids.push_back(engine.submit(std::move(req)));
  }
  engine.run();
  r.wall_seconds = std::chrono::duration<double>(clock_type::now() - t0).count();

  const batch_report& br = engine.report();
  r.peak_active = br.peak_active;
  r.decode_tokens = br.decode_tokens;
  r.decode_seconds = br.decode_seconds;
  r.prefill_seconds = br.prefill_seconds;
  r.decode_tokens_per_second = br.decode_tokens_per_second();
  r.rounds = br.rounds;
  r.drafted = br.drafted;
  r.accepted = br.accepted;
  r.verify_rows = br.verify_rows;
  r.by_decoding = br.by_decoding;
  std::vector<double> first, between, deliveries;
  std::uint64_t generated = 0;
  for (const auto id : ids) {
    const request_report& rr = engine.report(id);
    generated += rr.generated;
    first.push_back(rr.first_token_seconds);
    between.insert(between.end(), rr.token_seconds.begin(), rr.token_seconds.end());
    deliveries.insert(deliveries.end(), rr.delivery_seconds.begin(), rr.delivery_seconds.end());
  }
  r.overall_tokens_per_second =
      r.wall_seconds > 0 ? static_cast<double>(generated) / r.wall_seconds : 0.0;
  r.first_token = summarise(std::move(first));
  r.token = summarise(std::move(between));
  r.delivery = summarise(std::move(deliveries));
  return r;
}

std::string to_json(const throughput_result& r) {
  const throughput_options& o = r.options;
  std::string by;
  for (std::size_t n = 0; n < r.by_decoding.size(); ++n) {
    const concurrency_row& c = r.by_decoding[n];
    if (c.steps == 0) {
      continue;
    }
    by += fmt::format(R"({}{{"sequences": {}, "steps": {}, "tokens": {}, "seconds": {:.6f}, )"
                      R"("tokens_per_second": {:.4f}}})",
                      by.empty() ? "" : ", ", n, c.steps, c.tokens, c.seconds,
                      c.seconds > 0 ? static_cast<double>(c.tokens) / c.seconds : 0.0);
  }
  return fmt::format(
      R"({{"mode": "{}", "requests": {}, "prompt_tokens": {}, "answer_tokens": {}, )"
      R"("budget_tokens": {}, "draft": "{}", "draft_len": {}, "step_tokens": {}, )"
      R"("fast_tier_bytes": {}, "sequence_fast_bytes": {}, )"
      R"("peak_active": {}, "decode_tokens": {}, "decode_seconds": {:.6f}, )"
      R"("prefill_seconds": {:.6f}, "wall_seconds": {:.6f}, "decode_tokens_per_second": {:.4f}, )"
      R"("overall_tokens_per_second": {:.4f}, "first_token_seconds": {}, "token_seconds": {}, )"
      R"("delivery_seconds": {}, "rounds": {}, "drafted": {}, "accepted": {}, "verify_rows": {}, )"
      R"("by_decoding": [{}]}})",
      to_string(o.mode), o.requests, o.prompt_tokens, o.answer_tokens, o.budget_tokens,
      to_string(o.draft), o.draft_len, o.step_tokens, r.fast_tier_bytes, r.sequence_fast_bytes,
      r.peak_active, r.decode_tokens, r.decode_seconds, r.prefill_seconds, r.wall_seconds,
      r.decode_tokens_per_second, r.overall_tokens_per_second, json(r.first_token), json(r.token),
      json(r.delivery), r.rounds, r.drafted, r.accepted, r.verify_rows, by);
}

stall_result run_stall_probe(const model& m, const std::vector<int>& stream_prompt,
                             const std::vector<int>& long_prompt, const throughput_options& o) {
  if (o.mode != attention_mode::dense && o.mode != attention_mode::oasis) {
    fail("stall probe: --mode ", to_string(o.mode), " (the batched engine runs dense or oasis)");
  }
  const std::uint32_t ctx = o.context != 0 ? o.context : m.config.context_length;
  const auto S = static_cast<std::uint32_t>(stream_prompt.size());
  const auto L = static_cast<std::uint32_t>(long_prompt.size());
  if (S == 0 || L == 0 || S + 1 >= ctx || L + 1 >= ctx) {
    fail("stall probe: prompts of ", S, " and ", L, " tokens in a context of ", ctx);
  }
  batch_options bo = engine_options(o);
  bo.context = ctx;
  const std::uint32_t stream_max = ctx - S, long_max = 8;
  {
    bo.fast_tier_bytes = std::uint64_t{1} << 40;  // only to size the real budget below
    const batch_engine probe(m, bo);
    bo.fast_tier_bytes = probe.need(S, stream_max).fast_bytes + probe.need(L, long_max).fast_bytes;
  }
  batch_engine engine(m, bo);
  stall_result r;
  r.options = o;
  r.options.prompt_tokens = L;
  // The stream runs until the long prompt has its first token and 16 more deliveries came.
  bool long_started = false;
  std::uint32_t after = 0;
  batch_request stream;
  stream.prompt = stream_prompt;
  stream.max_tokens = stream_max;
  stream.ignore_eos = true;
  stream.on_token = [&](int) {
    return !long_started || ++after < 16 * transformer::max_step_tokens;
  };
  const auto sid = engine.submit(std::move(stream));
  // Warm up: the stream decodes for a while first.
  while (engine.report(sid).delivery_seconds.size() < 16 && !engine.done(sid)) {
    engine.step();
  }
  batch_request big;
  big.prompt = long_prompt;
  big.max_tokens = long_max;
  big.ignore_eos = true;
  big.on_token = [&](int) {
    long_started = true;
    return true;
  };
  const std::size_t gaps_before = engine.report(sid).delivery_seconds.size();
  const std::uint64_t chunks_before = engine.report().prefill_chunks;
  const auto lid = engine.submit(std::move(big));
  std::size_t gaps_at_start = 0;
  while (!engine.done(lid) || !engine.done(sid)) {
    engine.step();
    if (long_started && gaps_at_start == 0) {
      gaps_at_start = engine.report(sid).delivery_seconds.size();
      r.prefill_chunks = engine.report().prefill_chunks - chunks_before;
    }
  }
  const request_report& sr = engine.report(sid);
  const std::vector<double>& gaps = sr.delivery_seconds;
  r.median_gap = summarise(gaps).p50;
  // The gaps from the long prompt's submit to the first delivery after its first token.
  const std::size_t to = std::min(gaps.size(), gaps_at_start + 1);
  for (std::size_t i = gaps_before; i < to; ++i) {
    r.worst_gap = std::max(r.worst_gap, gaps[i]);
  }
  r.long_first_token = engine.report(lid).first_token_seconds;
  r.stream_tokens = sr.generated;
  return r;
}

std::string to_json(const stall_result& r) {
  const throughput_options& o = r.options;
  return fmt::format(
      R"({{"mode": "{}", "draft": "{}", "step_tokens": {}, "long_prompt_tokens": {}, )"
      R"("stream_tokens": {}, "median_gap_seconds": {:.6f}, "worst_gap_seconds": {:.6f}, )"
      R"("worst_over_median": {:.4f}, "long_first_token_seconds": {:.6f}, "prefill_chunks": {}}})",
      to_string(o.mode), to_string(o.draft), o.step_tokens, o.prompt_tokens, r.stream_tokens,
      r.median_gap, r.worst_gap, r.median_gap > 0 ? r.worst_gap / r.median_gap : 0.0,
      r.long_first_token, r.prefill_chunks);
}

}  // namespace mini_decoder
