// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief A request the server refuses or fails, as the HTTP status and OpenAI-style error it
//! answers with (openai.hpp `error_json`).
#pragma once

#include <string>
#include <utility>

namespace mini_decoder::serving {

//! HTTP `status` with an OpenAI-style error body.
struct request_error {
  int status = 400;
  std::string message;
  std::string param;  // the offending field; empty: none
  std::string type = "invalid_request_error";
};

//! Refuses the request being read: HTTP 400 naming the offending field `param`.
[[noreturn]] inline void refuse(std::string message, std::string param = {}) {
  throw request_error{400, std::move(message), std::move(param)};
}

}  // namespace mini_decoder::serving
