// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The engine's one error type for bad input, and the helper that raises it.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace mini_decoder {

//! Every bad input (missing or corrupt model, bad flag, prompt too long) raises this; its message
//! is one line that says what is wrong and, where it helps, what to do.
class decoder_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <class... Args>
[[noreturn]] void fail(Args&&... args) {
  std::ostringstream s;
  (s << ... << std::forward<Args>(args));
  throw decoder_error(s.str());
}

//! The hint appended to every "model missing or unreadable" error.
inline constexpr const char* fetch_hint =
    "; fetch SmolLM2 with scripts/fetch-models.sh (into ./models/), or use the tiny model the "
    "repository ships: tests/data/stories260K/stories260K.bin";

}  // namespace mini_decoder
