// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/server/generation.hpp>

#include <algorithm>
#include <mutex>
#include <utility>

namespace mini_decoder::serving {

namespace {

const char* finish_reason(const job& j, std::uint32_t max_tokens) {
  if (j.aborted) {
    return "abort";  // as vLLM: the server stopped before the answer ended
  }
  return !j.stopped && j.completion_tokens >= max_tokens ? "length" : "stop";
}

// The engine's per-request stats (an extension, as llama.cpp's server has): waiting, time to
// first token, inter-token latency percentiles, drafts. Given for a single choice.
json timings_json(const request_report& r) {
  const latency_summary t = r.inter_token();
  return json{
      {"queue_seconds", r.admitted_seconds},
      {"first_token_seconds", r.first_token_seconds},
      {"inter_token_seconds", {{"p50", t.p50}, {"p90", t.p90}, {"p99", t.p99}, {"max", t.max}}},
      {"drafted", r.drafted},
      {"accepted", r.accepted}};
}

class generation_reply final : public deferred_response {
 public:
  generation_reply(std::vector<std::shared_ptr<job>> jobs, generation_shape shape,
                   request_queue& queue, const tokenizer& tok, generation_observer on_end)
      : jobs_(std::move(jobs)),
        s_(std::move(shape)),
        queue_(queue),
        tok_(tok),
        on_end_(std::move(on_end)),
        sent_(jobs_.size(), 0),
        logprobs_sent_(jobs_.size(), 0),
        finished_(jobs_.size(), false) {
    base_ = response_base(
        s_.id,
        s_.chat ? (s_.stream ? "chat.completion.chunk" : "chat.completion") : "text_completion",
        s_.created, s_.model);
  }

  void attach(std::function<void()> wake) override {
    for (auto& j : jobs_) {
      j->set_wake(wake);
    }
  }

  void cancel() override {
    if (ended_) {
      return;
    }
    for (auto& j : jobs_) {
      queue_.cancel(j);
    }
    end();
  }

  void poll(response_sink& out) override {
    if (ended_) {
      return;
    }
    if (s_.stream) {
      poll_stream(out);
    } else {
      poll_whole(out);
    }
  }

 private:
  std::string text_of(int token) const { return tok_.decode(-1, token); }

  json logprobs_of(job& j, std::size_t i, std::size_t upto) {
    // The tokens whose text begins before `upto` (the text sent so far), not sent yet.
    std::vector<token_logprob> some;
    while (logprobs_sent_[i] < j.logprobs.size() && j.logprobs[logprobs_sent_[i]].offset < upto) {
      some.push_back(j.logprobs[logprobs_sent_[i]++]);
    }
    return logprobs_json(s_.chat, some, s_.logprobs, [this](int t) { return text_of(t); });
  }

  void poll_whole(response_sink& out) {
    // Every choice must have ended before anything is read from any.
    for (auto& jp : jobs_) {
      std::unique_lock<std::mutex> lk(jp->m);
      if (jp->ph == phase::failed) {
        const request_error e = jp->error;
        lk.unlock();
        respond_error(out, e);
        return;
      }
      if (jp->ph != phase::done) {
        return;  // polled again when it changes
      }
      if (jp->aborted) {
        lk.unlock();
        respond_error(
            out, {503, "the server shut down before the answer was complete", "", "server_error"});
        return;
      }
    }
    json choices = json::array();
    std::uint32_t completion = 0;
    for (std::size_t i = 0; i < jobs_.size(); ++i) {
      job& j = *jobs_[i];
      std::lock_guard<std::mutex> lk(j.m);
      json lp = nullptr;
      if (s_.logprobs >= 0) {
        lp = logprobs_of(j, i, j.text.size());
      }
      choices.push_back(answer_choice(s_.chat, static_cast<std::uint32_t>(i), j.text,
                                      finish_reason(j, s_.max_tokens), lp));
      completion += j.completion_tokens;
    }
    json body = base_;
    body["choices"] = choices;
    body["usage"] = usage_json(s_.prompt_tokens, completion);
    if (jobs_.size() == 1) {
      std::lock_guard<std::mutex> lk(jobs_[0]->m);
      body["timings"] = timings_json(jobs_[0]->report);
    }
    http_response r;
    r.body = dump(body);
    end();
    out.respond(std::move(r));
  }

