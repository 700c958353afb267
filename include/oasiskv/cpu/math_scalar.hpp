// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The portable paths of the shared SIMD math (dispatched by `math.hpp`): element
//! widening, entry dot products, the softmax helpers and entry-id statistics in plain C++, for
//! machines (or builds) without the x86 SIMD paths, and the yardstick those are tested against.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>

#include "oasiskv/config.hpp"
#include "oasiskv/core/dtype.hpp"

namespace oasiskv::cpu::detail {

//! @brief Widens a stored summary element.
OASISKV_ALWAYS_INLINE float widen(float v) noexcept {
  return v;
}
OASISKV_ALWAYS_INLINE float widen(f16 v) noexcept {
  return v.to_float();
}
OASISKV_ALWAYS_INLINE float widen(bf16 v) noexcept {
  return v.to_float();
}

template <class S>
void dot_entries_scalar(const S* base, std::size_t entry_stride, std::span<const std::uint32_t> ids,
                        const float* rows, std::uint32_t n, std::uint32_t len, float* out) {
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const S* v = base + std::size_t{ids[i]} * entry_stride;
    for (std::uint32_t r = 0; r < n; ++r) {
      const float* q = rows + std::size_t{r} * len;
      float acc[8] = {};  // eight partial sums: vectorisable without -ffast-math
      for (std::uint32_t x = 0; x < len; x += 8) {
        for (std::uint32_t k = 0; k < 8; ++k) {
          acc[k] += q[x + k] * widen(v[x + k]);
        }
      }
      out[i * n + r] =
          ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    }
  }
}

//! @brief `exp_sum` in plain C++: `std::exp`.
inline float exp_sum_scalar(const float* x, float m, std::size_t count, float scale, float* out) {
  float sum = 0.0f;
  for (std::size_t i = 0; i < count; ++i) {
    out[i] = std::exp(scale * (x[i] - m));
    sum += out[i];
  }
  return sum;
}

//! @brief `clamp_finite_max` in plain C++.
inline float clamp_finite_max_scalar(const float* x, std::size_t count, float* out) {
  constexpr float lim = std::numeric_limits<float>::max();
  float m = -lim;
  for (std::size_t i = 0; i < count; ++i) {
    const float v = x[i] <= lim ? (x[i] >= -lim ? x[i] : -lim) : lim;
    out[i] = v;
    m = v > m ? v : m;
  }
  return m;
}

//! @brief `argmax` in plain C++.
inline std::size_t argmax_scalar(const float* x, std::size_t count) {
  std::size_t best = 0;
  float m = -std::numeric_limits<float>::infinity();
  bool any = false;
  for (std::size_t i = 0; i < count; ++i) {
    if (x[i] > m || (!any && x[i] == m)) {  // NaN never compares true
      m = x[i];
      best = i;
      any = true;
    }
  }
  return best;
}

//! @brief `add_scaled` in plain C++.
inline void add_scaled_scalar(float* acc, const float* x, float k, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    acc[i] += k * x[i];
  }
}

//! @brief Of a list of entry ids: the largest id, and how many ids are their predecessor plus one.
struct entry_id_stats {
  std::uint32_t top = 0;
  std::uint32_t steps = 0;
};

// Two branch-free passes (a max and a count) that the compiler vectorises.
inline entry_id_stats entry_id_stats_scalar(std::span<const std::uint32_t> ids) {
  std::uint32_t top = 0, steps = 0;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    top = ids[i] > top ? ids[i] : top;
  }
  for (std::size_t i = 1; i < ids.size(); ++i) {
    steps += ids[i] == ids[i - 1] + 1 ? 1u : 0u;
  }
  return {top, steps};
}

}  // namespace oasiskv::cpu::detail
