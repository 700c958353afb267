// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The equal-memory throughput benchmark: a stream of long-prompt requests through the
//! batched engine with a fixed fast-tier byte budget, dense or OasisKV. With the full KV outside
//! fast memory, OasisKV admits more requests into the same bytes, and the batched engine turns
//! them into more tokens per second.
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
};

struct latency_summary {
  double p50 = 0, p90 = 0, p99 = 0, max = 0;
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
  latency_summary token;                  //!< between consecutive tokens of a request
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

}  // namespace mini_decoder
