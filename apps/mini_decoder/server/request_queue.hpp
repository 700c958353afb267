// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Between the HTTP handlers and the engine: the requests they share, the queue they hand
//! them over through, and the engine thread that owns the `batch_engine`.
//!
//! A handler builds a `job`, `submit`s it and waits until the engine thread accepts or refuses
//! it; it then reads the text back from the job as the engine produces it. The engine thread
//! (`run`) takes new jobs between engine steps, steps while there is work, and detokenizes each
//! token into its job's text. No HTTP here.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <mini_decoder/batch/batch.hpp>
#include <mini_decoder/model/model.hpp>
#include <mini_decoder/server/request_error.hpp>
#include <mini_decoder/tokenizer/tokenizer.hpp>

namespace mini_decoder::serving {

//! Where a request is: waiting in the queue, accepted by the engine, or ended.
enum class phase : std::uint8_t { queued, accepted, done, failed };

//! One request as the engine thread and its handler share it.
struct job {
  // Set by the handler before queueing; read by the engine thread.
  batch_request req;
  std::vector<std::string> stop;  // stop strings (none empty)
  int prev = -1;                  // the token before the next one (detokenization)

  std::mutex m;
  std::condition_variable cv;
  phase ph = phase::queued;
  request_error error;    // phase::failed
  std::string text;       // the output so far, cut at a stop string
  std::size_t ready = 0;  // bytes of `text` final enough to send (no partial stop, no cut char)
  std::uint32_t completion_tokens = 0;
  bool stopped = false;   // a stop string matched
  request_report report;  // the engine's timings and drafts, once done
  std::atomic<bool> cancelled{false};

  //! Ends the job with `e` unless it has ended already, and wakes its handler.
  void fail(request_error e);
};

//! Bytes at the end of `s` that might still become a stop string, or an unfinished UTF-8
//! character: they wait for the next token.
std::size_t held_back(const std::string& s, const std::vector<std::string>& stop);

//! The model's tokenizer for the handlers (encode) and the engine thread (decode): it caches
//! what it encodes, so one caller at a time.
class shared_tokenizer {
 public:
  explicit shared_tokenizer(const tokenizer& t) : t_(t) {}
  std::vector<int> encode(const std::string& text, bool add_bos);
  std::string decode(int prev, int token);

 private:
  const tokenizer& t_;
  std::mutex m_;
};

//! The queue from the handlers to the engine thread, and that thread's loop.
class request_queue {
 public:
  //! Builds the engine; throws `decoder_error` for bad engine options.
  request_queue(const model& m, const batch_options& o, shared_tokenizer& tok);
  ~request_queue();
  request_queue(const request_queue&) = delete;
  request_queue& operator=(const request_queue&) = delete;

  //! The engine's context: prompt + max_tokens of any request must fit in it.
  std::uint32_t context() const { return context_; }

  //! Queues `j` (its `req`, `stop` and `prev` set; the per-token callback is set here) and waits
  //! until the engine accepts or refuses it. Throws `request_error`: the engine's refusal (400),
  //! or 503 once the queue is stopping. Every request enters the engine here.
  void submit(const std::shared_ptr<job>& j);

  //! The engine thread: until `stop`, takes the queued jobs between steps (`batch_engine::submit`
  //! refusals fail them with 400), steps while any is running, ends the done ones. An engine
  //! failure fails every running job (500) and rebuilds the engine. On `stop`, fails what is
  //! queued or running (503), so every waiting handler returns.
  void run();
  //! Makes `run` return. Safe to call more than once.
  void stop();

  std::size_t active() const { return active_; }          //!< sequences decoding
  std::size_t waiting() const { return waiting_; }        //!< requests waiting for admission
  std::uint64_t cancelled() const { return cancelled_; }  //!< ended by their client leaving

 private:
  // The per-token callback (engine thread): detokenize, cut at a stop string, wake the handler.
  bool on_token(job& j, int tok);
  static void finish(job& j, const request_report& r);

  const model& m_;
  batch_options o_;
  shared_tokenizer& tok_;
  std::unique_ptr<batch_engine> engine_;  // owned by the engine thread once `run` starts
  std::uint32_t context_ = 0;

  std::mutex queue_m_;  // guards queue_ and stopping_
  std::condition_variable queue_cv_;
  std::deque<std::shared_ptr<job>> queue_;
  bool stopping_ = false;
  std::atomic<std::size_t> active_{0}, waiting_{0};
  std::atomic<std::uint64_t> cancelled_{0};
};

}  // namespace mini_decoder::serving
