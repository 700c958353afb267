// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/server/request_queue.hpp>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <map>
#include <unordered_map>
#include <utility>

#include <mini_decoder/io/error.hpp>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/layout.hpp"

namespace mini_decoder::serving {

void job::set_wake(std::function<void()> w) {
  std::lock_guard<std::mutex> lk(wake_m_);
  wake_ = std::move(w);
}

void job::notify() {
  std::lock_guard<std::mutex> lk(wake_m_);
  if (wake_) {
    wake_();
  }
}

void job::fail(request_error e) {
  {
    std::lock_guard<std::mutex> lk(m);
    if (ph == phase::done || ph == phase::failed) {
      return;
    }
    ph = phase::failed;
    error = std::move(e);
    ended = clock_type::now();
  }
  notify();
}

std::size_t held_back(const std::string& s, const std::vector<std::string>& stop) {
  std::size_t hold = 0;
  for (const std::string& x : stop) {
    for (std::size_t k = std::min(x.size() - 1, s.size()); k > hold; --k) {
      if (s.compare(s.size() - k, k, x, 0, k) == 0) {
        hold = k;
        break;
      }
    }
  }
  // The last character's lead byte in the (at most 3) bytes before the end of what is left.
  const std::size_t n = s.size() - hold;
  for (std::size_t back = 1; back <= 3 && back <= n; ++back) {
    const auto c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80) {
      continue;  // continuation byte
    }
    const std::size_t len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return len > back ? hold + back : hold;
  }
  return hold;
}

request_queue::request_queue(const model& m, const batch_options& o)
    : m_(m), o_(o), engine_(std::make_unique<batch_engine>(m_, o_)) {
  context_ = engine_->context();
  const model_config& c = m.config;
  const oasiskv::kv_layout l{c.num_layers, c.num_heads,    c.num_kv_heads,
                             c.head_dim,   o.block_tokens, oasiskv::dtype::f16};
  block_bytes_ = l.block_bytes();
  publish();
}

request_queue::~request_queue() = default;

void request_queue::submit(const std::shared_ptr<job>& j) {
  {
    std::lock_guard<std::mutex> lk(queue_m_);
    if (stopping_) {
      throw request_error{503, "the server is shutting down", "", "server_error"};
    }
    job* raw = j.get();  // the engine's record lives no longer than `run` holds `j`
    j->req.on_token = [this, raw](int t) {
      return on_token(*raw, t);
    };
    if (j->req.sampling.logprobs >= 0) {
      j->req.on_logprobs = [this, raw](const token_logprobs& lp) {
        on_logprobs(*raw, lp);
      };
    }
    j->submitted = job::clock_type::now();
    queue_.push_back(j);
    ++busy_;
  }
  queue_cv_.notify_one();
}

void request_queue::cancel(const std::shared_ptr<job>& j) {
  if (j->cancelled.exchange(true)) {
    return;
  }
  {
    std::lock_guard<std::mutex> lk(queue_m_);
    cancels_.push_back(j);
  }
  queue_cv_.notify_one();
}

