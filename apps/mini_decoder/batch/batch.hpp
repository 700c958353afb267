// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Batched decoding with continuous batching: many sequences decode together, one token
//! each per step, so every weight matrix is read once per step for all of them (one
//! matrix-matrix product per layer, `transformer::step_batch`). Their KV lives in one shared
//! `tiered_kv_cache`; each layer's attention is one batched `attend` over every active sequence.
//! Requests join when admitted (admission is by fast-tier memory) and leave when done.
//!
//! No speculative drafting here: every step commits exactly one token per active sequence.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include <mini_decoder/decode/sampler.hpp>
#include <mini_decoder/kv/kv_backend.hpp>
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
};

//! What one sequence holds at its final length (prompt + max_tokens), in blocks of the cache.
struct sequence_need {
  //! Fast-tier blocks (what admission counts): the staged blocks, plus the block summaries'
  //! bytes rounded up to blocks (they are resident beside the staged KV).
  std::uint64_t fast_slots = 0;
  std::uint64_t capacity_slots = 0;  //!< capacity-tier blocks
  std::uint64_t fast_bytes = 0;      //!< fast_slots * block bytes
  std::uint64_t summary_bytes = 0;   //!< of fast_bytes, the summaries' (before rounding)
};

//! Timings of one request; seconds are counted from its `submit`.
struct request_report {
  std::uint32_t prompt_tokens = 0, generated = 0;
  double admitted_seconds = 0;     //!< submit -> admitted (its wait in the queue)
  double first_token_seconds = 0;  //!< submit -> first token (time to first token)
  //! Latency of each token after the first: the time since the previous one.
  std::vector<double> token_seconds;
  bool done = false;
};

//! The engine's totals.
struct batch_report {
  std::uint32_t peak_active = 0;    //!< most sequences held in the cache at once
  std::uint64_t steps = 0;          //!< batched decode steps
  std::uint64_t decode_tokens = 0;  //!< tokens produced by decode steps (not by prefill)
  double decode_seconds = 0;        //!< time in decode steps
  double prefill_seconds = 0;       //!< time in admission prefills
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

  //! Builds the shared cache: a fast tier of `o.fast_tier_bytes` (whole blocks) and a capacity
  //! tier large enough for every sequence the fast tier can admit at once (see `need`).
  //! Throws `decoder_error` for a mode other than dense or oasis, a budget of 0 or one too small
  //! for any block or selection, a `max_batch` of 0.
  batch_engine(const model& m, batch_options o);
  ~batch_engine();
  batch_engine(const batch_engine&) = delete;
  batch_engine& operator=(const batch_engine&) = delete;

  //! Queues a request (FIFO) and returns its id. Throws `decoder_error`, queueing nothing, for an
  //! empty prompt, max_tokens 0, a token outside the vocabulary, prompt + max_tokens beyond the
  //! context, or a request whose `need` exceeds the whole fast-tier budget (it could never be
  //! admitted); the message names the numbers.
  request_id submit(batch_request r);

  //! One engine step: admits the waiting requests that fit, in order (each prefilled densely
  //! into its new sequence, its first token sampled from the prefill), then one decode token for
  //! every active sequence in one batched forward pass, then retires the finished sequences
  //! (their blocks return to the cache). Returns whether work remains. An exception from a step
  //! (a failing per-token callback, the cache out of memory) leaves the engine unusable.
  bool step();
  //! Steps until every submitted request is done.
  void run();

  //! The fast-tier and capacity-tier blocks a sequence of `prompt_tokens + max_tokens` holds:
  //! dense: every block of every layer, `layers * blocks(len)` fast and capacity slots. Oasis:
  //! per layer the selection being attended and the next one being prefetched plus the sinks
  //! and window a lookahead adds, `2 * budget_blocks + 4`, capped by the dense need `blocks(len)`
  //! (the staging `make_kv_backend` gives one sequence), and the summary entries of all its
  //! blocks, `layers * blocks(len) * summary bytes per block`, rounded up to whole blocks; its
  //! whole KV in the capacity tier. The capacity side counts one block per layer of slack, as
  //! `make_kv_backend` does.
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
  std::size_t waiting() const { return queue_.size(); }
  //! Fast-tier blocks held by the active sequences' reservations, and the whole budget.
  std::uint64_t fast_slots_reserved() const { return fast_used_; }
  std::uint64_t fast_slots() const { return fast_slots_; }
  std::uint32_t context() const { return ctx_; }
  //! Checks the shared cache's invariants (`tiered_kv_cache::audit`) and that it holds exactly
  //! the active sequences; returns the blocks compared. O(everything): for tests.
  std::size_t audit();

  class cache;  //!< the shared cache behind a small virtual interface (one per mode)

 private:
  using clock_type = std::chrono::steady_clock;
  struct record {
    batch_request req;
    sequence_need need;
    std::vector<int> out;
    request_report rep;
    clock_type::time_point submitted, last_token;
  };
  struct sequence {
    sequence(request_id i, oasiskv::sequence_id s, const batch_request& r)
        : id(i), seq(s), smp(sampling_of(r)) {}
    request_id id;
    oasiskv::sequence_id seq;  // in the shared cache
    sampler smp;
    int pending = 0;        // the last token sampled, fed to the next step
    std::uint32_t pos = 0;  // its position: the tokens already in the cache
    bool stop = false;
  };
  record& find(request_id id, const char* what);
  const record& find(request_id id, const char* what) const;
  void admit(request_id id);
  void emit(sequence& s, int tok);
  void retire_finished();
  void decode_step();
  void attend_layer(std::uint32_t l, std::uint32_t n, const float* q, const float* k,
                    const float* v, float* out);

  const model& m_;
  batch_options o_;
  transformer tf_;
  std::unique_ptr<cache> cache_;
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
  std::vector<int> tokens_;
  std::vector<std::uint32_t> positions_;
  std::vector<oasiskv::sequence_id> seq_ids_;
  std::vector<float> logits_, lse_;
  std::vector<std::uint16_t> k16_, v16_;
};

}  // namespace mini_decoder
