// SPDX-License-Identifier: Apache-2.0
// What the mini-decoder's test files share: the message of a call's error. (The models they
// load once per process: models.hpp.)
#pragma once

#include <exception>
#include <string>

namespace mini_decoder::test {

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
