// SPDX-License-Identifier: Apache-2.0
// Inputs the summary tests share: random query rows, and one key written into a pool slot.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "oasiskv/oasiskv.hpp"

namespace oasiskv::testing {

// `n` rows of `d` floats, uniform in [-2, 2), from `seed`.
inline std::vector<float> random_rows(std::uint32_t n, std::uint32_t d, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<float> q(std::size_t{n} * d);
  for (float& x : q) {
    x = dist(rng);
  }
  return q;
}

// Writes key `k` (head_dim floats) as token `tok` of KV head `h` in slot `s`.
inline void set_key(host_tier& t, slot_id s, std::uint32_t h, std::uint32_t tok, const float* k) {
  const kv_layout& l = t.layout();
  visit_dtype(l.kv_dtype, [&](auto elem) {
    using T = decltype(elem);
    T* p = reinterpret_cast<T*>(t.slot_data(s) + l.key_offset(h)) + std::size_t{tok} * l.head_dim;
    for (std::uint32_t x = 0; x < l.head_dim; ++x) {
      p[x] = from_float<T>(k[x]);
    }
  });
}

}  // namespace oasiskv::testing
