// SPDX-License-Identifier: Apache-2.0
// mini_decoder serve: the HTTP layer (cpp-httplib, nlohmann::json) and the engine thread.
#include <mini_decoder/server/server.hpp>

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <thread>
#include <utility>

#include <mini_decoder/io/error.hpp>

namespace mini_decoder {

namespace {

using json = nlohmann::json;

constexpr const char* im_start = "<|im_start|>";
constexpr const char* im_end = "<|im_end|>";

// A request the server refuses: HTTP `status` with an OpenAI-style error body.
struct request_error {
  int status = 400;
  std::string message;
  std::string param;  // the offending field; empty: none
  std::string type = "invalid_request_error";
};

[[noreturn]] void refuse(std::string message, std::string param = {}) {
  throw request_error{400, std::move(message), std::move(param)};
}

json error_json(const request_error& e) {
  return {{"error",
           {{"message", e.message},
            {"type", e.type},
            {"param", e.param.empty() ? json(nullptr) : json(e.param)},
            {"code", nullptr}}}};
}

// JSON text; invalid UTF-8 (a token cut inside a character) becomes U+FFFD, never an exception.
std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

void send_error(httplib::Response& res, const request_error& e) {
  res.status = e.status;
  res.set_content(dump(error_json(e)), "application/json");
}

// How a finished request ended.
enum class phase : std::uint8_t { queued, accepted, done, failed };

// One request as the engine thread and its handler share it.
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
  bool stopped = false;  // a stop string matched
  std::atomic<bool> cancelled{false};

