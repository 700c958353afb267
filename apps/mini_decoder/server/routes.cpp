// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/server/routes.hpp>

#include <algorithm>
#include <ctime>
#include <memory>
#include <mutex>
#include <random>
#include <utility>
#include <vector>

#include <mini_decoder/io/error.hpp>
#include <mini_decoder/server/chat.hpp>
#include <mini_decoder/server/http.hpp>
#include <mini_decoder/server/openai.hpp>

namespace mini_decoder::serving {

routes::routes(const model& m, const server_options& o, request_queue& queue, shared_tokenizer& tok,
               std::string id, std::int64_t created)
    : m_(m), o_(o), queue_(queue), tok_(tok), id_(std::move(id)), created_(created) {}

std::string routes::next_name(const char* prefix) {
  return std::string(prefix) + std::to_string(created_) + "-" + std::to_string(next_id_++);
}

void routes::add_to(httplib::Server& http) {
  http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    guarded(res, [&] { generation(req, res, false); });
  });
  http.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    guarded(res, [&] { generation(req, res, true); });
  });
  const json model = model_object(id_, created_);
  http.Get("/v1/models", [model](const httplib::Request&, httplib::Response& res) {
    res.set_content(dump(model_list(model)), "application/json");
  });
  http.Get(
      R"(/v1/models/(.+))", [this, model](const httplib::Request& req, httplib::Response& res) {
        if (req.matches[1] != id_) {
          send_error(res,
                     {404, "no model '" + req.matches[1].str() + "'; this server has '" + id_ + "'",
                      "model", "invalid_request_error"});
          return;
        }
        res.set_content(dump(model), "application/json");
      });
  http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    const json body = {{"status", "ok"},
                       {"model", id_},
                       {"active", queue_.active()},
                       {"waiting", queue_.waiting()},
                       {"cancelled", queue_.cancelled()}};
    res.set_content(dump(body), "application/json");
  });
}

void routes::generation(const httplib::Request& req, httplib::Response& res, bool chat) {
  std::string prompt_text;
  std::vector<chat_message> messages;
  serving::generation g = parse_generation(parse_body(req.body), chat, prompt_text, messages);
  if (chat) {
    try {
      prompt_text = chat_text(*m_.tok, messages);
    } catch (const decoder_error& e) {
      refuse(e.what(), "messages");
    }
  }
  g.prompt = tok_.encode(prompt_text, true);
  const auto P = static_cast<std::uint32_t>(g.prompt.size());
  const std::uint32_t context = queue_.context();
  if (P == 0) {
    refuse("the prompt is empty", chat ? "messages" : "prompt");
  }
  if (P >= context) {
    refuse("the prompt is " + std::to_string(P) + " tokens, the context " +
               std::to_string(context) + ": no room for a completion",
           chat ? "messages" : "prompt");
  }
  if (!g.max_tokens) {  // chat without max_tokens
    g.max_tokens = std::min(o_.default_max_tokens, context - P);
  }
  if (std::uint64_t{P} + *g.max_tokens > context) {
    refuse("the prompt (" + std::to_string(P) + " tokens) + max_tokens (" +
               std::to_string(*g.max_tokens) + ") exceeds the context of " +
               std::to_string(context) + " tokens",
           "max_tokens");
  }

  auto j = std::make_shared<job>();
  j->req.prompt = g.prompt;
  j->req.max_tokens = *g.max_tokens;
  j->req.temperature = g.temperature;
  j->req.ignore_eos = g.ignore_eos;
  j->req.top_p = g.top_p;
  j->req.seed = g.seed ? *g.seed : std::random_device{}();
  j->stop = g.stop;
  j->prev = g.prompt.back();
  queue_.submit(j);

  const std::string name = next_name(chat ? "chatcmpl-" : "cmpl-");
  const auto now = static_cast<std::int64_t>(std::time(nullptr));
  const std::uint32_t max_tokens = *g.max_tokens;
  auto finish_reason = [max_tokens](const job& x) {
    return !x.stopped && x.completion_tokens >= max_tokens ? "length" : "stop";
  };
  auto usage = [P](const job& x) {
    return usage_json(P, x.completion_tokens);
  };
  // The engine's per-request stats (an extension, as llama.cpp's server has): waiting, time to
  // first token, inter-token latency percentiles, drafts.
  auto timings = [](const job& x) {
    const request_report& r = x.report;
    const latency_summary t = r.inter_token();
    return json{
        {"queue_seconds", r.admitted_seconds},
        {"first_token_seconds", r.first_token_seconds},
        {"inter_token_seconds", {{"p50", t.p50}, {"p90", t.p90}, {"p99", t.p99}, {"max", t.max}}},
        {"drafted", r.drafted},
        {"accepted", r.accepted}};
  };

  if (!g.stream) {
    std::unique_lock<std::mutex> lk(j->m);
    j->cv.wait(lk, [&] { return j->ph == phase::done || j->ph == phase::failed; });
    if (j->ph == phase::failed) {
      throw j->error;
    }
    json body = response_base(name, chat ? "chat.completion" : "text_completion", now, id_);
    body["choices"] = json::array({answer_choice(chat, j->text, finish_reason(*j))});
    body["usage"] = usage(*j);
    body["timings"] = timings(*j);
    res.set_content(dump(body), "application/json");
    return;
  }

  // Streaming: one event per piece of text as the engine produces it.
  const bool include_usage = g.include_usage;
  const json chunk_base =
      response_base(name, chat ? "chat.completion.chunk" : "text_completion", now, id_);
  event_stream ev;
  if (chat) {
    ev.opening = sse_event(role_chunk(chunk_base));
  }
  ev.piece = [chunk_base, chat](const std::string& text) {
    return sse_event(stream_chunk(chunk_base, chat, text, nullptr));
  };
  ev.end = [chunk_base, chat, include_usage, finish_reason, usage, timings](const job& x) {
    std::string out = sse_event(stream_chunk(chunk_base, chat, "", finish_reason(x)));
    if (include_usage) {
      json u = usage_chunk(chunk_base, usage(x));
      u["timings"] = timings(x);
      out += sse_event(u);
    }
    return out + sse_done;
  };
  ev.error = [](const request_error& e) {
    return sse_event(error_json(e));
  };
  stream_events(res, j, std::move(ev));
}

}  // namespace mini_decoder::serving
