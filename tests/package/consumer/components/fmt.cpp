// SPDX-License-Identifier: Apache-2.0
// oasiskv::fmt: the formatters of the library's types, linked against fmt.
#include <fmt/core.h>

#include <oasiskv/fmt/formatters.hpp>

int main() {
  fmt::print("fmt: {} {}\n", oasiskv::dtype::f16, oasiskv::errc::double_free);
  return 0;
}
