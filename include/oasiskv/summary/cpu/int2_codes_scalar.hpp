// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The portable scoring kernel of `qminmax_int2_summary` (codes: `int2_codes_layout.hpp`):
//! the dot products of query rows with one (entry, KV head)'s keys dequantized from their 2-bit
//! codes, and the epilogue that folds them into the max or the scaled log-sum-exp. The
//! yardstick the other paths are tested against.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "oasiskv/summary/cpu/int2_codes_layout.hpp"

namespace oasiskv::cpu::detail {

// `dots[r][t] = sum_x q[r][x] * (lo[x] + u(x, t) * step[x])` for the `groups * 16` token lanes.
inline void int2_dots_scalar(const std::uint32_t* words, std::uint32_t groups, const float* lo,
                             const float* step, std::uint32_t d, const float* q, std::uint32_t n,
                             float* dots) {
  const std::uint32_t tp = groups * int2_lanes;
  thread_local std::vector<float> wide;  // [d][tp]: the dequantized keys, transposed
  wide.resize(std::size_t{d} * tp);
  for (std::uint32_t x = 0; x < d; ++x) {
    for (std::uint32_t t = 0; t < tp; ++t) {
      wide[std::size_t{x} * tp + t] = int2_value(lo[x], step[x], int2_code(words, groups, x, t));
    }
  }
  for (std::uint32_t r = 0; r < n; ++r) {
    float* o = dots + std::size_t{r} * tp;
    std::fill(o, o + tp, 0.0f);
    const float* qr = q + std::size_t{r} * d;
    for (std::uint32_t x = 0; x < d; ++x) {
      const float* w = wide.data() + std::size_t{x} * tp;
      for (std::uint32_t t = 0; t < tp; ++t) {  // independent lanes: vectorises
        o[t] += qr[x] * w[t];
      }
    }
  }
}

// One row's epilogue over its first `tokens` dot products `v`: their max, or for `scale` > 0
// `max + log(sum_t exp(scale * (v_t - max))) / scale`.
inline float int2_reduce_scalar(const float* v, std::uint32_t tokens, float scale) {
  float m = -std::numeric_limits<float>::infinity();
  for (std::uint32_t t = 0; t < tokens; ++t) {
    m = v[t] > m ? v[t] : m;
  }
  if (scale == 0.0f || !std::isfinite(m)) {
    return m;
  }
  float sum = 0.0f;
  for (std::uint32_t t = 0; t < tokens; ++t) {
    sum += std::exp(scale * (v[t] - m));
  }
  return m + std::log(sum) / scale;
}

}  // namespace oasiskv::cpu::detail
