// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Batched decoding with continuous batching, speculative decoding and chunked prefill:
//! many sequences decode together, so every weight matrix is read once per step for all of them
//! (one matrix-matrix product per layer, `transformer::step_batch`). Their KV lives in one
//! shared `tiered_kv_cache`.
//!
//! Each step: every decoding sequence drafts (prompt lookup, or the model's first layers) with a
//! draft length of its own, adapted to its recent acceptance; one batched verification pass runs
//! every sequence's `[x, d1..dg]` rows, each sequence attending the cache with `q_len = g + 1`
//! and the verification's side buffer (decode/verify.hpp), and each layer's verification queries
//! go to the batched `lookahead`, so the next step's blocks stage while the other layers and the
//! next drafts run; each sequence accepts its own prefix. Then prefill chunks, within the step's
//! token budget shared with the decode rows (vLLM's and SGLang's chunked prefill): a long prompt
//! holds the running sequences for one chunk at a time. Requests join when admitted (admission
//! is by fast-tier memory) and leave when done.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include <mini_decoder/decode/draft.hpp>
#include <mini_decoder/decode/sampler.hpp>
#include <mini_decoder/decode/self_draft.hpp>
#include <mini_decoder/decode/verify.hpp>
#include <mini_decoder/kv/kv_backend.hpp>
#include <mini_decoder/kv/shared_cache.hpp>
#include <mini_decoder/model/model.hpp>
#include <mini_decoder/model/transformer.hpp>

#include "oasiskv/core/ids.hpp"

