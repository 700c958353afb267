// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The code layout of `qminmax_int2_summary` that its scoring kernels share: 2-bit codes
//! of every key element between its block's per-dimension bounds, and the query rows quantized
//! to 16-bit integers for the integer kernel.
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

//! The query rows of one scoring call, quantized for the integer kernel
//! (`int2_codes_avx512_vnni.hpp`).
struct int2_query {
  std::uint32_t n = 0, d = 0;
  std::vector<float> alpha;           //!< [n]: row r ~ alpha[r] * Q_r
  std::vector<std::int32_t> pairs;    //!< [n][d / 2]: (Q_2p, Q_2p+1) as the low / high int16
  std::vector<std::int32_t> columns;  //!< [passes of 12 rows][d / 2][16]: the pairs, rows in lanes
};

//! The largest |Q| for head dimension `d`: `d * Q * 3 * 254` (the largest `A`) fits in int32.
inline std::int32_t int2_query_limit(std::uint32_t d) noexcept {
  const std::int64_t limit =
      std::int64_t{std::numeric_limits<std::int32_t>::max()} / (762 * std::int64_t{d});
  return static_cast<std::int32_t>(std::min<std::int64_t>(32767, limit));
}

//! Quantizes `n` rows of `d` (even) values per row, `alpha = max |q| / int2_query_limit(d)`
//! (0 for an all-zero row). False if a value is not finite (the caller scores in f32 instead).
inline bool int2_quantize_query(const float* q, std::uint32_t n, std::uint32_t d, int2_query& z) {
  const std::int32_t limit = int2_query_limit(d);
  const std::uint32_t half = d / 2, passes = (n + 11) / 12;
  z.n = n;
  z.d = d;
  z.alpha.assign(n, 0.0f);
  z.pairs.assign(std::size_t{n} * half, 0);
  z.columns.assign(std::size_t{passes} * half * 16, 0);
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
    for (std::uint32_t p = 0; p < half; ++p) {
      const auto lo = static_cast<std::int32_t>(std::nearbyint(row[2 * p] * inv));
      const auto hi = static_cast<std::int32_t>(std::nearbyint(row[2 * p + 1] * inv));
      const std::int32_t word = static_cast<std::int32_t>(
          (static_cast<std::uint32_t>(hi) << 16) | (static_cast<std::uint32_t>(lo) & 0xffffu));
      z.pairs[std::size_t{r} * half + p] = word;
      z.columns[(std::size_t{r / 12} * half + p) * 16 + r % 12] = word;
    }
  }
  return true;
}

}  // namespace oasiskv::cpu::detail
