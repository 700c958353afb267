// SPDX-License-Identifier: Apache-2.0
// What the mini-decoder's test files share: the models they load once per process and the
// message of a call's error.
#pragma once

#include <doctest/doctest.h>

#include <exception>
#include <filesystem>
#include <memory>
#include <string>

#include "model.hpp"

namespace mini_decoder::test {

inline const std::string smollm2_path =
    std::string(MINI_DECODER_MODELS) + "/SmolLM2-135M-Instruct.Q4_1.gguf";

//! SmolLM2-135M-Instruct (GGUF Q4_1), loaded once for the whole test binary. Tests never
//! download: without the file the calling case fails, naming the command that fetches it.
inline const model& smollm2() {
  static const std::unique_ptr<model> m =
      std::filesystem::exists(smollm2_path) ? load_model(smollm2_path) : std::unique_ptr<model>();
  REQUIRE_MESSAGE(m != nullptr, "SmolLM2 model not found at "
                                    << smollm2_path
                                    << ": fetch it with scripts/fetch-models.sh (scripts/test.sh "
                                       "does)");
  return *m;
}

//! The message of the exception `f()` throws, or "(no error)".
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace mini_decoder::test