namespace mini_decoder {

//! One generation request.
struct batch_request {
  std::vector<int> prompt;         //!< token ids, BOS included if the model wants one
  std::uint32_t max_tokens = 256;  //!< tokens to generate (>= 1)
  bool ignore_eos = false;         //!< generate past the end token (as `decoder_options`)
  float temperature = 0.0f;        //!< 0: greedy
  float top_p = 1.0f;
  std::uint64_t seed = 42;
  //! Sees each generated token as it is sampled; returning false ends this request (the others
  //! go on). Called from `step()`.
  std::function<bool(int)> on_token;
  //! Sampling beyond the three fields above (decode/sampler.hpp): top_k, presence and frequency
  //! penalties, logit_bias, and log-probabilities. Its own temperature, top_p and seed are not
  //! read: those above are.
  sampling_params sampling;
  //! With `sampling.logprobs >= 0`: sees each generated token's log-probabilities (of the
  //! logits the engine computed for it) just before `on_token` sees the token.
  std::function<void(const token_logprobs&)> on_logprobs;
};

//! `r.sampling` with `r`'s temperature, top_p and seed: what its sampler is built from.
sampling_params sampling_of(const batch_request& r);

//! How the engine is built.
struct batch_options {
  attention_mode mode = attention_mode::dense;  //!< dense or oasis
  summary_kind summary = default_summary;       //!< oasis: the block summary
  //! The fast tier's size, the admission budget: requests are admitted while the fast-tier
  //! memory they need (`batch_engine::need`) fits in it. Required (> 0).
  std::uint64_t fast_tier_bytes = 0;
  std::uint32_t budget_tokens = 1024;  //!< oasis: tokens one (sequence, layer) attends per step
  std::uint32_t block_tokens = 16;
  std::uint32_t context = 0;     //!< 0: the model's context length
  std::uint32_t max_batch = 64;  //!< most sequences decoding at once
  float rope_scale = 1.0f;
  //! Threads of the attention kernel. With 1, each sequence's attention is computed alone, in
  //! the same order as `decoder`'s; with more, the kernel splits work by the batch's total, so
  //! results may differ from a single-sequence run in the last bits.
  unsigned attention_threads = 1;
  //! Where each sequence's drafts come from: none (one token a step), ngram (prompt lookup) or
  //! self (the model's first `draft_layers` layers, with a dense cache of their own whose
  //! blocks admission counts as fast memory).
  draft_kind draft = draft_kind::none;
  std::uint32_t draft_len = 15;    //!< the most tokens a sequence drafts a round (1-15)
  bool adaptive_draft = true;      //!< adapt each sequence's length (`draft_length`); else fixed
  std::uint32_t draft_layers = 6;  //!< self: the draft model's layers
  //! The tokens one engine step computes, shared by the decode rows (each decoding sequence's
  //! pending token and drafts: decode first, drafts trimmed to fit, one row per sequence at
  //! least) and the prefill chunks of the sequences being admitted (what is left: multiples of
  //! `transformer::prefill_rows` tokens where it holds one, and at least
  //! `batch_engine::min_prefill_chunk` tokens a step; a step with nothing to decode prefills its
  //! first prompt whole). 0: no budget, each prompt is prefilled whole in the step that admits
  //! it (the decoding sequences wait for it).
  std::uint32_t step_tokens = 256;
};

//! What one sequence holds at its final length (prompt + max_tokens), in blocks of the cache.
struct sequence_need {
  //! Fast-tier blocks (what admission counts): the staged blocks, the self-speculative draft
  //! model's blocks, plus the block summaries' bytes rounded up to blocks (they are resident
  //! beside the staged KV).
  std::uint64_t fast_slots = 0;
  std::uint64_t draft_slots = 0;     //!< of fast_slots, the draft model's (self drafts)
  std::uint64_t capacity_slots = 0;  //!< capacity-tier blocks
  std::uint64_t fast_bytes = 0;      //!< fast_slots * block bytes
  std::uint64_t summary_bytes = 0;   //!< of fast_bytes, the summaries' (before rounding)
};

//! Percentiles of a list of latencies (seconds); all 0 for an empty list.
struct latency_summary {
  double p50 = 0, p90 = 0, p99 = 0, max = 0;
};
//! The nearest-rank percentiles of `v`.
latency_summary summarise(std::vector<double> v);

//! Timings of one request; seconds are counted from its `submit`.
struct request_report {
  std::uint32_t prompt_tokens = 0, generated = 0;
  std::uint32_t rounds = 0, drafted = 0, accepted = 0;  //!< speculative rounds and drafts
  double admitted_seconds = 0;     //!< submit -> admitted (its wait in the queue)
  double first_token_seconds = 0;  //!< submit -> first token (time to first token)
  //! Latency of each token after the first: the time since the previous delivery, shared by
  //! the tokens one step delivered together (they sum to the time from first to last token).
  std::vector<double> token_seconds;
  //! The time between consecutive deliveries after the first token: the gaps a streaming
  //! client sees (a step that accepts drafts delivers several tokens at once).
  std::vector<double> delivery_seconds;
  bool done = false;
  latency_summary inter_token() const { return summarise(token_seconds); }
};

//! Decode steps that ran a given number of sequences.
struct concurrency_row {
  std::uint64_t steps = 0, tokens = 0;  //!< steps, tokens they delivered
  double seconds = 0;                   //!< their decode time
};

//! The engine's totals.
struct batch_report {
  std::uint32_t peak_active = 0;    //!< most sequences held in the cache at once
  std::uint64_t steps = 0;          //!< batched decode steps
  std::uint64_t decode_tokens = 0;  //!< tokens delivered by decode steps (not by prefill)
  double decode_seconds = 0;        //!< time in decode steps (drafting, verification, commits)
  double prefill_seconds = 0;       //!< time in prefill chunks
  std::uint64_t prefill_chunks = 0, prefill_tokens = 0;
  //! Speculation: sequence-rounds (one sequence's part of a step), drafts proposed and
  //! accepted, and the verification rows computed (pending tokens and drafts).
  std::uint64_t rounds = 0, drafted = 0, accepted = 0, verify_rows = 0;
  //! `by_decoding[n]`: the decode steps that ran n sequences (decode throughput against
  //! requests held).
  std::vector<concurrency_row> by_decoding;
  std::uint64_t fast_tier_bytes = 0, capacity_tier_bytes = 0;
  oasiskv::cache_stats cache{};
  //! Decode tokens per second over all sequences.
  double decode_tokens_per_second() const {
    return decode_seconds > 0 ? static_cast<double>(decode_tokens) / decode_seconds : 0.0;
  }
};

//! The batched engine. Not thread-safe: one thread calls submit/step/run.
class batch_engine {
 public:
  using request_id = std::uint64_t;
  //! The least prefill a step with a prompt to prefill does, whatever its budget holds.
  static constexpr std::uint32_t min_prefill_chunk = 16;

