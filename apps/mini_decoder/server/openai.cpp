// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/server/openai.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>

namespace mini_decoder::serving {

std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

json error_json(const request_error& e) {
  return {{"error",
           {{"message", e.message},
            {"type", e.type},
            {"param", e.param.empty() ? json(nullptr) : json(e.param)},
            {"code", e.code.empty() ? json(nullptr) : json(e.code)}}}};
}

// --- requests -----------------------------------------------------------------------------------

namespace {

const json* field(const json& body, const char* name) {
  const auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

// A value as it appears in a message: short, whatever it is.
std::string shown(const json& v) {
  std::string s = dump(v);
  if (s.size() > 60) {
    s = s.substr(0, 57) + "...";
  }
  return s;
}

[[noreturn]] void refuse_value(const std::string& name, const json& v, const std::string& want) {
  refuse("'" + name + "' = " + shown(v) + " " + want, name);
}

// A number in [lo, hi] (each bound inclusive unless `open_lo`), as a float that holds it.
float number_field(const json& body, const char* name, float fallback, double lo, double hi,
                   bool open_lo = false) {
  const json* f = field(body, name);
  if (f == nullptr) {
    return fallback;
  }
  if (!f->is_number()) {
    refuse_value(name, *f, "must be a number");
  }
  const double v = f->get<double>();
  if (!std::isfinite(v) || (open_lo ? v <= lo : v < lo) || v > hi) {
    refuse_value(name, *f,
                 std::string("must be in ") + (open_lo ? "(" : "[") + dump(json(lo)) + ", " +
                     dump(json(hi)) + "]");
  }
  return static_cast<float>(v);
}

// An integer in [lo, hi]; a float with an integral value is not one (as OpenAI's API).
std::int64_t integer_field(const json& f, const std::string& name, std::int64_t lo, std::int64_t hi,
                           const std::string& range) {
  if (!f.is_number_integer()) {
    refuse_value(name, f, "must be an integer");
  }
  if (f.is_number_unsigned() && f.get<std::uint64_t>() > static_cast<std::uint64_t>(hi)) {
    refuse_value(name, f, range);
  }
  const std::int64_t v = f.is_number_unsigned() ? static_cast<std::int64_t>(f.get<std::uint64_t>())
                                                : f.get<std::int64_t>();
  if (v < lo || v > hi) {
    refuse_value(name, f, range);
  }
  return v;
}

bool bool_field(const json& body, const char* name) {
  const json* f = field(body, name);
  if (f == nullptr) {
    return false;
  }
  if (!f->is_boolean()) {
    refuse_value(name, *f, "must be true or false");
  }
  return f->get<bool>();
}

std::optional<std::uint32_t> max_tokens_field(const json& body, const char* name) {
  const json* f = field(body, name);
  if (f == nullptr) {
    return std::nullopt;
  }
  // The context decides the real bound (routes.cpp); here: a positive integer that a 32-bit
  // count holds, the rest named as too large.
  if (f->is_number_integer() && !f->is_number_unsigned() && f->get<std::int64_t>() <= 0) {
    refuse_value(name, *f, "must be at least 1");
  }
  return static_cast<std::uint32_t>(
      integer_field(*f, name, 1, std::int64_t{1} << 30, "is more than any context"));
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
    for (std::size_t i = 0; i < c.size(); ++i) {
      const json& part = c[i];
      const std::string at = param + "[" + std::to_string(i) + "]";
      if (!part.is_object()) {
        refuse_value(at, part, "must be an object {\"type\": \"text\", \"text\": string}");
      }
      const json* type = field(part, "type");
      if (type == nullptr || !type->is_string()) {
        refuse("'" + at + ".type' must be a string", at + ".type");
      }
      if (type->get<std::string>() != "text") {
        refuse("'" + at + ".type' = " + shown(*type) +
                   ": only text parts are supported (no images, audio or files)",
               at + ".type");
      }
      const json* text = field(part, "text");
      if (text == nullptr || !text->is_string()) {
        refuse("'" + at + ".text' must be a string", at + ".text");
      }
      s += text->get<std::string>();
    }
    return s;
  }
  refuse_value(param, c, "must be a string or an array of text parts");
}

// Fields a request may carry. Some are accepted as no-ops in their default value only: a
// request that asks for what they do elsewhere is refused, never silently served without it
// (`refuse_unsupported`). Any other field is refused, as OpenAI's API does.
struct field_rule {
  const char* name;
  bool completions, chat;
};
constexpr field_rule fields[] = {
    {"model", true, true},
    {"prompt", true, false},
    {"messages", false, true},
    {"max_tokens", true, true},
    {"max_completion_tokens", false, true},
    {"temperature", true, true},
    {"top_p", true, true},
    {"top_k", true, true},
    {"n", true, true},
    {"stream", true, true},
    {"stream_options", true, true},
    {"stop", true, true},
    {"presence_penalty", true, true},
    {"frequency_penalty", true, true},
    {"logit_bias", true, true},
    {"logprobs", true, true},
    {"top_logprobs", false, true},
    {"seed", true, true},
    {"user", true, true},
    {"ignore_eos", true, true},
    {"echo", true, false},
    {"suffix", true, false},
    {"best_of", true, false},
    {"response_format", false, true},
    {"tools", false, true},
    {"tool_choice", false, true},
    {"parallel_tool_calls", false, true},
    {"functions", false, true},
    {"function_call", false, true},
    {"store", false, true},
    {"metadata", false, true},
    {"modalities", false, true},
    {"audio", false, true},
    {"prediction", false, true},
    {"reasoning_effort", false, true},
    {"service_tier", true, true},
    {"web_search_options", false, true},
};

[[noreturn]] void not_supported(const std::string& name, const std::string& what) {
  refuse("'" + name + "' is not supported by this server: " + what, name);
}

// The fields this server does not implement, refused unless they ask for nothing.
void refuse_unsupported(const json& j, std::uint32_t n) {
  if (const json* f = field(j, "echo"); f != nullptr && !(f->is_boolean() && !f->get<bool>())) {
    not_supported("echo", "the answer never repeats the prompt");
  }
  if (const json* f = field(j, "suffix");
      f != nullptr && !(f->is_string() && f->get<std::string>().empty())) {
    not_supported("suffix", "no insertion (fill-in-the-middle)");
  }
  if (const json* f = field(j, "best_of"); f != nullptr && !(f->is_number_integer() && *f == n)) {
    not_supported("best_of", "no server-side choice among several; use 'n'");
  }
  if (const json* f = field(j, "response_format"); f != nullptr) {
    if (!f->is_object() || !f->contains("type") || (*f)["type"] != "text") {
      not_supported("response_format", "only {\"type\": \"text\"}: no JSON mode or schema");
    }
  }
  if (const json* f = field(j, "tools"); f != nullptr && !(f->is_array() && f->empty())) {
    not_supported("tools", "no tool or function calling");
  }
  if (const json* f = field(j, "tool_choice"); f != nullptr && *f != "none") {
    not_supported("tool_choice", "no tool or function calling (only \"none\")");
  }
  if (const json* f = field(j, "parallel_tool_calls"); f != nullptr && !f->is_boolean()) {
    refuse_value("parallel_tool_calls", *f, "must be true or false");
  }
  for (const char* name : {"functions", "function_call", "audio", "prediction", "reasoning_effort",
                           "web_search_options"}) {
    if (field(j, name) != nullptr) {
      not_supported(name, "this server generates text alone");
    }
  }
  if (const json* f = field(j, "store"); f != nullptr && *f != false) {
    not_supported("store", "answers are not stored");
  }
  if (const json* f = field(j, "metadata"); f != nullptr && !f->is_object()) {
    refuse_value("metadata", *f, "must be an object");
  }
  if (const json* f = field(j, "modalities"); f != nullptr && *f != json::array({"text"})) {
    not_supported("modalities", "only [\"text\"]");
  }
  if (const json* f = field(j, "service_tier"); f != nullptr && *f != "auto" && *f != "default") {
    not_supported("service_tier", "one tier (\"auto\" or \"default\")");
  }
  if (const json* f = field(j, "user"); f != nullptr && !f->is_string()) {
    refuse_value("user", *f, "must be a string");
  }
}

}  // namespace

json parse_body(const std::string& body) {
  json j;
  try {
    j = json::parse(body);
  } catch (const json::exception& e) {  // parse errors, and numbers out of range (1e400)
    refuse(std::string("the body is not valid JSON: ") + e.what());
  }
  if (!j.is_object()) {
    refuse("the body must be a JSON object");
  }
  return j;
}

generation parse_generation(const json& j, bool chat, const request_limits& limits,
                            std::string& prompt_text, std::vector<chat_message>& messages) {
  generation g;
  g.chat = chat;
  for (const auto& [name, value] : j.items()) {
    bool ok = false;
    for (const field_rule& r : fields) {
      if (name == r.name) {
        ok = chat ? r.chat : r.completions;
        break;
      }
    }
    if (!ok && !value.is_null()) {
      refuse("unrecognized request argument '" + name + "' for " +
                 (chat ? "/v1/chat/completions" : "/v1/completions"),
             name);
    }
  }
  if (const json* m = field(j, "model"); m != nullptr) {
    if (!m->is_string()) {
      refuse_value("model", *m, "must be a string");
    }
    if (m->get<std::string>() != limits.model_id) {
      throw request_error{404,
                          "the model '" + m->get<std::string>() +
                              "' does not exist; this server has '" + limits.model_id + "'",
                          "model", "invalid_request_error", "model_not_found"};
    }
  }
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
      for (const auto& [k, v] : msg.items()) {
        if (k != "role" && k != "content" && k != "name" && !v.is_null()) {
          refuse("'" + at + "." + k + "' is not supported (no tool calls or refusals)",
                 at + "." + k);
        }
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
      refuse_value("prompt", *p, "must be a string (or a list of one string)");
    }
    g.max_tokens = max_tokens_field(j, "max_tokens");
    if (!g.max_tokens) {
      g.max_tokens = 16;  // OpenAI's default for completions
    }
  }
  if (const json* n = field(j, "n"); n != nullptr) {
    g.n = static_cast<std::uint32_t>(integer_field(
        *n, "n", 1, limits.max_n,
        "must be in [1, " + std::to_string(limits.max_n) + "] (this server's --max-n)"));
  }
  refuse_unsupported(j, g.n);
  g.temperature = number_field(j, "temperature", 1.0f, 0.0, 2.0);
  g.top_p = number_field(j, "top_p", 1.0f, 0.0, 1.0, true);
  if (const json* k = field(j, "top_k"); k != nullptr) {
    const std::int64_t v =
        integer_field(*k, "top_k", -1, std::int64_t{1} << 31, "must be -1, 0 (all) or more");
    g.top_k = v <= 0 ? 0 : static_cast<std::uint32_t>(std::min<std::int64_t>(v, limits.vocab));
  }
  g.presence_penalty = number_field(j, "presence_penalty", 0.0f, -2.0, 2.0);
  g.frequency_penalty = number_field(j, "frequency_penalty", 0.0f, -2.0, 2.0);
  if (const json* b = field(j, "logit_bias"); b != nullptr) {
    if (!b->is_object() || b->size() > 300) {
      refuse_value("logit_bias", *b,
                   "must be an object of at most 300 {\"token id\": bias in [-100, 100]}");
    }
    for (const auto& [key, value] : b->items()) {
      const std::string at = "logit_bias." + key;
      char* end = nullptr;
      const long long id = std::strtoll(key.c_str(), &end, 10);
      if (key.empty() || end != key.c_str() + key.size() || id < 0 ||
          static_cast<unsigned long long>(id) >= limits.vocab) {
        refuse("'logit_bias' key '" + key + "' is not a token id (0 to " +
                   std::to_string(limits.vocab - 1) + ")",
               "logit_bias");
      }
      if (!value.is_number() || !std::isfinite(value.get<double>()) || value.get<double>() < -100 ||
          value.get<double>() > 100) {
        refuse_value(at, value, "must be a number in [-100, 100]");
      }
      g.logit_bias.emplace_back(static_cast<int>(id), value.get<float>());
    }
  }
  if (const json* l = field(j, "logprobs"); l != nullptr) {
    if (chat) {
      if (!l->is_boolean()) {
        refuse_value("logprobs", *l, "must be true or false");
      }
      g.logprobs = l->get<bool>() ? 0 : -1;
    } else {
      g.logprobs = static_cast<int>(integer_field(*l, "logprobs", 0, 20, "must be in [0, 20]"));
    }
  }
  if (const json* t = field(j, "top_logprobs"); t != nullptr) {
    const auto k = static_cast<int>(integer_field(*t, "top_logprobs", 0, 20, "must be in [0, 20]"));
    if (g.logprobs < 0) {
      refuse("'top_logprobs' needs 'logprobs': true", "top_logprobs");
    }
    g.logprobs = k;
  }
  if (const json* s = field(j, "seed"); s != nullptr) {
    if (!s->is_number_integer()) {
      refuse_value("seed", *s, "must be an integer");
    }
    g.seed = s->is_number_unsigned() ? s->get<std::uint64_t>()
                                     : static_cast<std::uint64_t>(s->get<std::int64_t>());
  }
  g.stream = bool_field(j, "stream");
  g.ignore_eos = bool_field(j, "ignore_eos");
  if (const json* so = field(j, "stream_options"); so != nullptr) {
    if (!so->is_object()) {
      refuse_value("stream_options", *so, "must be an object");
    }
    for (const auto& [k, v] : so->items()) {
      if (k != "include_usage" && !v.is_null()) {
        refuse("'stream_options." + k + "' is not supported", "stream_options." + k);
      }
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
    for (const std::string& x : g.stop) {
      if (x.size() > 1024) {
        refuse("a 'stop' string is " + std::to_string(x.size()) + " bytes; at most 1024", "stop");
      }
    }
    std::erase_if(g.stop, [](const std::string& x) { return x.empty(); });
  }
  return g;
}

// --- responses ----------------------------------------------------------------------------------

json response_base(const std::string& id, const char* object, std::int64_t created,
                   const std::string& model) {
  return json{{"id", id}, {"object", object}, {"created", created}, {"model", model}};
}

json model_object(const std::string& id, std::int64_t created) {
  return {{"id", id}, {"object", "model"}, {"created", created}, {"owned_by", "oasiskv"}};
}

json model_list(const json& model) {
  return {{"object", "list"}, {"data", json::array({model})}};
}

json usage_json(std::uint32_t prompt_tokens, std::uint32_t completion_tokens) {
  return json{{"prompt_tokens", prompt_tokens},
              {"completion_tokens", completion_tokens},
              {"total_tokens", prompt_tokens + completion_tokens}};
}

json answer_choice(bool chat, std::uint32_t index, const std::string& text,
                   const char* finish_reason, const json& logprobs) {
  json choice = {{"index", index}, {"logprobs", logprobs}, {"finish_reason", finish_reason}};
  if (chat) {
    choice["message"] = {{"role", "assistant"}, {"content", text}};
  } else {
    choice["text"] = text;
  }
  return choice;
}

json stream_chunk(const json& chunk_base, bool chat, std::uint32_t index, const std::string& text,
                  const json& finish, const json& logprobs) {
  json c = chunk_base;
  json choice = {{"index", index}, {"logprobs", logprobs}, {"finish_reason", finish}};
  if (chat) {
    choice["delta"] = text.empty() && !finish.is_null() ? json::object() : json{{"content", text}};
  } else {
    choice["text"] = text;
  }
  c["choices"] = json::array({choice});
  return c;
}

json role_chunk(const json& chunk_base, std::uint32_t index) {
  json c = chunk_base;
  c["choices"] = json::array({{{"index", index},
                               {"delta", {{"role", "assistant"}, {"content", ""}}},
                               {"logprobs", nullptr},
                               {"finish_reason", nullptr}}});
  return c;
}

json logprobs_json(bool chat, const std::vector<token_logprob>& tokens, int top,
                   const std::function<std::string(int)>& text_of) {
  const auto bytes_of = [](const std::string& s) {
    json b = json::array();
    for (const char c : s) {
      b.push_back(static_cast<unsigned char>(c));
    }
    return b;
  };
  if (chat) {
    json content = json::array();
    for (const token_logprob& t : tokens) {
      const std::string s = text_of(t.token);
      json alternatives = json::array();
      for (std::size_t k = 0; k < t.top.size() && k < static_cast<std::size_t>(top); ++k) {
        const std::string a = text_of(t.top[k].first);
        alternatives.push_back(
            {{"token", a}, {"logprob", t.top[k].second}, {"bytes", bytes_of(a)}});
      }
      content.push_back({{"token", s},
                         {"logprob", t.logprob},
                         {"bytes", bytes_of(s)},
                         {"top_logprobs", alternatives}});
    }
    return {{"content", content}};
  }
  json toks = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
  for (const token_logprob& t : tokens) {
    toks.push_back(text_of(t.token));
    lps.push_back(t.logprob);
    offsets.push_back(t.offset);
    if (top > 0) {
      json alternatives = json::object();
      for (std::size_t k = 0; k < t.top.size() && k < static_cast<std::size_t>(top); ++k) {
        alternatives[text_of(t.top[k].first)] = t.top[k].second;
      }
      tops.push_back(alternatives);
    } else {
      tops.push_back(nullptr);
    }
  }
  return {
      {"tokens", toks}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

json usage_chunk(const json& chunk_base, const json& usage) {
  json u = chunk_base;
  u["choices"] = json::array();
  u["usage"] = usage;
  return u;
}

std::string sse_event(const json& x) {
  return "data: " + dump(x) + "\n\n";
}

}  // namespace mini_decoder::serving
