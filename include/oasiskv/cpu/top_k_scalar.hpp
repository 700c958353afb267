// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The portable top-k kernel (see `top_k.hpp`): plain C++ for machines (or builds)
//! without the AVX-512 path, and the yardstick it is tested against.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

namespace oasiskv::cpu::detail {

// Appends base + i for the k highest cand[i] (i < m, 0 < k < m), ascending, ties to the
// lower index, NaN as +inf. Every loop is branch-free (selects and counters, no
// data-dependent jumps), so a selection costs about the same whatever the scores. `ranked_buf`
// and `pool_buf` are the caller's scratch, reused across calls.
inline void keep_top_scalar(const float* cand, std::uint32_t m, std::uint32_t k, std::uint32_t base,
                            std::vector<float>& ranked_buf, std::vector<float>& pool_buf,
                            std::vector<std::uint32_t>& out) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  ranked_buf.resize(m);
  float* ranked = ranked_buf.data();
  for (std::uint32_t i = 0; i < m; ++i) {
    const float s = cand[i];
    ranked[i] = s == s ? s : inf;
  }
  // When k is a small share of the candidates, the least of k chunk maxima is a cheap lower
  // bound of the k-th highest score (each chunk holds a score at least that high): only the
  // scores at or above it go to nth_element.
  float* pool = ranked;
  std::uint32_t pooled = m;
  if (std::uint64_t{k} * 8 <= m) {
    const std::uint32_t chunk = m / k;
    float lower = inf;
    for (std::uint32_t c = 0; c < k; ++c) {
      float top = -inf;
      for (std::uint32_t i = c * chunk; i < (c + 1) * chunk; ++i) {
        top = ranked[i] > top ? ranked[i] : top;
      }
      lower = top < lower ? top : lower;
    }
    pool_buf.resize(m);  // allocates only when the sequence has grown
    pool = pool_buf.data();
    pooled = 0;
    for (std::uint32_t i = 0; i < m; ++i) {
      pool[pooled] = ranked[i];
      pooled += ranked[i] >= lower ? 1u : 0u;
    }
  }
  std::nth_element(pool, pool + (k - 1), pool + pooled, std::greater<float>());
  const float threshold = pool[k - 1];
  std::uint32_t above = 0;
  for (std::uint32_t i = 0; i < k - 1; ++i) {
    above += pool[i] > threshold ? 1u : 0u;
  }
  // Every block above the threshold, and the first `k - above` equal to it.
  std::uint32_t ties = k - above;
  const std::size_t at = out.size();
  out.resize(at + m);  // room for any candidate; trimmed to the k kept
  std::uint32_t* dst = out.data() + at;
  std::uint32_t kept = 0;
  for (std::uint32_t i = 0; i < m; ++i) {  // from `cand`: nth_element may reorder ranked
    const float v = cand[i];
    const float s = v == v ? v : inf;
    const std::uint32_t eq = s == threshold ? 1u : 0u;
    const std::uint32_t keep = (s > threshold ? 1u : 0u) | (eq & (ties > 0 ? 1u : 0u));
    ties -= eq & keep;
    dst[kept] = base + i;
    kept += keep;
  }
  out.resize(at + kept);
}

}  // namespace oasiskv::cpu::detail
