// SPDX-License-Identifier: Apache-2.0
// What the summary tests share: random query rows, one key written into a pool slot, and the
// two-stage summaries' contender model.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <span>
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

// The first stage of a two-stage summary, written out: each entry of `ids` scored alone by
// `coarse` (a bound per row, never NaN here), folded to its maximum over the `n` rows of `q`;
// the `want` highest (ties to the earlier index) are the contenders. Returns a flag per index.
template <class Coarse>
std::vector<bool> top_bound_contenders(const Coarse& coarse, std::uint32_t h,
                                       const std::vector<std::uint32_t>& ids,
                                       const std::vector<float>& q, std::uint32_t n,
                                       std::uint32_t want) {
  const std::size_t m = ids.size();
  std::vector<double> bound(m, -std::numeric_limits<double>::infinity());
  for (std::size_t i = 0; i < m; ++i) {
    std::vector<float> one(n);
    coarse.score(h, std::span<const std::uint32_t>(&ids[i], 1), q.data(), n, one.data());
    for (const float v : one) {
      REQUIRE_FALSE(std::isnan(v));
      bound[i] = std::max(bound[i], double{v});
    }
  }
  std::vector<std::uint32_t> order(m);
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(),
                   [&](std::uint32_t a, std::uint32_t b) { return bound[a] > bound[b]; });
  std::vector<bool> contender(m, false);
  for (std::uint32_t j = 0; j < want && j < m; ++j) {
    contender[order[j]] = true;
  }
  return contender;
}

}  // namespace oasiskv::testing