  void fail(request_error e) {
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
};

// Bytes at the end of `s` that might still become a stop string, or an unfinished UTF-8
// character: they wait for the next token.
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

// --- request parsing --------------------------------------------------------------------------

struct generation {
  bool chat = false;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  bool ignore_eos = false;     // an extension (as vLLM's): generate past the end token
  std::vector<int> prompt;
  std::optional<std::uint32_t> max_tokens;
  float temperature = 1.0f, top_p = 1.0f;
  std::optional<std::uint64_t> seed;
  std::vector<std::string> stop;
};

const json* field(const json& body, const char* name) {
  const auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

float number_field(const json& body, const char* name, float fallback) {
  const json* f = field(body, name);
  if (f == nullptr) {
    return fallback;
  }
  if (!f->is_number()) {
    refuse(std::string("'") + name + "' must be a number", name);
  }
  const double v = f->get<double>();
  if (!std::isfinite(v)) {
    refuse(std::string("'") + name + "' must be finite", name);
  }
  return static_cast<float>(v);
}

bool bool_field(const json& body, const char* name) {
  const json* f = field(body, name);
  if (f == nullptr) {
    return false;
  }
  if (!f->is_boolean()) {
    refuse(std::string("'") + name + "' must be true or false", name);
  }
  return f->get<bool>();
}

std::optional<std::uint32_t> max_tokens_field(const json& body, const char* name) {
  const json* f = field(body, name);
  if (f == nullptr) {
    return std::nullopt;
  }
  if (!f->is_number_integer()) {
    refuse(std::string("'") + name + "' must be an integer", name);
  }
  const std::int64_t v = f->get<std::int64_t>();
  if (v <= 0 || v > (std::int64_t{1} << 24)) {
    refuse(std::string("'") + name + "' = " + std::to_string(v) + " must be at least 1", name);
  }
  return static_cast<std::uint32_t>(v);
}

// A message's content: a string, null, or an array of {"type": "text", "text": ...} parts.
std::string content_of(const json& c, const std::string& param) {
  if (c.is_null()) {
    return {};
  }
  if (c.is_string()) {
    return c.get<std::string>();
  }
  if (c.is_array()) {
    std::string s;
    for (const json& part : c) {
      if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
          !part["text"].is_string()) {
        refuse("'" + param + "' parts must be {\"type\": \"text\", \"text\": string}", param);
      }
      s += part["text"].get<std::string>();
    }
    return s;
  }
  refuse("'" + param + "' must be a string", param);
}

json parse_body(const std::string& body) {
  json j;
  try {
    j = json::parse(body);
  } catch (const json::parse_error& e) {
    refuse(std::string("the body is not valid JSON: ") + e.what());
  }
  if (!j.is_object()) {
    refuse("the body must be a JSON object");
  }
  return j;
}

// Everything but the prompt's tokens, which need the tokenizer.
generation parse_generation(const json& j, bool chat, std::string& prompt_text,
                            std::vector<chat_message>& messages) {
  generation g;
  g.chat = chat;
  if (chat) {
    const json* m = field(j, "messages");
    if (m == nullptr) {
      refuse("'messages' is required", "messages");
    }
    if (!m->is_array() || m->empty()) {
      refuse("'messages' must be a non-empty array", "messages");
    }
    for (std::size_t i = 0; i < m->size(); ++i) {
      const json& msg = (*m)[i];
      const std::string at = "messages[" + std::to_string(i) + "]";
      if (!msg.is_object()) {
        refuse("'" + at + "' must be an object", at);
      }
      const auto role = msg.find("role");
      if (role == msg.end() || !role->is_string()) {
        refuse("'" + at + ".role' must be a string", at + ".role");
      }
      const std::string r = role->get<std::string>();
      if (r != "system" && r != "user" && r != "assistant") {
        refuse("'" + at + ".role' = '" + r + "' is not one of system, user, assistant",
               at + ".role");
      }
      const auto content = msg.find("content");
      messages.push_back(
          {r, content == msg.end() ? std::string() : content_of(*content, at + ".content")});
    }
    g.max_tokens = max_tokens_field(j, "max_completion_tokens");
    if (!g.max_tokens) {
      g.max_tokens = max_tokens_field(j, "max_tokens");
    }
  } else {
    const json* p = field(j, "prompt");
    if (p == nullptr) {
      refuse("'prompt' is required", "prompt");
    }
    if (p->is_array() && p->size() == 1 && (*p)[0].is_string()) {
      prompt_text = (*p)[0].get<std::string>();
    } else if (p->is_string()) {
      prompt_text = p->get<std::string>();
    } else {
      refuse("'prompt' must be a string", "prompt");
    }
    g.max_tokens = max_tokens_field(j, "max_tokens");
    if (!g.max_tokens) {
      g.max_tokens = 16;  // OpenAI's default for completions
    }
  }
  if (const json* n = field(j, "n"); n != nullptr && !(n->is_number_integer() && *n == 1)) {
    refuse("only 'n' = 1 is supported", "n");
  }
  g.temperature = number_field(j, "temperature", 1.0f);
  if (g.temperature < 0.0f) {
    refuse("'temperature' must be >= 0", "temperature");
  }
  g.top_p = number_field(j, "top_p", 1.0f);
  if (!(g.top_p > 0.0f && g.top_p <= 1.0f)) {
    refuse("'top_p' must be in (0, 1]", "top_p");
  }
  if (const json* s = field(j, "seed"); s != nullptr) {
    if (!s->is_number_integer()) {
      refuse("'seed' must be an integer", "seed");
    }
    g.seed = s->is_number_unsigned() ? s->get<std::uint64_t>()
                                     : static_cast<std::uint64_t>(s->get<std::int64_t>());
  }
  g.stream = bool_field(j, "stream");
  g.ignore_eos = bool_field(j, "ignore_eos");
  if (const json* so = field(j, "stream_options"); so != nullptr) {
    if (!so->is_object()) {
      refuse("'stream_options' must be an object", "stream_options");
    }
    g.include_usage = bool_field(*so, "include_usage");
  }
  if (const json* s = field(j, "stop"); s != nullptr) {
    if (s->is_string()) {
      g.stop.push_back(s->get<std::string>());
    } else if (s->is_array() && s->size() <= 16) {
      for (const json& x : *s) {
        if (!x.is_string()) {
          refuse("'stop' must be a string or an array of strings", "stop");
        }
        g.stop.push_back(x.get<std::string>());
      }
    } else {
      refuse("'stop' must be a string or an array of at most 16 strings", "stop");
    }
    std::erase_if(g.stop, [](const std::string& x) { return x.empty(); });
  }
  return g;
}

std::string stem_of(const std::string& path) {
  return std::filesystem::path(path).stem().string();
}

}  // namespace

// --- chat template ----------------------------------------------------------------------------

std::string chat_text(const tokenizer& tok, const std::vector<chat_message>& messages) {
  for (const chat_message& m : messages) {
    if (m.role != "system" && m.role != "user" && m.role != "assistant") {
      fail("chat message role '", m.role, "' is not one of system, user, assistant");
    }
  }
  std::string empty_chat;
  try {
    empty_chat = tok.chat_prompt("");
  } catch (const decoder_error&) {  // no template: the contents, one per line
    std::string s;
    for (std::size_t i = 0; i < messages.size(); ++i) {
      s += (i ? "\n" : "") + messages[i].content;
    }
    return s;
  }
  // The tokenizer's template for one empty user message is `<system block>` + the user turn
  // + the assistant's opening: the system block is what comes before the user turn.
  const std::string user_turn = std::string(im_start) + "user\n" + im_end + "\n";
  const std::size_t at = empty_chat.rfind(user_turn);
  if (at == std::string::npos) {
    fail("the tokenizer's chat template is not ChatML");
  }
  const std::string default_system = empty_chat.substr(0, at);
  const std::string assistant_open = empty_chat.substr(at + user_turn.size());
  std::string s;
  if (messages.empty() || messages.front().role != "system") {
    s += default_system;
  }
  for (const chat_message& m : messages) {
    s += std::string(im_start) + m.role + "\n" + m.content + im_end + "\n";
  }
  return s + assistant_open;
}

// --- the server -------------------------------------------------------------------------------

struct server::impl {
  impl(const model& mod, server_options opt)
      : m(mod), o(std::move(opt)), engine(std::make_unique<batch_engine>(m, o.engine)) {
    context = engine->context();
    id = o.model_id.empty() ? stem_of(m.path) : o.model_id;
    created = static_cast<std::int64_t>(std::time(nullptr));
  }

