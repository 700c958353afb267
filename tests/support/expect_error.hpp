// SPDX-License-Identifier: Apache-2.0
//! The one way the tests check bad input: `f()` must throw `oasiskv::error` with `code`, and its
//! message must contain `needle` (the offending value it names).
#pragma once

#include <doctest/doctest.h>

#include <string>

#include "oasiskv/core/error.hpp"

namespace oasiskv::testing {

template <class F>
void expect_error(F&& f, errc code, const std::string& needle) {
  try {
    f();
    FAIL("expected oasiskv::error " << oasiskv::to_string(code));
  } catch (const oasiskv::error& e) {
    CHECK(e.code() == code);
    INFO(std::string(e.what()));
    CHECK(std::string(e.what()).find(needle) != std::string::npos);
  }
}

}  // namespace oasiskv::testing
