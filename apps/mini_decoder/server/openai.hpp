// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief OpenAI's API as JSON: completion and chat completion requests read and checked, the
//! shapes of responses, streamed chunks and errors. No HTTP here (http.hpp) and no engine.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
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
  std::uint32_t top_k = 0;  // an extension (as vLLM's): 0 all
  float presence_penalty = 0.0f, frequency_penalty = 0.0f;
  std::vector<std::pair<int, float>> logit_bias;
  std::optional<std::uint64_t> seed;
  std::vector<std::string> stop;
  std::uint32_t n = 1;  // choices
  //! Log-probabilities: -1 none; k >= 0 each token's and the k most likely (completions:
  //! `logprobs: k`; chat: `logprobs: true` with `top_logprobs: k`).
  int logprobs = -1;
};

//! What checking a request needs to know of the server.
struct request_limits {
  std::string model_id;     //!< the served model: `model` must be it (or absent)
  std::uint32_t vocab = 0;  //!< token ids (logit_bias) are below it
  std::uint32_t max_n = 8;  //!< the most choices (`n`) a request may ask for
};

//! The request body as a JSON object; refuses (`request_error`, HTTP 400) anything else,
//! naming the offset and the offending text of malformed JSON (a number out of range too).
json parse_body(const std::string& body);

//! Reads and checks a request's fields: `messages` into `messages` (`chat`) or `prompt` into
//! `prompt_text`, `model`, then the sampling fields (`max_tokens`, a completion's default 16;
//! `n`, `temperature`, `top_p`, `top_k`, the penalties, `logit_bias`, `logprobs` and
//! `top_logprobs`, `seed`, `stop`), `stream`, `stream_options`, `ignore_eos`. Refuses the first
//! bad one with HTTP 400 naming it and its value: a wrong type, a number out of OpenAI's range,
//! a field this server does not implement (`tools`, `response_format` other than text,
//! `best_of` other than `n`, `suffix`, `echo`, ...) or does not know; a `model` other than the
//! served one with 404 (`model_not_found`, as OpenAI).
generation parse_generation(const json& j, bool chat, const request_limits& limits,
                            std::string& prompt_text, std::vector<chat_message>& messages);

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
//! One choice of a whole answer: `message` (chat) or `text`, its `finish_reason` and
//! `logprobs` (null, or `logprobs_json`'s).
json answer_choice(bool chat, std::uint32_t index, const std::string& text,
                   const char* finish_reason, const json& logprobs = nullptr);

//! One streamed chunk after `chunk_base`: new `text` of choice `index` (chat: as
//! `delta.content`), and the `finish_reason` in its last one (null before it; the last chunk's
//! chat delta is empty), with the log-probabilities of the tokens in `text`.
json stream_chunk(const json& chunk_base, bool chat, std::uint32_t index, const std::string& text,
                  const json& finish, const json& logprobs = nullptr);
//! A chat stream's first chunk for choice `index`: the assistant's role, no content yet.
json role_chunk(const json& chunk_base, std::uint32_t index);

//! One generated token's log-probabilities, where its text begins in the answer.
struct token_logprob {
  int token = -1;
  std::size_t offset = 0;  //!< bytes of the answer before this token's text
  float logprob = 0.0f;
  std::vector<std::pair<int, float>> top;  //!< the most likely tokens, most likely first
};
//! The `logprobs` of a choice for `tokens`: completions `{tokens, token_logprobs,
//! top_logprobs, text_offset}`; chat `{content: [{token, logprob, bytes, top_logprobs}]}`.
//! `text_of` gives a token's text (its bytes); `top` how many alternatives to list.
json logprobs_json(bool chat, const std::vector<token_logprob>& tokens, int top,
                   const std::function<std::string(int)>& text_of);
//! The chunk after the last (`stream_options.include_usage`): no choices, the usage.
json usage_chunk(const json& chunk_base, const json& usage);
//! One Server-Sent Event of a stream: `data: {json}` and a blank line.
std::string sse_event(const json& x);
//! The event that ends every stream.
inline constexpr const char* sse_done = "data: [DONE]\n\n";

}  // namespace mini_decoder::serving
