// SPDX-License-Identifier: Apache-2.0
#include <doctest/doctest.h>

#include <fmt/format.h>

#include "oasiskv/fmt/formatters.hpp"

TEST_CASE("fmt formatters print the vocabulary types") {
  const oasiskv::kv_layout l{30, 9, 3, 64, 16, oasiskv::dtype::bf16};
  CHECK(fmt::format("{}", l) == "layers=30 q_heads=9 kv_heads=3 head_dim=64 block=16 dtype=bf16");
  CHECK(fmt::format("{:>6}", oasiskv::dtype::f16) == "   f16");
  CHECK(fmt::format("{}", oasiskv::errc::slot_in_flight) == "slot_in_flight");
  CHECK(fmt::format("{}", oasiskv::memory_kind::pinned_host) == "pinned_host");
}
