// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The code layout of `qminmax_int2_summary` that its scoring kernels share: 2-bit codes
//! of every key element between its block's per-dimension bounds, and the query rows quantized
//! to int8 for the integer kernel.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace oasiskv::cpu::detail {

// Tokens are stored in groups of 16: one 32-bit word holds the 2-bit codes of one dimension for
// 16 tokens, token `16 g + i` at bits `[2 i, 2 i + 2)` of word `[x][g]`.
inline constexpr std::uint32_t int2_lanes = 16;

// Code `u` in [0, 3] of dimension x, token t, in an (entry, KV head)'s `[d][groups]` words.
inline std::uint32_t int2_code(const std::uint32_t* words, std::uint32_t groups, std::uint32_t x,
                               std::uint32_t t) noexcept {
  return (words[std::size_t{x} * groups + t / int2_lanes] >> (2 * (t % int2_lanes))) & 3u;
}

// The dequantized element: `lo + u * step`.
inline float int2_value(float lo, float step, std::uint32_t u) noexcept {
  return lo + static_cast<float>(u) * step;
}

//! The most query rows one pass of the integer kernel takes (its accumulators; the rows' bound
//! terms are the lanes of one vector).
inline constexpr std::uint32_t int2_pass_rows = 16;

//! The query rows of one scoring call, quantized to int8 for the integer kernel
//! (`int2_codes_avx512_vnni.hpp`).
struct int2_query {
  std::uint32_t n = 0, d = 0;
  std::vector<float> alpha;  //!< [n]: row r ~ alpha[r] * Q_r
  //! [passes][d / 4][16]: (Q_4p .. Q_4p+3) as the bytes 0-3 of lane r, a pass's row r
  std::vector<std::int32_t> columns;
  std::vector<std::int32_t> bias;  //!< [passes][16]: 128 sum_x Q_x per row (the bounds' offset)
};

//! The largest |Q|: the query rows are int8 (`vpdpbusd`'s signed operand). The largest sum,
//! `d * 127 * 255` for both terms together, fits in int32 for any head dimension the kernel takes.
inline std::int32_t int2_query_limit(std::uint32_t /*d*/) noexcept {
  return 127;
}

//! Quantizes `n` rows of `d` (a multiple of 4) values per row, `alpha = max |q| / 127` (0 for an
//! all-zero row). False if a value is not finite (the caller scores in f32 instead).
inline bool int2_quantize_query(const float* q, std::uint32_t n, std::uint32_t d, int2_query& z) {
  const std::int32_t limit = int2_query_limit(d);
  const std::uint32_t q4 = d / 4, passes = (n + int2_pass_rows - 1) / int2_pass_rows;
  z.n = n;
  z.d = d;
  z.alpha.assign(n, 0.0f);
  z.columns.assign(std::size_t{passes} * q4 * 16, 0);
  z.bias.assign(std::size_t{passes} * 16, 0);
  for (std::uint32_t r = 0; r < n; ++r) {
    const float* row = q + std::size_t{r} * d;
    float amax = 0.0f;
    for (std::uint32_t x = 0; x < d; ++x) {
      if (!std::isfinite(row[x])) {
        return false;
      }
      amax = std::max(amax, std::fabs(row[x]));
    }
    const float alpha = amax / static_cast<float>(limit);
    z.alpha[r] = alpha;
    const float inv = alpha > 0.0f ? 1.0f / alpha : 0.0f;
    std::int32_t sum = 0;
    for (std::uint32_t p = 0; p < q4; ++p) {
      std::uint32_t word = 0;
      for (std::uint32_t j = 0; j < 4; ++j) {
        // Rounded half away from zero by truncation (no library call: this runs per call).
        const float x = row[4 * p + j] * inv;
        const auto v = static_cast<std::int32_t>(x + (x >= 0.0f ? 0.5f : -0.5f));
        sum += v;
        word |= (static_cast<std::uint32_t>(v) & 0xffu) << (8 * j);
      }
      z.columns[(std::size_t{r / int2_pass_rows} * q4 + p) * 16 + r % int2_pass_rows] =
          static_cast<std::int32_t>(word);
    }
    z.bias[std::size_t{r / int2_pass_rows} * 16 + r % int2_pass_rows] = 128 * sum;
  }
  return true;
}

}  // namespace oasiskv::cpu::detail