void request_queue::run() {
  std::map<batch_engine::request_id, std::shared_ptr<job>> live;
  std::unordered_map<const job*, batch_engine::request_id> ids;
  auto drop = [&](batch_engine::request_id rid) {
    const auto it = live.find(rid);
    ids.erase(it->second.get());
    live.erase(it);
    --busy_;
  };
  auto fail_live = [&](const request_error& e) {
    for (auto& [rid, j] : live) {
      j->fail(e);
      --busy_;
    }
    live.clear();
    ids.clear();
  };
  for (;;) {
    std::deque<std::shared_ptr<job>> incoming;
    std::vector<std::shared_ptr<job>> cancels;
    {
      std::unique_lock<std::mutex> lk(queue_m_);
      queue_cv_.wait(
          lk, [&] { return stopping_ || !queue_.empty() || !cancels_.empty() || !live.empty(); });
      if (stopping_) {
        break;
      }
      incoming.swap(queue_);
      cancels.swap(cancels_);
    }
    // Readers that left: their requests end now, waiting or running, and their fast-tier
    // reservations return before anything is admitted.
    for (const auto& j : cancels) {
      const auto it = ids.find(j.get());
      if (it == ids.end()) {
        continue;  // not in the engine yet (skipped below), or already ended
      }
      if (engine_) {
        engine_->cancel(it->second);
        engine_->forget(it->second);
      }
      ++cancelled_;
      drop(it->second);
    }
    for (auto& j : incoming) {
      if (j->cancelled) {
        ++cancelled_;
        --busy_;
        continue;
      }
      if (!engine_) {
        j->fail({500, "the engine could not be rebuilt after a failure", "", "server_error"});
        --busy_;
        continue;
      }
      try {
        const auto P = static_cast<std::uint32_t>(j->req.prompt.size());
        const batch_engine::request_id rid = engine_->submit(std::move(j->req));
        prompt_tokens_ += P;
        live[rid] = j;
        ids[j.get()] = rid;
        {
          std::lock_guard<std::mutex> lk(j->m);
          j->ph = phase::accepted;
        }
        j->notify();
      } catch (const decoder_error& e) {
        // The handler checked the context; what is left is the fast-tier budget: the prompt
        // and max_tokens together need more than all of it.
        j->fail({400, e.what(), "max_tokens", "invalid_request_error"});
        --busy_;
      }
    }
    if (!live.empty()) {
      try {
        engine_->step();
      } catch (const std::exception& e) {
        fail_live({500, std::string("the engine failed: ") + e.what(), "", "server_error"});
        engine_.reset();
        try {
          engine_ = std::make_unique<batch_engine>(m_, o_);
        } catch (const std::exception& e2) {
          std::fprintf(stderr, "mini_decoder serve: cannot rebuild the engine: %s\n", e2.what());
        }
      }
      std::vector<batch_engine::request_id> ended;
      std::vector<std::shared_ptr<job>> finished;
      for (auto& [rid, j] : live) {
        if (engine_ && engine_->done(rid)) {
          if (j->cancelled) {
            ++cancelled_;  // ended by its callback, its reader gone
          } else {
            std::lock_guard<std::mutex> lk(j->m);
            j->report = engine_->report(rid);  // its timings and drafts, for the answer
            finished.push_back(j);
          }
          engine_->forget(rid);
          ended.push_back(rid);
        }
      }
      for (const auto rid : ended) {
        drop(rid);
      }
      publish();  // before the readers hear: a client that saw its answer sees it counted
      for (const auto& j : finished) {
        finish(*j, false);
      }
    } else {
      publish();
    }
  }
  // Stopping: whatever is queued or running ends as it is, marked aborted, so that each reader
  // ends its answer (a stream with its finish and [DONE]).
  for (auto& [rid, j] : live) {
    finish(*j, true);
  }
  live.clear();
  std::deque<std::shared_ptr<job>> left;
  {
    std::lock_guard<std::mutex> lk(queue_m_);
    left.swap(queue_);
  }
  for (auto& j : left) {
    finish(*j, true);
  }
  busy_ = 0;
  publish();
}

void request_queue::stop() {
  {
    std::lock_guard<std::mutex> lk(queue_m_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
}

engine_stats request_queue::stats() const {
  std::lock_guard<std::mutex> lk(queue_m_);
  return stats_;
}

void request_queue::publish() {
  engine_stats s;
  if (engine_) {
    s.active = engine_->active();
    s.waiting = engine_->waiting();
    s.fast_bytes_reserved = engine_->fast_slots_reserved() * block_bytes_;
    s.fast_bytes = engine_->fast_slots() * block_bytes_;
    const batch_report& r = engine_->report();
    s.steps = r.steps;
    s.decode_seconds = r.decode_seconds;
    s.prefill_seconds = r.prefill_seconds;
    s.prefetch_hits = r.cache.step.hits;
    s.prefetch_misses = r.cache.step.misses;
  }
  s.prompt_tokens = prompt_tokens_;
  s.generated_tokens = generated_;
  s.cancelled = cancelled_;
  std::lock_guard<std::mutex> lk(queue_m_);
  s.waiting += queue_.size();
  stats_ = s;
}

void request_queue::finish(job& j, bool aborted) {
  {
    std::lock_guard<std::mutex> lk(j.m);
    if (j.ph == phase::done || j.ph == phase::failed) {
      return;
    }
    j.ph = phase::done;
    j.aborted = aborted;
    j.ready = j.text.size();
    j.ended = job::clock_type::now();
  }
  j.notify();
}

void request_queue::on_logprobs(job& j, const token_logprobs& lp) {
  std::lock_guard<std::mutex> lk(j.m);
  j.logprobs.push_back({lp.token, j.text.size(), lp.logprob, lp.top});
}

bool request_queue::on_token(job& j, int tok) {
  if (j.cancelled) {
    return false;  // the engine calls no more for this request
  }
  ++generated_;
  const std::string piece = m_.tok->decode(j.prev, tok);
  j.prev = tok;
  bool go_on = true;
  {
    std::lock_guard<std::mutex> lk(j.m);
    if (j.completion_tokens++ == 0) {
      j.first_token = job::clock_type::now();
    }
    const std::size_t old = j.text.size();
    j.text += piece;
    std::size_t cut = std::string::npos;
    for (const std::string& s : j.stop) {
      const std::size_t from = old >= s.size() ? old - s.size() + 1 : 0;
      cut = std::min(cut, j.text.find(s, from));
    }
    if (cut != std::string::npos) {
      j.text.resize(cut);
      j.stopped = true;
      j.ready = j.text.size();
      go_on = false;
    } else {
      j.ready = std::max(j.ready, j.text.size() - held_back(j.text, j.stop));
    }
  }
  j.notify();
  return go_on;
}

}  // namespace mini_decoder::serving
