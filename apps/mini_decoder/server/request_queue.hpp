// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Between the HTTP handlers and the engine: the requests they share, the queue they hand
//! them over through, and the engine thread that owns the `batch_engine`.
//!
//! A handler builds a `job` and `submit`s it; that returns at once. The engine thread (`run`)
//! takes new jobs between engine steps, steps while there is work, and detokenizes each token
//! into its job's text; each change wakes the job's reader (`job::wake`: the HTTP loop, which
//! then polls it). A reader that goes away `cancel`s its job: the engine thread drops it at
//! once, between two steps, whether it waits for admission or runs (its fast-tier bytes return
//! then). No HTTP here.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <mini_decoder/batch/batch.hpp>
#include <mini_decoder/model/model.hpp>
#include <mini_decoder/server/openai.hpp>
#include <mini_decoder/server/request_error.hpp>
#include <mini_decoder/tokenizer/tokenizer.hpp>

namespace mini_decoder::serving {

//! Where a request is: waiting in the queue, accepted by the engine, or ended.
enum class phase : std::uint8_t { queued, accepted, done, failed };

//! One request (one choice of it) as the engine thread and its reader share it.
struct job {
  using clock_type = std::chrono::steady_clock;

  // Set by the handler before `submit`; read by the engine thread.
  batch_request req;
  std::vector<std::string> stop;  // stop strings (none empty)
  int prev = -1;                  // the token before the next one (detokenization)

  std::mutex m;
  phase ph = phase::queued;
  request_error error;    // phase::failed
  std::string text;       // the output so far, cut at a stop string
  std::size_t ready = 0;  // bytes of `text` final enough to send (no partial stop, no cut char)
  std::uint32_t completion_tokens = 0;
  bool stopped = false;                 // a stop string matched
  bool aborted = false;                 // ended by the server stopping (phase::done)
  std::vector<token_logprob> logprobs;  // with req.sampling.logprobs >= 0: one per token
  clock_type::time_point submitted, first_token, ended;
  request_report report;  // the engine's timings and drafts, once done (not when aborted)
  std::atomic<bool> cancelled{false};

  //! Sets the function that wakes the reader (any thread may then call it); call before
  //! `submit` or under no lock, then read the job's state: nothing is missed.
  void set_wake(std::function<void()> w);
  //! Ends the job with `e` unless it has ended already, and wakes its reader.
  void fail(request_error e);
  //! Wakes the reader (after a change; never with `m` held).
  void notify();

 private:
  std::mutex wake_m_;
  std::function<void()> wake_;
};

//! Bytes at the end of `s` that might still become a stop string, or an unfinished UTF-8
//! character: they wait for the next token.
std::size_t held_back(const std::string& s, const std::vector<std::string>& stop);

//! What the engine thread publishes after each step (for /health and /metrics).
struct engine_stats {
  std::size_t active = 0, waiting = 0;  // sequences decoding; requests waiting for admission
  std::uint64_t fast_bytes_reserved = 0, fast_bytes = 0;
  std::uint64_t steps = 0, prompt_tokens = 0, generated_tokens = 0;
  std::uint64_t cancelled = 0;  // requests ended by their reader leaving
  std::uint64_t prefetch_hits = 0, prefetch_misses = 0;
  double decode_seconds = 0, prefill_seconds = 0;
};

//! The queue from the handlers to the engine thread, and that thread's loop.
class request_queue {
 public:
  //! Builds the engine; throws `decoder_error` for bad engine options.
  request_queue(const model& m, const batch_options& o);
  ~request_queue();
  request_queue(const request_queue&) = delete;
  request_queue& operator=(const request_queue&) = delete;

  //! The engine's context: prompt + max_tokens of any request must fit in it.
  std::uint32_t context() const { return context_; }

  //! Queues `j` (its `req`, `stop` and `prev` set; the callbacks are set here) and returns. The
  //! engine thread then accepts it (`phase::accepted`) or refuses it (`fail`, 400 naming
  //! `max_tokens`: it could never be admitted). Throws `request_error` 503 once the queue is
  //! stopping. Every request enters the engine here.
  void submit(const std::shared_ptr<job>& j);
  //! Its reader left: the engine thread drops `j` before its next step, waiting or running.
  void cancel(const std::shared_ptr<job>& j);

  //! The engine thread: until `stop`, takes the queued jobs and the cancellations between
  //! steps, steps while any job runs, ends the done ones. An engine failure fails every running
  //! job (500) and rebuilds the engine. On `stop`, ends what is queued or running with
  //! `aborted` set, so that every reader can finish its answer.
  void run();
  //! Makes `run` return. Safe to call more than once.
  void stop();

  //! No request queued, waiting or running.
  bool idle() const { return busy_ == 0; }
  engine_stats stats() const;

 private:
  // The per-token callbacks (engine thread): log-probabilities; detokenize, cut at a stop
  // string, wake the reader.
  void on_logprobs(job& j, const token_logprobs& lp);
  bool on_token(job& j, int tok);
  static void finish(job& j, bool aborted);
  void publish();

  const model& m_;
  batch_options o_;
  std::unique_ptr<batch_engine> engine_;  // owned by the engine thread once `run` starts
  std::uint32_t context_ = 0;
  std::uint64_t block_bytes_ = 0;

  mutable std::mutex queue_m_;  // guards queue_, cancels_, stopping_ and stats_
  std::condition_variable queue_cv_;
  std::deque<std::shared_ptr<job>> queue_;
  std::vector<std::shared_ptr<job>> cancels_;
  bool stopping_ = false;
  engine_stats stats_;
  std::atomic<std::size_t> busy_{0};  // jobs submitted and not yet ended
  std::uint64_t prompt_tokens_ = 0, generated_ = 0, cancelled_ = 0;  // engine thread
};

}  // namespace mini_decoder::serving
