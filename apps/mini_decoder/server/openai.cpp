// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/server/openai.hpp>

#include <cmath>

namespace mini_decoder::serving {

std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

json error_json(const request_error& e) {
  return {{"error",
           {{"message", e.message},
            {"type", e.type},
            {"param", e.param.empty() ? json(nullptr) : json(e.param)},
            {"code", nullptr}}}};
}

// --- requests -----------------------------------------------------------------------------------

namespace {

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

}  // namespace

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

json answer_choice(bool chat, const std::string& text, const char* finish_reason) {
  json choice = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", finish_reason}};
  if (chat) {
    choice["message"] = {{"role", "assistant"}, {"content", text}};
  } else {
    choice["text"] = text;
  }
  return choice;
}

json stream_chunk(const json& chunk_base, bool chat, const std::string& text, const json& finish) {
  json c = chunk_base;
  json choice = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", finish}};
  if (chat) {
    choice["delta"] = text.empty() && !finish.is_null() ? json::object() : json{{"content", text}};
  } else {
    choice["text"] = text;
  }
  c["choices"] = json::array({choice});
  return c;
}

json role_chunk(const json& chunk_base) {
  json c = chunk_base;
  c["choices"] = json::array({{{"index", 0},
                               {"delta", {{"role", "assistant"}, {"content", ""}}},
                               {"logprobs", nullptr},
                               {"finish_reason", nullptr}}});
  return c;
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
