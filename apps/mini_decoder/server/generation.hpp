// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief A completion's answer as it comes from the engine: the `deferred_response` the HTTP
//! loop polls, for one request of `n` choices (one job each), whole or streamed as Server-Sent
//! Events, with usage and log-probabilities in OpenAI's shapes.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <mini_decoder/server/http_message.hpp>
#include <mini_decoder/server/openai.hpp>
#include <mini_decoder/server/request_queue.hpp>

namespace mini_decoder::serving {

//! What a generation's answer needs beyond its jobs.
struct generation_shape {
  bool chat = false, stream = false, include_usage = false;
  std::string id, model;  //!< the response id (chatcmpl-..., cmpl-...) and the model's name
  std::int64_t created = 0;
  std::uint32_t prompt_tokens = 0, max_tokens = 0;
  int logprobs = -1;  //!< as `generation::logprobs`
};

//! Sees a generation end, for the metrics: its jobs (ended or not) and whether it was answered.
using generation_observer = std::function<void(const std::vector<std::shared_ptr<job>>&)>;

//! The answer to a request of `jobs.size()` choices, all submitted. Whole: waits until every
//! choice ends, then 200 with each choice's text, `finish_reason` (`stop`, `length`) and
//! `logprobs`, and the usage; a choice the engine refused, or that failed, makes it that error;
//! one cut by the server stopping makes it 503. Streamed: once the engine accepted every choice,
//! 200 and a chunk per piece of text of any choice as it becomes final (chat: a role chunk per
//! choice first), a chunk with each choice's `finish_reason` (`abort` when the server stopped),
//! the usage chunk (`include_usage`), then `data: [DONE]`; a choice that fails mid-stream sends
//! its error event and the stream ends with `data: [DONE]`. `cancel` (the client left) cancels
//! every choice's job.
std::shared_ptr<deferred_response> make_generation_reply(std::vector<std::shared_ptr<job>> jobs,
                                                         generation_shape shape,
                                                         request_queue& queue, const tokenizer& tok,
                                                         generation_observer on_end);

}  // namespace mini_decoder::serving