  void respond_error(response_sink& out, const request_error& e) {
    http_response r;
    r.status = e.status;
    r.body = dump(error_json(e));
    for (auto& j : jobs_) {  // the others are of no use to anyone now
      queue_.cancel(j);
    }
    end();
    out.respond(std::move(r));
  }

  void poll_stream(response_sink& out) {
    if (!started_) {
      // The engine must accept every choice first: its refusal is a plain 400, not a stream.
      for (auto& jp : jobs_) {
        std::unique_lock<std::mutex> lk(jp->m);
        if (jp->ph == phase::failed) {
          const request_error e = jp->error;
          lk.unlock();
          respond_error(out, e);
          return;
        }
        if (jp->ph == phase::queued) {
          return;
        }
      }
      started_ = true;
      out.start_stream(200, "text/event-stream",
                       {{"Cache-Control", "no-cache"}, {"X-Accel-Buffering", "no"}});
      if (s_.chat) {
        for (std::size_t i = 0; i < jobs_.size(); ++i) {
          out.send(sse_event(role_chunk(base_, static_cast<std::uint32_t>(i))));
        }
      }
    }
    std::string events;
    std::size_t done = 0;
    std::uint32_t completion = 0;
    for (std::size_t i = 0; i < jobs_.size(); ++i) {
      job& j = *jobs_[i];
      if (finished_[i]) {
        ++done;
        std::lock_guard<std::mutex> lk(j.m);
        completion += j.completion_tokens;
        continue;
      }
      if (out.room() == 0) {
        break;  // the client reads slowly: polled again as it does
      }
      std::lock_guard<std::mutex> lk(j.m);
      if (j.ph == phase::failed) {
        events += sse_event(error_json(j.error));
        finished_[i] = true;
        failed_ = true;
        ++done;
        continue;
      }
      const auto index = static_cast<std::uint32_t>(i);
      if (j.ready > sent_[i]) {
        json lp = nullptr;
        if (s_.logprobs >= 0) {
          lp = logprobs_of(j, i, j.ready);
        }
        events += sse_event(stream_chunk(base_, s_.chat, index,
                                         j.text.substr(sent_[i], j.ready - sent_[i]), nullptr, lp));
        sent_[i] = j.ready;
      }
      if (j.ph == phase::done) {
        events += sse_event(
            stream_chunk(base_, s_.chat, index, "", finish_reason(j, s_.max_tokens), nullptr));
        finished_[i] = true;
        completion += j.completion_tokens;
        ++done;
      }
    }
    if (!events.empty()) {
      out.send(events);
    }
    if (done == jobs_.size()) {
      if (s_.include_usage && !failed_) {
        json u = base_;
        u["choices"] = json::array();
        u["usage"] = usage_json(s_.prompt_tokens, completion);
        if (jobs_.size() == 1) {
          std::lock_guard<std::mutex> lk(jobs_[0]->m);
          u["timings"] = timings_json(jobs_[0]->report);
        }
        out.send(sse_event(u));
      }
      out.send(sse_done);
      end();
      out.end_stream();
    }
  }

  void end() {
    if (ended_) {
      return;
    }
    ended_ = true;
    for (auto& j : jobs_) {
      j->set_wake(nullptr);
    }
    if (on_end_) {
      on_end_(jobs_);
    }
  }

  std::vector<std::shared_ptr<job>> jobs_;
  generation_shape s_;
  request_queue& queue_;
  const tokenizer& tok_;
  generation_observer on_end_;
  json base_;
  std::vector<std::size_t> sent_, logprobs_sent_;
  std::vector<bool> finished_;
  bool started_ = false, ended_ = false, failed_ = false;
};

}  // namespace

std::shared_ptr<deferred_response> make_generation_reply(std::vector<std::shared_ptr<job>> jobs,
                                                         generation_shape shape,
                                                         request_queue& queue, const tokenizer& tok,
                                                         generation_observer on_end) {
  return std::make_shared<generation_reply>(std::move(jobs), std::move(shape), queue, tok,
                                            std::move(on_end));
}

}  // namespace mini_decoder::serving
