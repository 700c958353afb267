// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The portable block function of the CPU decode kernel: plain C++ for machines (or
//! builds) without the x86 SIMD paths, and the yardstick the SIMD paths are tested against.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "oasiskv/attention/cpu/row_state.hpp"
#include "oasiskv/config.hpp"
#include "oasiskv/core/dtype.hpp"

namespace oasiskv::cpu::detail {

//! @brief `block_fn` for element type `T`; `D` is the head dim, or 0 for "read it at run time"
//! (the compile-time value lets the compiler unroll and vectorise the inner loops).
template <class T, unsigned D>
void block_scalar(const row_state& st, const block_span& b) {
  const std::uint32_t d = D != 0 ? D : st.head_dim;
  const T* OASISKV_RESTRICT k = static_cast<const T*>(b.k);
  const T* OASISKV_RESTRICT v = static_cast<const T*>(b.v);
  for (std::uint32_t r = 0; r < st.rows; ++r) {
    const float* OASISKV_RESTRICT q = st.q + std::size_t{r} * d;
    float* OASISKV_RESTRICT s = st.s + std::size_t{r} * st.s_stride;
    const std::uint32_t vis = st.vis[r];
    float mblk = -INFINITY;
    for (std::uint32_t t = 0; t < vis; ++t) {
      const T* kt = k + std::size_t{t} * d;
      float dot = 0.0f;
      for (std::uint32_t x = 0; x < d; ++x) {
        dot += q[x] * to_float(kt[x]);
      }
      s[t] = dot;
      mblk = dot > mblk ? dot : mblk;
    }
    if (vis == 0) {
      st.alpha[r] = 1.0f;
      for (std::uint32_t t = 0; t < b.vmax; ++t) {
        s[t] = 0.0f;
      }
      continue;
    }
    const float m_new = st.m[r] > mblk ? st.m[r] : mblk;
    st.alpha[r] = std::exp2(st.m[r] - m_new);  // 0 on the first block (m = -inf)
    float sum = 0.0f;
    for (std::uint32_t t = 0; t < b.vmax; ++t) {
      s[t] = t < vis ? std::exp2(s[t] - m_new) : 0.0f;
      sum += s[t];
    }
    st.l[r] = st.l[r] * st.alpha[r] + sum;
    st.m[r] = m_new;
  }
  for (std::uint32_t r = 0; r < st.rows; ++r) {
    float* OASISKV_RESTRICT acc = st.acc + std::size_t{r} * d;
    const float* OASISKV_RESTRICT p = st.s + std::size_t{r} * st.s_stride;
    const float alpha = st.alpha[r];
    for (std::uint32_t x = 0; x < d; ++x) {
      acc[x] *= alpha;
    }
    for (std::uint32_t t = 0; t < b.vmax; ++t) {
      const T* vt = v + std::size_t{t} * d;
      const float w = p[t];
      for (std::uint32_t x = 0; x < d; ++x) {
        acc[x] += w * to_float(vt[x]);
      }
    }
  }
}

}  // namespace oasiskv::cpu::detail
