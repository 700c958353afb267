// SPDX-License-Identifier: Apache-2.0
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "oasiskv/core/dtype.hpp"
#include "support/paths.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

using oasiskv::bf16;
using oasiskv::dtype;
using oasiskv::f16;

namespace {
float bits_to_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
std::uint32_t float_to_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
}  // namespace

TEST_CASE("dtype sizes and names") {
  CHECK(oasiskv::dtype_size(dtype::f32) == 4);
  CHECK(oasiskv::dtype_size(dtype::f16) == 2);
  CHECK(oasiskv::dtype_size(dtype::bf16) == 2);
  CHECK(oasiskv::to_string(dtype::bf16) == "bf16");
  static_assert(oasiskv::dtype_of<f16> == dtype::f16);
  static_assert(oasiskv::dtype_of<float> == dtype::f32);
  static_assert(f16::from_float(1.0f).bits == 0x3c00);  // usable in constant expressions
}

TEST_CASE("f16: every half widens and narrows back to itself") {
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const f16 h{static_cast<std::uint16_t>(b)};
    const float f = h.to_float();
    const bool is_nan = (b & 0x7c00) == 0x7c00 && (b & 0x03ff) != 0;
    if (is_nan) {
      CHECK(std::isnan(f));
      CHECK(std::isnan(f16::from_float(f).to_float()));
    } else {
      REQUIRE(f16::from_float(f).bits == h.bits);
    }
  }
}

TEST_CASE("f16: known values, rounding to nearest even, overflow and subnormals") {
  CHECK(f16::from_float(0.0f).bits == 0x0000);
  CHECK(f16::from_float(-0.0f).bits == 0x8000);
  CHECK(f16::from_float(1.0f).bits == 0x3c00);
  CHECK(f16::from_float(-2.0f).bits == 0xc000);
  CHECK(f16::from_float(65504.0f).bits == 0x7bff);  // largest finite
  CHECK(f16::from_float(65520.0f).bits == 0x7c00);  // rounds to infinity
  CHECK(f16::from_float(std::numeric_limits<float>::infinity()).bits == 0x7c00);
  CHECK(f16::from_float(std::ldexp(1.0f, -24)).bits == 0x0001);  // smallest subnormal
  CHECK(f16::from_float(std::ldexp(1.0f, -26)).bits == 0x0000);  // below half of it
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties go to the even mantissa (1.0).
  CHECK(f16::from_float(1.0f + std::ldexp(1.0f, -11)).bits == 0x3c00);
  CHECK(f16::from_float(1.0f + 3 * std::ldexp(1.0f, -11)).bits == 0x3c02);
  CHECK(f16{0x3555}.to_float() == doctest::Approx(0.333251953125f));
}

#if defined(__x86_64__)
__attribute__((target("f16c"))) static std::uint16_t hw_f32_to_f16(float f) {
  return static_cast<std::uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}

TEST_CASE("f16: narrowing agrees with the F16C instruction on a sweep of floats") {
  if (!__builtin_cpu_supports("f16c")) {
    MESSAGE("no F16C on this CPU: the hardware cross-check does not apply");
    return;
  }
  oasiskv::testing::note_path("f16 narrowing checked against F16C");
  // Every 4099th bit pattern covers all exponents, both signs and many mantissas.
  std::uint64_t checked = 0;
  for (std::uint64_t u = 0; u <= 0xffffffffull; u += 4099) {
    const float f = bits_to_float(static_cast<std::uint32_t>(u));
    if (std::isnan(f)) {
      continue;
    }
    REQUIRE(f16::from_float(f).bits == hw_f32_to_f16(f));
    ++checked;
  }
  CHECK(checked > 1000000);
}
#endif

TEST_CASE("bf16: exact for representable values, rounds to nearest even, keeps NaN") {
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const bf16 v{static_cast<std::uint16_t>(b)};
    const float f = v.to_float();
    if (std::isnan(f)) {
      CHECK(std::isnan(bf16::from_float(f).to_float()));
    } else {
      REQUIRE(bf16::from_float(f).bits == v.bits);
    }
  }
  CHECK(bf16::from_float(1.0f).bits == 0x3f80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: to even (1.0); 1 + 3*2^-8 goes up.
  CHECK(bf16::from_float(bits_to_float(0x3f808000)).bits == 0x3f80);
  CHECK(bf16::from_float(bits_to_float(0x3f818000)).bits == 0x3f82);
  const float nan_with_low_payload = bits_to_float(0x7f800001);
  CHECK(std::isnan(bf16::from_float(nan_with_low_payload).to_float()));
  CHECK(float_to_bits(bf16{0xff80}.to_float()) == 0xff800000u);  // -inf
}

TEST_CASE("visit_dtype dispatches to the element type") {
  CHECK(oasiskv::visit_dtype(dtype::f32, [](auto e) { return sizeof(e); }) == 4);
  CHECK(oasiskv::visit_dtype(dtype::f16, [](auto e) { return std::is_same_v<decltype(e), f16>; }));
  CHECK(
      oasiskv::visit_dtype(dtype::bf16, [](auto e) { return std::is_same_v<decltype(e), bf16>; }));
}
