// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The equal-memory throughput benchmark: a stream of long-prompt requests through the
//! batched engine with a fixed fast-tier byte budget, dense or OasisKV, both with the same
//! speculative decoding. With the full KV outside fast memory, OasisKV admits more requests into
//! the same bytes, and the batched engine turns them into more tokens per second. And the stall
//! probe: how long a running stream waits while a long prompt is admitted (chunked prefill).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <mini_decoder/batch/batch.hpp>
#include <mini_decoder/model/model.hpp>

namespace mini_decoder {

struct throughput_options {
  attention_mode mode = attention_mode::dense;  //!< dense or oasis
  summary_kind summary = default_summary;       //!< oasis: the block summary
  std::uint32_t requests = 16;                  //!< requests in the stream
  std::uint32_t prompt_tokens = 8064;           //!< each request's prompt
  std::uint32_t answer_tokens = 128;            //!< generated per request (end tokens ignored)
  //! The fast tier's bytes; 0: room for `dense_sequences` dense sequences of this length.
  std::uint64_t fast_tier_bytes = 0;
  std::uint32_t dense_sequences = 4;   //!< sizes the default fast tier
  std::uint32_t budget_tokens = 1024;  //!< oasis
  std::uint32_t max_batch = 64;
  unsigned attention_threads = 1;
  draft_kind draft = draft_kind::ngram;  //!< both modes draft alike
  std::uint32_t draft_len = 15;          //!< the adaptive draft length's cap
  std::uint32_t draft_layers = 6;        //!< self drafts
  //! `batch_options::step_tokens`: 0 (the default here) prefills each admitted prompt whole
  //! before decoding on, so the requests held decode together, which is what this measures.
  std::uint32_t step_tokens = 0;
  std::uint32_t context = 0;  //!< 0: the model's
  float rope_scale = 1.0f;
};

struct throughput_result {
  throughput_options options;
  std::uint64_t fast_tier_bytes = 0;      //!< the budget the engine ran with
  std::uint64_t sequence_fast_bytes = 0;  //!< what one request holds in it
  std::uint32_t peak_active = 0;          //!< requests held at once
  std::uint64_t decode_tokens = 0;        //!< tokens from decode steps, all requests
  double decode_seconds = 0;              //!< time in decode steps
  double prefill_seconds = 0;             //!< time in admission prefills
  double wall_seconds = 0;                //!< first submit to last token
  double decode_tokens_per_second = 0;    //!< decode_tokens / decode_seconds
  double overall_tokens_per_second = 0;   //!< all generated tokens / wall_seconds
  latency_summary first_token;            //!< submit -> first token, seconds
  latency_summary token;                  //!< per token after the first (inter-token latency)
  latency_summary delivery;               //!< between a request's deliveries (what it streams)
  std::uint64_t rounds = 0, drafted = 0, accepted = 0, verify_rows = 0;  //!< speculation
  std::vector<concurrency_row> by_decoding;  //!< decode steps by the sequences they ran
};

//! How long a running stream waits while a long prompt is admitted.
struct stall_result {
  throughput_options options;        //!< mode, drafts, step_tokens; prompt_tokens: the long one's
  double median_gap = 0;             //!< the stream's median gap between deliveries
  double worst_gap = 0;              //!< its worst from the long prompt's submit to its first token
  double long_first_token = 0;       //!< the long prompt's time to first token
  std::uint64_t prefill_chunks = 0;  //!< chunks the long prompt took
  std::uint32_t stream_tokens = 0;   //!< tokens the stream delivered
};

//! `requests` prompts of `prompt_tokens` tokens each, cut from consecutive windows of `text`'s
//! tokens (BOS first where the model wants one); the windows wrap around when the text is
//! shorter than all of them. Throws `decoder_error` when the text has fewer tokens than one
//! prompt.
std::vector<std::vector<int>> throughput_prompts(const model& m, const std::string& text,
                                                 std::uint32_t requests,
                                                 std::uint32_t prompt_tokens);

//! Submits every prompt at once (a saturating burst: the queue is never empty while requests
//! wait) to a `batch_engine` with the options' fast tier, runs until all are done, and
//! summarises. Throws `decoder_error` for bad options (no request, no prompt or answer tokens,
//! a budget that cannot hold one request).
throughput_result run_throughput(const model& m, const std::vector<std::vector<int>>& prompts,
                                 const throughput_options& o);

//! The result as one JSON object.
std::string to_json(const throughput_result& r);

//! One request streams (`stream_prompt`, decoding) while `long_prompt` arrives; the engine
//! (fast tier for both, the options' mode, drafts and `step_tokens`) runs until the long prompt
//! has its first token and the stream a few more. Throws `decoder_error` for prompts that do not
//! fit the context.
stall_result run_stall_probe(const model& m, const std::vector<int>& stream_prompt,
                             const std::vector<int>& long_prompt, const throughput_options& o);
std::string to_json(const stall_result& r);

}  // namespace mini_decoder
