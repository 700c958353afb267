// SPDX-License-Identifier: Apache-2.0
// The models the mini-decoder's test files load once per process.
#pragma once

#include <doctest/doctest.h>

#include <filesystem>
#include <memory>
#include <string>

#include <mini_decoder/model/model.hpp>

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

}  // namespace mini_decoder::test
