// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The block summary the exporter ships: per KV head, the elementwise maximum and
//! minimum key of the block in f16 (Quest bounds), rounded outward so the bound survives.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/layout.hpp"

namespace oasiskv::disagg {

//! @brief Bytes of one block's summary: `[num_kv_heads][2 (max, min)][head_dim]` f16.
constexpr std::size_t summary_bytes(const kv_layout& l) noexcept {
  return std::size_t{2} * l.num_kv_heads * l.head_dim * sizeof(f16);
}

namespace detail {
// The nearest f16 at or above (up) / at or below (!up) `v`, so a stored bound never shrinks.
inline f16 round_f16(float v, bool up) {
  f16 h = f16::from_float(v);
  const float back = h.to_float();
  if (std::isnan(back) || (up ? back >= v : back <= v)) {
    return h;
  }
  const bool negative = (h.bits & 0x8000u) != 0;
  const bool toward_larger_magnitude = up != negative;
  if ((h.bits & 0x7fffu) == 0) {  // +-0: step to the smallest subnormal of the right sign
    return f16{static_cast<std::uint16_t>(up ? 0x0001u : 0x8001u)};
  }
  h.bits = static_cast<std::uint16_t>(toward_larger_magnitude ? h.bits + 1 : h.bits - 1);
  return h;
}
}  // namespace detail

//! @brief Writes the summary of the first `tokens` tokens of `block` to `out`.
inline void summarize_block(const kv_layout& l, const std::byte* block, std::uint32_t tokens,
                            std::byte* out) {
  const std::uint32_t d = l.head_dim;
  visit_dtype(l.kv_dtype, [&](auto elem) {
    using T = decltype(elem);
    for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
      const T* keys = reinterpret_cast<const T*>(block + l.key_offset(h));
      for (std::uint32_t x = 0; x < d; ++x) {
        float hi = -std::numeric_limits<float>::infinity();
        float lo = std::numeric_limits<float>::infinity();
        for (std::uint32_t t = 0; t < tokens; ++t) {
          const float v = to_float(keys[std::size_t{t} * d + x]);
          hi = std::max(hi, v);
          lo = std::min(lo, v);
        }
        const f16 a = detail::round_f16(hi, true);
        const f16 b = detail::round_f16(lo, false);
        std::memcpy(out + ((std::size_t{h} * 2 + 0) * d + x) * 2, &a, 2);
        std::memcpy(out + ((std::size_t{h} * 2 + 1) * d + x) * 2, &b, 2);
      }
    }
  });
}

//! @brief Upper bound of the attention logit of any q head in `q` (`[num_q_heads][head_dim]`)
//! over the block: the max over q heads of `sum_d max(q_d * max_d, q_d * min_d)`.
inline float score_summary(const kv_layout& l, const std::byte* summary, const float* q) {
  const std::uint32_t d = l.head_dim;
  float best = -std::numeric_limits<float>::infinity();
  for (std::uint32_t qh = 0; qh < l.num_q_heads; ++qh) {
    const std::uint32_t h = qh / l.group_size();
    const float* qr = q + std::size_t{qh} * d;
    float s = 0.0f;
    for (std::uint32_t x = 0; x < d; ++x) {
      f16 a, b;
      std::memcpy(&a, summary + ((std::size_t{h} * 2 + 0) * d + x) * 2, 2);
      std::memcpy(&b, summary + ((std::size_t{h} * 2 + 1) * d + x) * 2, 2);
      s += std::max(qr[x] * a.to_float(), qr[x] * b.to_float());
    }
    best = std::max(best, s);
  }
  return best;
}

//! @brief `out[i]` = `score_summary` of the `n` consecutive summaries at `summaries`: the
//! same bound, computed block by block with each summary widened once per KV head (not once per
//! q head) and the query split into its positive and negative parts, so the inner loop is two
//! plain multiply-adds the compiler vectorises.
inline void score_summaries(const kv_layout& l, const std::byte* summaries, std::size_t n,
                            const float* q, float* out) {
  const std::uint32_t d = l.head_dim;
  std::vector<float> pos(std::size_t{l.num_q_heads} * d), neg(pos.size()), hi(d), lo(d);
  for (std::size_t i = 0; i < pos.size(); ++i) {
    pos[i] = std::max(q[i], 0.0f);
    neg[i] = std::min(q[i], 0.0f);
  }
  const std::size_t sb = summary_bytes(l);
  for (std::size_t b = 0; b < n; ++b) {
    const std::byte* s = summaries + b * sb;
    float best = -std::numeric_limits<float>::infinity();
    for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
      for (std::uint32_t x = 0; x < d; ++x) {
        f16 a, c;
        std::memcpy(&a, s + ((std::size_t{h} * 2 + 0) * d + x) * 2, 2);
        std::memcpy(&c, s + ((std::size_t{h} * 2 + 1) * d + x) * 2, 2);
        hi[x] = a.to_float();
        lo[x] = c.to_float();
      }
      for (std::uint32_t g = 0; g < l.group_size(); ++g) {
        const std::size_t row = (std::size_t{h} * l.group_size() + g) * d;
        float acc = 0.0f;
        for (std::uint32_t x = 0; x < d; ++x) {
          acc += pos[row + x] * hi[x] + neg[row + x] * lo[x];
        }
        best = std::max(best, acc);
      }
    }
    out[b] = best;
  }
}

}  // namespace oasiskv::disagg
