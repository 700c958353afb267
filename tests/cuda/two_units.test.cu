// SPDX-License-Identifier: Apache-2.0
//! The CUDA headers in two translation units of one binary, as an engine with several `.cu`
//! files includes them: a kernel defined in a header must be a template (one instantiation the
//! linker merges), never a plain `__global__` function, which every unit would define again
//! (nvcc's host stubs: "multiple definition of `__device_stub__...`"). That this binary links is
//! the check: without the fix the build fails. (Each unit keeps its own handle of a template
//! kernel, registered with its own device code, so the handles are not compared.) No device is
//! needed.
#include <doctest/doctest.h>

#include "cuda/two_units.cuh"

namespace oasiskv::testing {
std::array<const void*, 4> header_kernels() {
  return header_kernels_here();
}
}  // namespace oasiskv::testing

TEST_CASE("the CUDA headers link from two translation units" * doctest::test_suite("host")) {
  const auto here = oasiskv::testing::header_kernels();
  const auto there = oasiskv::testing::header_kernels_other_unit();
  REQUIRE(here.size() == there.size());
  for (std::size_t i = 0; i < here.size(); ++i) {
    CAPTURE(i);
    CHECK(here[i] != nullptr);
    CHECK(there[i] != nullptr);
  }
}
