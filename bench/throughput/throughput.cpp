// SPDX-License-Identifier: Apache-2.0
#include <throughput/throughput.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include <mini_decoder/io/error.hpp>

namespace mini_decoder {

namespace {

latency_summary summarise(std::vector<double> v) {
  latency_summary s;
  if (v.empty()) {
    return s;
  }
  std::sort(v.begin(), v.end());
  auto at = [&](double q) {
    const auto i = static_cast<std::size_t>(std::ceil(q * static_cast<double>(v.size()))) - 1;
    return v[std::min(i, v.size() - 1)];
  };
  s.p50 = at(0.50);
  s.p90 = at(0.90);
  s.p99 = at(0.99);
  s.max = v.back();
  return s;
}

std::string json(const latency_summary& s) {
  return fmt::format(R"({{"p50": {:.6f}, "p90": {:.6f}, "p99": {:.6f}, "max": {:.6f}}})", s.p50,
                     s.p90, s.p99, s.max);
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
    // The dense need of the longest request (every block of every layer), dense_sequences times.
    const std::uint64_t blocks =
        (std::uint64_t{longest} + o.answer_tokens + bo.block_tokens - 1) / bo.block_tokens;
    r.fast_tier_bytes = std::uint64_t{o.dense_sequences} * blocks * c.num_layers * block_bytes;
  }
  bo.mode = o.mode;
  bo.summary = o.summary;
  bo.fast_tier_bytes = r.fast_tier_bytes;
  bo.budget_tokens = o.budget_tokens;
  bo.max_batch = o.max_batch;
  bo.attention_threads = o.attention_threads;
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
  std::vector<double> first, between;
  std::uint64_t generated = 0;
  for (const auto id : ids) {
    const request_report& rr = engine.report(id);
    generated += rr.generated;
    first.push_back(rr.first_token_seconds);
    between.insert(between.end(), rr.token_seconds.begin(), rr.token_seconds.end());
  }
  r.overall_tokens_per_second =
      r.wall_seconds > 0 ? static_cast<double>(generated) / r.wall_seconds : 0.0;
  r.first_token = summarise(std::move(first));
  r.token = summarise(std::move(between));
  return r;
}

std::string to_json(const throughput_result& r) {
  const throughput_options& o = r.options;
  return fmt::format(
      R"({{"mode": "{}", "requests": {}, "prompt_tokens": {}, "answer_tokens": {}, )"
      R"("budget_tokens": {}, "fast_tier_bytes": {}, "sequence_fast_bytes": {}, )"
      R"("peak_active": {}, "decode_tokens": {}, "decode_seconds": {:.6f}, )"
      R"("prefill_seconds": {:.6f}, "wall_seconds": {:.6f}, "decode_tokens_per_second": {:.4f}, )"
      R"("overall_tokens_per_second": {:.4f}, "first_token_seconds": {}, "token_seconds": {}}})",
      to_string(o.mode), o.requests, o.prompt_tokens, o.answer_tokens, o.budget_tokens,
      r.fast_tier_bytes, r.sequence_fast_bytes, r.peak_active, r.decode_tokens, r.decode_seconds,
      r.prefill_seconds, r.wall_seconds, r.decode_tokens_per_second, r.overall_tokens_per_second,
      json(r.first_token), json(r.token));
}

}  // namespace mini_decoder