  const model& m;
  server_options o;
  std::unique_ptr<batch_engine> engine;  // owned by the engine thread once started
  std::uint32_t context = 0;
  std::string id;
  std::int64_t created = 0;
  int bound_port = 0;

  httplib::Server http;
  std::thread http_thread, engine_thread;
  bool started = false, stopped = false;

  std::mutex tok_m;  // the tokenizer caches what it encodes: one caller at a time

  std::mutex queue_m;  // guards queue and stopping
  std::condition_variable queue_cv;
  std::deque<std::shared_ptr<job>> queue;
  bool stopping = false;
  std::atomic<std::uint64_t> next_id{1};
  std::atomic<std::size_t> active_count{0}, waiting_count{0};
  std::atomic<std::uint64_t> cancelled_count{0};  // requests ended by their client leaving

  std::string next_name(const char* prefix) {
    return std::string(prefix) + std::to_string(created) + "-" + std::to_string(next_id++);
  }

  // --- engine thread ---
  void engine_loop() {
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
        std::unique_lock<std::mutex> lk(queue_m);
        queue_cv.wait(lk, [&] { return stopping || !queue.empty() || !live.empty(); });
        if (stopping) {
          break;
        }
        incoming.swap(queue);
      }
      for (auto& j : incoming) {
        if (!engine) {
          j->fail({500, "the engine could not be rebuilt after a failure", "", "server_error"});
          continue;
        }
        try {
          const batch_engine::request_id rid = engine->submit(std::move(j->req));
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
          engine->step();
        } catch (const std::exception& e) {
          fail_live({500, std::string("the engine failed: ") + e.what(), "", "server_error"});
          engine.reset();
          try {
            engine = std::make_unique<batch_engine>(m, o.engine);
          } catch (const std::exception& e2) {
            std::fprintf(stderr, "mini_decoder serve: cannot rebuild the engine: %s\n", e2.what());
          }
        }
        for (auto it = live.begin(); it != live.end();) {
          if (engine && engine->done(it->first)) {
            finish(*it->second);
            engine->forget(it->first);
            it = live.erase(it);
          } else {
            ++it;
          }
        }
      }
      active_count = engine ? engine->active() : 0;
      waiting_count = engine ? engine->waiting() : 0;
    }
    const request_error down{503, "the server is shutting down", "", "server_error"};
    fail_live(down);
    std::lock_guard<std::mutex> lk(queue_m);
    for (auto& j : queue) {
      j->fail(down);
    }
    queue.clear();
  }

  static void finish(job& j) {
    {
      std::lock_guard<std::mutex> lk(j.m);
      j.ph = phase::done;
      j.ready = j.text.size();
    }
    j.cv.notify_all();
  }

  // The per-token callback (engine thread): detokenize, cut at a stop string, wake the handler.
  bool on_token(job& j, int tok) {
    if (j.cancelled) {
      ++cancelled_count;  // the engine calls no more for this request
      return false;
    }
    std::string piece;
    {
      std::lock_guard<std::mutex> lk(tok_m);
      piece = m.tok->decode(j.prev, tok);
    }
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

  // --- handlers ---
  // Queues `j`, waits until the engine accepts or refuses it; throws `request_error` if refused.
  void submit(const std::shared_ptr<job>& j) {
    {
      std::lock_guard<std::mutex> lk(queue_m);
      if (stopping) {
        throw request_error{503, "the server is shutting down", "", "server_error"};
      }
      queue.push_back(j);
    }
    queue_cv.notify_one();
    std::unique_lock<std::mutex> lk(j->m);
    j->cv.wait(lk, [&] { return j->ph != phase::queued; });
    if (j->ph == phase::failed) {
      throw j->error;
    }
  }

  void handle_generation(const httplib::Request& req, httplib::Response& res, bool chat) {
    std::string prompt_text;
    std::vector<chat_message> messages;
    generation g = parse_generation(parse_body(req.body), chat, prompt_text, messages);
    if (chat) {
      try {
        prompt_text = chat_text(*m.tok, messages);
      } catch (const decoder_error& e) {
        refuse(e.what(), "messages");
      }
    }
    {
      std::lock_guard<std::mutex> lk(tok_m);
      g.prompt = m.tok->encode(prompt_text, true);
    }
    const auto P = static_cast<std::uint32_t>(g.prompt.size());
    if (P == 0) {
      refuse("the prompt is empty", chat ? "messages" : "prompt");
    }
    if (P >= context) {
      refuse("the prompt is " + std::to_string(P) + " tokens, the context " +
                 std::to_string(context) + ": no room for a completion",
             chat ? "messages" : "prompt");
    }
    if (!g.max_tokens) {  // chat without max_tokens
      g.max_tokens = std::min(o.default_max_tokens, context - P);
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
    job* raw = j.get();  // the engine's record lives no longer than `live` holds `j`
    j->req.on_token = [this, raw](int t) {
      return on_token(*raw, t);
    };
    submit(j);

    const std::string name = next_name(chat ? "chatcmpl-" : "cmpl-");
    const auto now = static_cast<std::int64_t>(std::time(nullptr));
    const std::uint32_t max_tokens = *g.max_tokens;
    auto finish_reason = [max_tokens](const job& x) {
      return !x.stopped && x.completion_tokens >= max_tokens ? "length" : "stop";
    };
    auto usage = [P](const job& x) {
      return json{{"prompt_tokens", P},
                  {"completion_tokens", x.completion_tokens},
                  {"total_tokens", P + x.completion_tokens}};
    };
    auto base = [&](const char* object) {
      return json{{"id", name}, {"object", object}, {"created", now}, {"model", id}};
    };

    if (!g.stream) {
      std::unique_lock<std::mutex> lk(j->m);
      j->cv.wait(lk, [&] { return j->ph == phase::done || j->ph == phase::failed; });
      if (j->ph == phase::failed) {
        throw j->error;
      }
      json body = base(chat ? "chat.completion" : "text_completion");
      json choice = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", finish_reason(*j)}};
      if (chat) {
        choice["message"] = {{"role", "assistant"}, {"content", j->text}};
      } else {
        choice["text"] = j->text;
      }
      body["choices"] = json::array({choice});
      body["usage"] = usage(*j);
      res.set_content(dump(body), "application/json");
      return;
    }

    // Streaming: one event per piece of text as the engine produces it.
    struct stream_state {
      std::size_t sent = 0;
      bool opened = false;  // chat: the role delta went out
    };
    auto st = std::make_shared<stream_state>();
    const bool include_usage = g.include_usage;
    const json chunk_base = base(chat ? "chat.completion.chunk" : "text_completion");
    auto event = [](const json& x) {
      return "data: " + dump(x) + "\n\n";
    };
    auto chunk = [chunk_base, chat](const std::string& text, const json& finish) {
      json c = chunk_base;
      json choice = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", finish}};
      if (chat) {
        choice["delta"] =
            text.empty() && !finish.is_null() ? json::object() : json{{"content", text}};
      } else {
        choice["text"] = text;
      }
      c["choices"] = json::array({choice});
      return c;
    };
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [j, st, chat, include_usage, chunk_base, event, chunk, finish_reason, usage](
            std::size_t, httplib::DataSink& sink) {
          auto write = [&](const std::string& s) {
            if (!sink.write(s.data(), s.size())) {
              j->cancelled = true;  // the client went away: the engine ends this request
              return false;
            }
            return true;
          };
          if (chat && !st->opened) {
            st->opened = true;
            json c = chunk_base;
            c["choices"] = json::array({{{"index", 0},
                                         {"delta", {{"role", "assistant"}, {"content", ""}}},
                                         {"logprobs", nullptr},
                                         {"finish_reason", nullptr}}});
            return write(event(c));
          }
          std::unique_lock<std::mutex> lk(j->m);
          // Bounded wait: the HTTP library calls again (and notices a stopping server).
          j->cv.wait_for(lk, std::chrono::milliseconds(200), [&] {
            return j->ready > st->sent || j->ph == phase::done || j->ph == phase::failed;
          });
          if (j->ph == phase::failed) {
            const std::string e = "data: " + dump(error_json(j->error)) + "\n\n";
            lk.unlock();
            write(e);
            sink.done();
            return true;
          }
          const bool done = j->ph == phase::done;
          std::string out;
          if (j->ready > st->sent) {
            out += event(chunk(j->text.substr(st->sent, j->ready - st->sent), nullptr));
            st->sent = j->ready;
          }
          if (done) {
            out += event(chunk("", finish_reason(*j)));
            if (include_usage) {
              json u = chunk_base;
              u["choices"] = json::array();
              u["usage"] = usage(*j);
              out += event(u);
            }
            out += "data: [DONE]\n\n";
          }
          lk.unlock();
          if (!out.empty() && !write(out)) {
            return false;
          }
          if (done) {
            sink.done();
          }
          return true;
        },
        [j](bool success) {
          if (!success) {
            j->cancelled = true;
          }
        });
  }

  // Runs a handler body, turning a refusal into its JSON error.
  template <class F>
  void guarded(httplib::Response& res, F&& f) {
    try {
      f();
    } catch (const request_error& e) {
      send_error(res, e);
    } catch (const decoder_error& e) {
      send_error(res, {400, e.what(), "", "invalid_request_error"});
    } catch (const std::exception& e) {
      send_error(res, {500, e.what(), "", "server_error"});
    }
  }

  void routes() {
    http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
      guarded(res, [&] { handle_generation(req, res, false); });
    });
    http.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
      guarded(res, [&] { handle_generation(req, res, true); });
    });
    const json model_object = {
        {"id", id}, {"object", "model"}, {"created", created}, {"owned_by", "oasiskv"}};
    http.Get("/v1/models", [model_object](const httplib::Request&, httplib::Response& res) {
      const json body = {{"object", "list"}, {"data", json::array({model_object})}};
      res.set_content(dump(body), "application/json");
    });
    http.Get(R"(/v1/models/(.+))", [this, model_object](const httplib::Request& req,
                                                        httplib::Response& res) {
      if (req.matches[1] != id) {
        send_error(res,
                   {404, "no model '" + req.matches[1].str() + "'; this server has '" + id + "'",
                    "model", "invalid_request_error"});
        return;
      }
      res.set_content(dump(model_object), "application/json");
    });
    http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      const json body = {{"status", "ok"},
                         {"model", id},
                         {"active", active_count.load()},
                         {"waiting", waiting_count.load()},
                         {"cancelled", cancelled_count.load()}};
      res.set_content(dump(body), "application/json");
    });
    // Anything else (unknown path or method, a failure with no body): an OpenAI-style error.
    http.set_error_handler(httplib::Server::HandlerWithResponse(
        [](const httplib::Request& req, httplib::Response& res) {
          if (!res.body.empty()) {
            return httplib::Server::HandlerResponse::Unhandled;
          }
          request_error e{res.status, "", "", "invalid_request_error"};
          e.message = res.status == 404 ? "unknown endpoint: " + req.method + " " + req.path
                                        : "request failed with HTTP " + std::to_string(res.status);
          send_error(res, e);
          return httplib::Server::HandlerResponse::Handled;
        }));
    http.set_exception_handler(
        [](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
          send_error(res, {500, "internal server error", "", "server_error"});
        });
    if (o.log_requests) {
      http.set_logger([](const httplib::Request& req, const httplib::Response& res) {
        std::fprintf(stderr, "%s %s -> %d\n", req.method.c_str(), req.path.c_str(), res.status);
      });
    }
    const unsigned threads = std::max(2u, o.http_threads);
    http.new_task_queue = [threads] {
      return new httplib::ThreadPool(threads);
    };
    http.set_payload_max_length(std::size_t{16} << 20);
  }
};

