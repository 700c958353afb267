// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief OpenAI's API as JSON: completion and chat completion requests read and checked, the
//! shapes of responses, streamed chunks and errors. No HTTP here (http.hpp) and no engine.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include <mini_decoder/server/chat.hpp>
#include <mini_decoder/server/request_error.hpp>

namespace mini_decoder::serving {

using json = nlohmann::json;

//! JSON text; invalid UTF-8 (a token cut inside a character) becomes U+FFFD, never an exception.
std::string dump(const json& j);
//! `{"error": {"message", "type", "param", "code": null}}`.
json error_json(const request_error& e);

// --- requests -----------------------------------------------------------------------------------

//! A completion or chat completion request: everything but the prompt's tokens, which need the
//! tokenizer.
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

//! The request body as a JSON object; refuses (`request_error`, HTTP 400) anything else.
json parse_body(const std::string& body);

//! Reads and checks a request's fields: `messages` into `messages` (`chat`) or `prompt` into
//! `prompt_text`, then `max_tokens` (a completion's default: 16), `n`, `temperature`, `top_p`,
//! `seed`, `stream`, `ignore_eos`, `stream_options`, `stop`. Refuses the first bad one, naming
//! it.
generation parse_generation(const json& j, bool chat, std::string& prompt_text,
                            std::vector<chat_message>& messages);

// --- responses ----------------------------------------------------------------------------------

//! What every response object starts with: `id`, `object`, `created`, `model`.
json response_base(const std::string& id, const char* object, std::int64_t created,
                   const std::string& model);
//! The one model a server has, as `/v1/models/{id}` answers.
json model_object(const std::string& id, std::int64_t created);
//! `/v1/models`: the list of the one model.
json model_list(const json& model);
//! `usage`: prompt, completion and total tokens.
json usage_json(std::uint32_t prompt_tokens, std::uint32_t completion_tokens);
//! The one choice of a whole answer: `message` (chat) or `text`, with its `finish_reason`.
json answer_choice(bool chat, const std::string& text, const char* finish_reason);

//! One streamed chunk after `chunk_base`: new `text` (chat: as `delta.content`), and the
//! `finish_reason` in the last one (null before it; the last chunk's chat delta is empty).
json stream_chunk(const json& chunk_base, bool chat, const std::string& text, const json& finish);
//! A chat stream's first chunk: the assistant's role, no content yet.
json role_chunk(const json& chunk_base);
//! The chunk after the last (`stream_options.include_usage`): no choices, the usage.
json usage_chunk(const json& chunk_base, const json& usage);
//! One Server-Sent Event of a stream: `data: {json}` and a blank line.
std::string sse_event(const json& x);
//! The event that ends every stream.
inline constexpr const char* sse_done = "data: [DONE]\n\n";

}  // namespace mini_decoder::serving
