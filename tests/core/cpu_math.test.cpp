// SPDX-License-Identifier: Apache-2.0
// cpu::detail::argmax, on the vector path this CPU takes and on the portable one, against a
// reference written another way (the largest non-NaN value first, then its first index).
#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <limits>
#include <random>
#include <vector>

#include "oasiskv/cpu/math.hpp"

namespace {

std::size_t reference_argmax(const std::vector<float>& x) {
  bool any = false;
  float best = 0.0f;
  for (const float v : x) {
    if (!std::isnan(v) && (!any || v > best)) {
      best = v;
      any = true;
    }
  }
  if (!any) {
    return 0;
  }
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (x[i] == best) {
      return i;
    }
  }
  return 0;
}

}  // namespace

TEST_CASE("cpu::detail::argmax: the first largest value, NaN never, every length and tail") {
  using oasiskv::cpu::detail::argmax;
  using oasiskv::cpu::detail::argmax_scalar;
  constexpr float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  std::uniform_int_distribution<int> pick(0, 9);
  for (const std::size_t n : {0u, 1u, 2u, 15u, 16u, 17u, 31u, 33u, 64u, 70u, 49152u}) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> x(n);
      for (float& v : x) {
        const int k = pick(rng);
        // Coarse values tie often; some NaN and infinities.
        v = k == 0 ? nan : k == 1 ? -inf : k == 2 && trial % 3 == 0 ? inf : std::round(dist(rng));
      }
      CAPTURE(n);
      CAPTURE(trial);
      const std::size_t want = reference_argmax(x);
      CHECK(argmax_scalar(x.data(), n) == want);
      CHECK(argmax(x.data(), n) == want);
    }
  }
  // Whole-array cases: all NaN, all -inf, NaN first, the largest last in a partial vector.
  const std::vector<std::vector<float>> cases{
      {nan, nan, nan},
      {-inf, -inf, -inf},
      {nan, 1.0f, 2.0f, 2.0f},
      {-inf, nan, -inf},
      std::vector<float>(19, 1.0f),
      {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17}};
  for (const auto& x : cases) {
    CAPTURE(x.size());
    CHECK(argmax_scalar(x.data(), x.size()) == reference_argmax(x));
    CHECK(argmax(x.data(), x.size()) == reference_argmax(x));
  }
  CHECK(argmax(cases[5].data(), cases[5].size()) == 17);
  CHECK(argmax(cases[2].data(), cases[2].size()) == 2);
}
