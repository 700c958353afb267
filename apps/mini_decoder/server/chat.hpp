// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief A chat's messages as one prompt, in the model's chat template.
#pragma once

#include <string>
#include <vector>

#include <mini_decoder/tokenizer/tokenizer.hpp>

namespace mini_decoder {

//! One chat message.
struct chat_message {
  std::string role;  //!< system, user or assistant
  std::string content;
};

//! The prompt text of a chat: with a ChatML template (the tokenizer's `chat_prompt` works), each
//! message as `<|im_start|>role\ncontent<|im_end|>\n` after the tokenizer's own system message
//! when the chat starts without one, then `<|im_start|>assistant\n`; one user message gives
//! exactly `chat_prompt(content)`. Without a template (llama2.c models) the contents joined by
//! newlines. Throws `decoder_error` for a role other than system, user or assistant.
std::string chat_text(const tokenizer& tok, const std::vector<chat_message>& messages);

}  // namespace mini_decoder
