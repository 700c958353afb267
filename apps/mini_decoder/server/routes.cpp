// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/server/routes.hpp>

#include <algorithm>
#include <ctime>
#include <exception>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include <mini_decoder/io/error.hpp>
#include <mini_decoder/server/chat.hpp>
#include <mini_decoder/server/generation.hpp>
#include <mini_decoder/server/openai.hpp>

namespace mini_decoder::serving {

namespace {

// Runs a handler body, turning what it throws into an error response: a `request_error` as it
// is, a `decoder_error` as 400, anything else as 500.
template <class F>
http_response guarded(F&& f) {
  try {
    return f();
  } catch (const request_error& e) {
    return error_response(e);
  } catch (const decoder_error& e) {
    return error_response({400, e.what(), "", "invalid_request_error"});
  } catch (const std::exception& e) {
    return error_response({500, e.what(), "", "server_error"});
  }
}

http_response json_response(const json& j, int status = 200) {
  http_response r;
  r.status = status;
  r.body = dump(j);
  return r;
}

// The most tokens /tokenize and /detokenize handle in one request.
constexpr std::size_t max_tokenize = std::size_t{1} << 20;

}  // namespace

http_response error_response(const request_error& e) {
  return json_response(error_json(e), e.status);
}

routes::routes(const model& m, const server_options& o, request_queue& queue,
               server_metrics& metrics, const http_server& http, std::string id,
               std::int64_t created, const std::atomic<bool>& stopping)
    : m_(m),
      o_(o),
      queue_(queue),
      metrics_(metrics),
      http_(http),
      id_(std::move(id)),
      created_(created),
      stopping_(stopping) {}

std::string routes::next_name(const char* prefix) {
  return std::string(prefix) + std::to_string(created_) + "-" + std::to_string(next_id_++);
}

void routes::add_to(http_server& http) {
  http.route(
      "POST", "/v1/completions",
      [this](http_request& r) { return guarded([&] { return generation(r, false); }); }, true);
  http.route(
      "POST", "/v1/chat/completions",
      [this](http_request& r) { return guarded([&] { return generation(r, true); }); }, true);
  http.route(
      "POST", "/tokenize", [this](http_request& r) { return guarded([&] { return tokenize(r); }); },
      true);
  http.route(
      "POST", "/detokenize",
      [this](http_request& r) { return guarded([&] { return detokenize(r); }); }, true);
  const json model = model_object(id_, created_);
  http.route(
      "GET", "/v1/models", [model](http_request&) { return json_response(model_list(model)); },
      false);
  http.route(
      "GET", "/v1/models/*",
      [this, model](http_request& r) {
        const std::string want = r.path.substr(std::string("/v1/models/").size());
        if (want != id_) {
          return error_response({404, "no model '" + want + "'; this server has '" + id_ + "'",
                                 "model", "invalid_request_error", "model_not_found"});
        }
        return json_response(model);
      },
      false);
  http.route(
      "GET", "/health", [this](http_request&) { return health(); }, false);
  http.route(
      "GET", "/metrics",
      [this](http_request&) {
        http_response r;
        r.content_type = "text/plain; version=0.0.4; charset=utf-8";
        r.body = metrics_.text(queue_.stats(), http_.counters(), m_.tok->cache_bytes());
        return r;
      },
      false);
}

http_response routes::health() const {
  const engine_stats s = queue_.stats();
  const bool stopping = stopping_.load();
  return json_response({{"status", stopping ? "shutting_down" : "ok"},
                        {"model", id_},
                        {"active", s.active},
                        {"waiting", s.waiting},
                        {"cancelled", s.cancelled}},
                       stopping ? 503 : 200);
}

http_response routes::generation(const http_request& req, bool chat) {
  std::string prompt_text;
  std::vector<chat_message> messages;
  const request_limits limits{id_, m_.config.vocab_size, o_.max_n};
  serving::generation g =
      parse_generation(parse_body(req.body), chat, limits, prompt_text, messages);
  if (chat) {
    try {
      prompt_text = chat_text(*m_.tok, messages);
    } catch (const decoder_error& e) {
      refuse(e.what(), "messages");
    }
  }
  const char* prompt_field = chat ? "messages" : "prompt";
  const std::uint32_t context = queue_.context();
  // At most context - 1 tokens: refused as soon as the prompt is known to be longer, without
  // tokenizing it whole (the work is bounded by the context, not by the body).
  std::optional<std::vector<int>> tokens = m_.tok->encode_at_most(prompt_text, true, context - 1);
  if (!tokens) {
    refuse("the prompt is more than " + std::to_string(context - 1) + " tokens: the context is " +
               std::to_string(context) + " tokens, with room for at least one generated token",
           prompt_field);
  }
  g.prompt = std::move(*tokens);
  const auto P = static_cast<std::uint32_t>(g.prompt.size());
  if (P == 0) {
    refuse("the prompt is empty", prompt_field);
  }
  if (!g.max_tokens) {  // chat without max_tokens
    g.max_tokens = std::min(o_.default_max_tokens, context - P);
  }
  if (std::uint64_t{P} + *g.max_tokens > context) {
    refuse("'max_tokens' = " + std::to_string(*g.max_tokens) + " with a prompt of " +
               std::to_string(P) + " tokens exceeds the context of " + std::to_string(context) +
               " tokens (at most " + std::to_string(context - P) + ")",
           "max_tokens");
  }
  const std::uint64_t seed = g.seed ? *g.seed : std::random_device{}();
  std::vector<std::shared_ptr<job>> jobs;
  for (std::uint32_t i = 0; i < g.n; ++i) {
    auto j = std::make_shared<job>();
    j->req.prompt = g.prompt;
    j->req.max_tokens = *g.max_tokens;
    j->req.temperature = g.temperature;
    j->req.ignore_eos = g.ignore_eos;
    j->req.top_p = g.top_p;
    j->req.seed = seed + i;  // choice i: the next seed, so choices differ when sampling
    j->req.sampling.top_k = g.top_k;
    j->req.sampling.presence_penalty = g.presence_penalty;
    j->req.sampling.frequency_penalty = g.frequency_penalty;
    j->req.sampling.logit_bias = g.logit_bias;
    j->req.sampling.logprobs = g.logprobs;
    j->stop = g.stop;
    j->prev = g.prompt.back();
    jobs.push_back(std::move(j));
  }
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    try {
      queue_.submit(jobs[i]);
    } catch (...) {
      for (std::size_t k = 0; k < i; ++k) {
        queue_.cancel(jobs[k]);
      }
      throw;
    }
  }
  generation_shape shape;
  shape.chat = chat;
  shape.stream = g.stream;
  shape.include_usage = g.include_usage;
  shape.id = next_name(chat ? "chatcmpl-" : "cmpl-");
  shape.model = id_;
  shape.created = static_cast<std::int64_t>(std::time(nullptr));
  shape.prompt_tokens = P;
  shape.max_tokens = *g.max_tokens;
  shape.logprobs = g.logprobs;
  const std::uint32_t max_tokens = *g.max_tokens;
  http_response r;
  r.later = make_generation_reply(std::move(jobs), std::move(shape), queue_, *m_.tok,
                                  [this, max_tokens](const std::vector<std::shared_ptr<job>>& js) {
                                    metrics_.generation(js, max_tokens);
                                  });
  return r;
}