  //! Builds the shared cache: a fast tier of `o.fast_tier_bytes` (whole blocks) and a capacity
  //! tier large enough for every sequence the fast tier can admit at once (see `need`).
  //! Throws `decoder_error` for a mode other than dense or oasis, a budget of 0 or one too small
  //! for any block or selection, a `max_batch` of 0, a draft length outside [1, 15] or draft
  //! layers outside [1, layers).
  batch_engine(const model& m, batch_options o);
  ~batch_engine();
  batch_engine(const batch_engine&) = delete;
  batch_engine& operator=(const batch_engine&) = delete;

  //! Queues a request (FIFO) and returns its id. Throws `decoder_error`, queueing nothing, for an
  //! empty prompt, max_tokens 0, a token outside the vocabulary, prompt + max_tokens beyond the
  //! context, or a request whose `need` exceeds the whole fast-tier budget (it could never be
  //! admitted); the message names the numbers.
  request_id submit(batch_request r);

  //! One engine step: admits the waiting requests that fit, in order; one speculative round
  //! for every decoding sequence in one batched verification pass; prefill chunks within what
  //! is left of the step's token budget (a sequence whose prompt is done samples its first
  //! token from the prefill and decodes from the next step); then retires the finished
  //! sequences (their blocks return to the cache). Returns whether work remains. An exception
  //! from a step (a failing per-token callback, the cache out of memory) leaves the engine
  //! unusable.
  bool step();
  //! Steps until every submitted request is done.
  void run();

  //! The fast-tier and capacity-tier blocks a sequence of `prompt_tokens + max_tokens` holds:
  //! dense: every block of every layer, `layers * blocks(len)` fast and capacity slots. Oasis:
  //! per layer the selection being attended and the next one being prefetched plus the sinks
  //! and window a lookahead adds, `2 * budget_blocks + 4`, capped by the dense need `blocks(len)`
  //! (the staging `make_kv_backend` gives one sequence), and the summary entries of all its
  //! blocks, `layers * blocks(len) * summary bytes per block`, rounded up to whole blocks; its
  //! whole KV in the capacity tier. Self drafts add the draft model's dense cache,
  //! `draft_layers * blocks(len)` (a round never drafts past the final length). The capacity
  //! side counts one block per layer of slack, as `make_kv_backend` does.
  sequence_need need(std::uint32_t prompt_tokens, std::uint32_t max_tokens) const;

  //! Ends a request at once, whatever its state: a waiting one leaves the queue; an active one's
  //! sequence leaves the cache, and its fast-tier and capacity reservations return for the next
  //! admission. It is then done (no more tokens, `forget` may drop it). Does nothing for a done
  //! request; throws `decoder_error` for an unknown one. Between steps, as every call.
  void cancel(request_id id);

  bool done(request_id id) const;
  //! Drops a done request's output and report (a long-running engine calls it after reading
  //! them). Throws `decoder_error` for an unknown or unfinished request.
  void forget(request_id id);
  //! The tokens generated so far (no end token unless `ignore_eos`).
  const std::vector<int>& output(request_id id) const;
  const request_report& report(request_id id) const;
  const batch_report& report() const;
  std::size_t active() const { return active_.size(); }
  //! Of the active sequences, those past their prefill.
  std::size_t decoding() const;
  std::size_t waiting() const { return queue_.size(); }
  //! Fast-tier blocks held by the active sequences' reservations, and the whole budget.
  std::uint64_t fast_slots_reserved() const { return fast_used_; }
  std::uint64_t fast_slots() const { return fast_slots_; }
  std::uint32_t context() const { return ctx_; }
  //! Checks the shared cache's invariants (`tiered_kv_cache::audit`) and that it holds exactly
  //! the active sequences; returns the blocks compared. O(everything): for tests.
  std::size_t audit();

