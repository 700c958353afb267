// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The portable scoring kernel of `quantized_key_summary` (codes: `qkey_layout.hpp`):
//! the raw dot products of query rows with one (entry, KV head)'s int8 / int4 codes, and the
//! epilogue that dequantizes them into the max or the scaled log-sum-exp. Plain C++ for
//! machines (or builds) without the x86 SIMD paths, and the yardstick they are tested against.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "oasiskv/summary/cpu/qkey_layout.hpp"

namespace oasiskv::cpu::detail {

// The raw dot products `dots[r][t] = sum_x q[r][x] * code[x][t]` of one (entry, KV head).
template <int Bits>
inline void qkey_dots_scalar(const std::uint8_t* codes, std::uint32_t d, std::uint32_t tp,
                             const float* q, std::uint32_t n, float* dots) {
  thread_local std::vector<float> wide;
  wide.resize(std::size_t{d} * tp);
  for (std::uint32_t x = 0; x < d; ++x) {
    for (std::uint32_t t = 0; t < tp; ++t) {
      wide[std::size_t{x} * tp + t] = static_cast<float>(qkey_code<Bits>(codes, tp, x, t));
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

// One row's epilogue, as qkey_reduce_avx2: `v` (the row's raw dot products, tp of them) becomes
// the dequantized dot products; returns their max, or for `scale` > 0 the scaled log-sum-exp.
inline float qkey_reduce_scalar(float* v, const float* sc, std::uint32_t tp, float scale) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  float m = -inf;
  for (std::uint32_t t = 0; t < tp; ++t) {
    // absent (-1): -inf; non-finite key (+inf): +inf; else the dequantized dot product
    v[t] = sc[t] < 0.0f ? -inf : (sc[t] == inf ? inf : v[t] * sc[t]);
    m = v[t] > m ? v[t] : m;
  }
  if (scale == 0.0f || !std::isfinite(m)) {
    return m;
  }
  float sum = 0.0f;
  for (std::uint32_t t = 0; t < tp; ++t) {
    sum += sc[t] < 0.0f ? 0.0f : std::exp(scale * (v[t] - m));
  }
  return m + std::log(sum) / scale;
}

}  // namespace oasiskv::cpu::detail