http_response routes::tokenize(const http_request& req) {
  const json j = parse_body(req.body);
  for (const auto& [k, v] : j.items()) {
    if (k != "prompt" && k != "content" && k != "messages" && k != "model" &&
        k != "add_special_tokens" && !v.is_null()) {
      refuse("unrecognized request argument '" + k + "' for /tokenize", k);
    }
  }
  if (const auto m = j.find("model"); m != j.end() && !m->is_null() && *m != id_) {
    throw request_error{
        404, "the model '" + dump(*m) + "' does not exist; this server has '" + id_ + "'", "model",
        "invalid_request_error", "model_not_found"};
  }
  bool special = true;
  if (const auto a = j.find("add_special_tokens"); a != j.end() && !a->is_null()) {
    if (!a->is_boolean()) {
      refuse("'add_special_tokens' must be true or false", "add_special_tokens");
    }
    special = a->get<bool>();
  }
  std::string text;
  if (const auto m = j.find("messages"); m != j.end() && !m->is_null()) {
    std::string unused;
    std::vector<chat_message> messages;
    json chat_body = {{"messages", *m}};
    parse_generation(chat_body, true, {id_, m_.config.vocab_size, 1}, unused, messages);
    try {
      text = chat_text(*m_.tok, messages);
    } catch (const decoder_error& e) {
      refuse(e.what(), "messages");
    }
  } else {
    const char* name = j.contains("prompt") ? "prompt" : "content";
    const auto p = j.find(name);
    if (p == j.end() || !p->is_string()) {
      refuse("'prompt' (a string) or 'messages' is required", "prompt");
    }
    text = p->get<std::string>();
  }
  const auto tokens = m_.tok->encode_at_most(text, special, max_tokenize);
  if (!tokens) {
    refuse("the text is more than " + std::to_string(max_tokenize) + " tokens", "prompt");
  }
  return json_response(
      {{"tokens", *tokens}, {"count", tokens->size()}, {"max_model_len", queue_.context()}});
}

http_response routes::detokenize(const http_request& req) {
  const json j = parse_body(req.body);
  const auto t = j.find("tokens");
  if (t == j.end() || !t->is_array() || t->size() > max_tokenize) {
    refuse("'tokens' must be an array of at most " + std::to_string(max_tokenize) + " token ids",
           "tokens");
  }
  std::string text;
  int prev = -1;
  for (std::size_t i = 0; i < t->size(); ++i) {
    const json& x = (*t)[i];
    if (!x.is_number_integer() || x.get<std::int64_t>() < 0 ||
        x.get<std::int64_t>() >= m_.config.vocab_size) {
      refuse("'tokens[" + std::to_string(i) + "]' = " + dump(x) + " is not a token id (0 to " +
                 std::to_string(m_.config.vocab_size - 1) + ")",
             "tokens[" + std::to_string(i) + "]");
    }
    const int tok = x.get<int>();
    text += m_.tok->decode(prev, tok);
    prev = tok;
  }
  return json_response({{"prompt", text}});
}

}  // namespace mini_decoder::serving
