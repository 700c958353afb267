// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The code layout of `quantized_key_summary` and its portable scoring kernel: the raw
//! dot products of query rows with one (entry, KV head)'s int8 / int4 codes, and the epilogue
//! that dequantizes them into the max or the scaled log-sum-exp. Plain C++ for machines (or
//! builds) without the x86 SIMD paths, and the yardstick they are tested against.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace oasiskv::detail {

// Tokens are stored in lanes of 16 (codes of one dimension for 16 tokens: 16 bytes in int8, 8
// in int4), so one dimension of a lane group widens to two vectors of 8 floats.
inline constexpr std::uint32_t qkey_lanes = 16;

// Per-token scale sentinels: a token not (yet) folded in, and a token whose key is not finite.
inline constexpr float qkey_absent = -1.0f;

// The raw dot products `dots[r][t] = sum_x q[r][x] * code[x][t]` of one (entry, KV head):
// `codes` is `[head_dim][tp]` int8, or `[head_dim][tp / 2]` bytes of two int4 codes (token 2i in
// the low nibble) for Bits == 4.
template <int Bits>
inline std::int32_t qkey_code(const std::uint8_t* codes, std::uint32_t tp, std::uint32_t x,
                              std::uint32_t t) noexcept {
  if constexpr (Bits == 8) {
    return static_cast<std::int8_t>(codes[std::size_t{x} * tp + t]);
  } else {
    const std::uint32_t byte = codes[std::size_t{x} * (tp / 2) + t / 2];
    const std::uint32_t nib = (t % 2 == 0 ? byte : byte >> 4) & 0xfu;
    return static_cast<std::int32_t>(nib ^ 8u) - 8;
  }
}

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

}  // namespace oasiskv::detail
