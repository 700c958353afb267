// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/server/request_queue.hpp>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <map>
#include <utility>

#include <mini_decoder/io/error.hpp>

namespace mini_decoder::serving {

void job::fail(request_error e) {
  {
    std::lock_guard<std::mutex> lk(m);
    if (ph == phase::done || ph == phase::failed) {
      return;
    }
    ph = phase::failed;
    error = std::move(e);
  }
  cv.notify_all();
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

std::vector<int> shared_tokenizer::encode(const std::string& text, bool add_bos) {
  std::lock_guard<std::mutex> lk(m_);
  return t_.encode(text, add_bos);
}

std::string shared_tokenizer::decode(int prev, int token) {
  std::lock_guard<std::mutex> lk(m_);
  return t_.decode(prev, token);
}

request_queue::request_queue(const model& m, const batch_options& o, shared_tokenizer& tok)
    : m_(m), o_(o), tok_(tok), engine_(std::make_unique<batch_engine>(m_, o_)) {
  context_ = engine_->context();
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
    queue_.push_back(j);
  }
  queue_cv_.notify_one();
  std::unique_lock<std::mutex> lk(j->m);
  j->cv.wait(lk, [&] { return j->ph != phase::queued; });
  if (j->ph == phase::failed) {
    throw j->error;
  }
}

void request_queue::run() {
  std::map<batch_engine::request_id, std::shared_ptr<job>> live;
  auto fail_live = [&](const request_error& e) {
    for (auto& [rid, j] : live) {
      j->fail(e);
    }
    live.clear();
  };
  for (;;) {
    std::deque<std::shared_ptr<job>> incoming;
    {
      std::unique_lock<std::mutex> lk(queue_m_);
      queue_cv_.wait(lk, [&] { return stopping_ || !queue_.empty() || !live.empty(); });
      if (stopping_) {
        break;
      }
      incoming.swap(queue_);
    }
    for (auto& j : incoming) {
      if (!engine_) {
        j->fail({500, "the engine could not be rebuilt after a failure", "", "server_error"});
        continue;
      }
      try {
        const batch_engine::request_id rid = engine_->submit(std::move(j->req));
        live[rid] = j;
        {
          std::lock_guard<std::mutex> lk(j->m);
          j->ph = phase::accepted;
        }
        j->cv.notify_all();
      } catch (const decoder_error& e) {
        j->fail({400, e.what(), "", "invalid_request_error"});
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
      for (auto it = live.begin(); it != live.end();) {
        if (engine_ && engine_->done(it->first)) {
          finish(*it->second, engine_->report(it->first));
          engine_->forget(it->first);
          it = live.erase(it);
        } else {
          ++it;
        }
      }
    }
    active_ = engine_ ? engine_->active() : 0;
    waiting_ = engine_ ? engine_->waiting() : 0;
  }
  const request_error down{503, "the server is shutting down", "", "server_error"};
  fail_live(down);
  std::lock_guard<std::mutex> lk(queue_m_);
  for (auto& j : queue_) {
    j->fail(down);
  }
  queue_.clear();
}

void request_queue::stop() {
  {
    std::lock_guard<std::mutex> lk(queue_m_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
}

void request_queue::finish(job& j, const request_report& r) {
  {
    std::lock_guard<std::mutex> lk(j.m);
    j.report = r;
    j.ph = phase::done;
    j.ready = j.text.size();
  }
  j.cv.notify_all();
}

bool request_queue::on_token(job& j, int tok) {
  if (j.cancelled) {
    ++cancelled_;  // the engine calls no more for this request
    return false;
  }
  const std::string piece = tok_.decode(j.prev, tok);
  j.prev = tok;
  bool go_on = true;
  {
    std::lock_guard<std::mutex> lk(j.m);
    ++j.completion_tokens;
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
  j.cv.notify_all();
  return go_on;
}

}  // namespace mini_decoder::serving
