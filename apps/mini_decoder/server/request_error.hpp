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
  request_error() = default;
  request_error(int s, std::string m, std::string p = {}, std::string t = "invalid_request_error",
                std::string c = {})
      : status(s),
        message(std::move(m)),
        param(std::move(p)),
        type(std::move(t)),
        code(std::move(c)) {}

  int status = 400;
  std::string message;
  std::string param;  // the offending field; empty: none
  std::string type = "invalid_request_error";
  std::string code;  // OpenAI's error code (invalid_api_key, model_not_found); empty: null
};

//! Refuses the request being read: HTTP 400 naming the offending field `param`.
[[noreturn]] inline void refuse(std::string message, std::string param = {}) {
  throw request_error{400, std::move(message), std::move(param)};
}

}  // namespace mini_decoder::serving
