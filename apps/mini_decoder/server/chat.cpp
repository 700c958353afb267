// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/server/chat.hpp>

#include <mini_decoder/io/error.hpp>

namespace mini_decoder {

namespace {

constexpr const char* im_start = "<|im_start|>";
constexpr const char* im_end = "<|im_end|>";

}  // namespace

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

}  // namespace mini_decoder