server::server(const model& m, server_options o) : p_(std::make_unique<impl>(m, std::move(o))) {}

server::~server() {
  stop();
}

int server::start() {
  impl& s = *p_;
  if (s.started) {
    fail("server: start called twice");
  }
  s.routes();
  int port = s.o.port;
  if (port == 0) {
    port = s.http.bind_to_any_port(s.o.host);
    if (port <= 0) {
      fail("server: cannot bind ", s.o.host, " to a free port");
    }
  } else if (!s.http.bind_to_port(s.o.host, port)) {
    fail("server: cannot bind ", s.o.host, ":", port, " (in use, or not an address of this host)");
  }
  s.bound_port = port;
  s.started = true;
  s.engine_thread = std::thread([&s] { s.engine_loop(); });
  s.http_thread = std::thread([&s] { s.http.listen_after_bind(); });
  return port;
}

void server::stop() {
  impl& s = *p_;
  if (!s.started || s.stopped) {
    return;
  }
  s.stopped = true;
  {
    std::lock_guard<std::mutex> lk(s.queue_m);
    s.stopping = true;
  }
  s.queue_cv.notify_all();
  s.engine_thread.join();  // fails what is queued or running: every waiting handler returns
  s.http.stop();
  s.http_thread.join();
}

int server::port() const {
  return p_->bound_port;
}

const std::string& server::model_id() const {
  return p_->id;
}

}  // namespace mini_decoder