  using clock_type = std::chrono::steady_clock;

 private:
  struct record {
    batch_request req;
    sequence_need need;
    std::vector<int> out;
    request_report rep;
    clock_type::time_point submitted, last_token;
  };
  struct sequence {
    sequence(request_id i, const batch_request& r, const batch_options& o, const model_config& c)
        : id(i),
          smp(sampling_of(r)),
          length(o.draft == draft_kind::none ? 0 : o.draft_len, o.adaptive_draft),
          side(c),
          prompt(static_cast<std::uint32_t>(r.prompt.size())) {}
    bool decoding() const { return prefilled == prompt; }
    request_id id;
    oasiskv::sequence_id seq{};        // in the shared cache
    oasiskv::sequence_id draft_seq{};  // in the draft model's cache (self drafts)
    sampler smp;
    draft_length length;
    verify_side side;                         // the last committed tokens' K,V of each layer
    std::vector<int> history;                 // prompt lookup: the prompt and the committed tokens
    std::uint32_t prompt = 0, prefilled = 0;  // prompt tokens, and those in the cache
    int pending = 0;                          // the last token sampled, verified next
    std::uint32_t pos = 0;                    // its position: the tokens already in the cache
    bool stop = false;
    // this step's round
    std::vector<int> drafts;
    std::vector<token_logprobs> logprobs;  // of the tokens it samples (with sampling.logprobs)
    std::uint32_t row = 0;                 // its first verification row
  };
  record& find(request_id id, const char* what);
  const record& find(request_id id, const char* what) const;
  void admit(request_id id);
  void release(const sequence& s);
  // `logprobs`: the tokens' log-probabilities (with `sampling.logprobs >= 0`), or null.
  void deliver(sequence& s, const int* tokens, std::uint32_t count,
               const token_logprobs* logprobs = nullptr);
  void retire_finished();
  std::uint32_t decode_step();
  void draft_round(std::uint32_t budget);
  void commit_round();
  void prefill_step(std::uint32_t budget);
  void prefill_chunk(sequence& s, std::uint32_t n);
  void verify_layer(std::uint32_t l, std::uint32_t rows, const float* q, const float* k,
                    const float* v, float* out);

  const model& m_;
  batch_options o_;
  transformer tf_;
  std::unique_ptr<shared_kv_cache> cache_;
  std::unique_ptr<self_drafter> drafter_;  // self drafts
  std::uint32_t ctx_ = 0, kv_dim_ = 0, budget_blocks_ = 0;
  std::uint64_t block_bytes_ = 0, fast_slots_ = 0, capacity_slots_ = 0;
  std::uint64_t summary_block_bytes_ = 0;  //!< oasis: the summary's bytes per block
  std::uint64_t fast_used_ = 0, capacity_used_ = 0;
  request_id next_id_ = 1;
  std::map<request_id, record> records_;
  std::deque<request_id> queue_;
  std::vector<sequence> active_;
  batch_report report_;
  // step scratch
  std::vector<sequence*> round_;       // the decoding sequences, by verification rows
  std::vector<std::uint32_t> groups_;  // start of each run of round_ with equal rows; end last
  std::vector<int> tokens_;
  std::vector<std::uint32_t> positions_;
  std::vector<oasiskv::sequence_id> seq_ids_;
  std::vector<float> logits_, lse_, kv_f32_, past_k_, past_v_;
  std::vector<std::vector<float>> verify_k_, verify_v_;  // this step's rows' K,V per layer
  std::vector<std::uint16_t> k16_, v16_;
  std::vector<self_drafter::job> jobs_;
};

}  // namespace mini_decoder
