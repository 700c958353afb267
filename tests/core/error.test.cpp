// SPDX-License-Identifier: Apache-2.0
#include <doctest/doctest.h>

#include <string>
#include <system_error>

#include "oasiskv/core/error.hpp"

TEST_CASE("oasiskv::error carries its code and a prefixed message") {
  try {
    oasiskv::detail::raise(oasiskv::errc::invalid_slot, "slot ", 42u, " of ", 8, " slots");
    FAIL("raise returned");
  } catch (const oasiskv::error& e) {
    CHECK(e.code() == oasiskv::errc::invalid_slot);
    CHECK(std::string(e.what()) == "oasiskv: slot 42 of 8 slots");
    const std::error_code ec = e.error_code();
    CHECK(ec == oasiskv::errc::invalid_slot);
    CHECK(std::string(ec.category().name()) == "oasiskv");
    CHECK(ec.message() == "invalid_slot");
  }
  // small integer types print as numbers, not characters
  try {
    oasiskv::detail::raise(oasiskv::errc::invalid_argument, "v = ", std::uint8_t{7});
    FAIL("raise returned");
  } catch (const oasiskv::error& e) {
    CHECK(std::string(e.what()) == "oasiskv: v = 7");
  }
  CHECK(oasiskv::to_string(oasiskv::errc::transfer_failed) == "transfer_failed");
}
