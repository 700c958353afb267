// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief 16-byte vectors of stored KV elements (f32, f16, bf16) widened to f32 in registers.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "oasiskv/config.hpp"
#include "oasiskv/core/dtype.hpp"

namespace oasiskv::cuda::detail {

//! @brief `kv_vec<T>::n` elements of `T` in one 16-byte load, and their widening.
template <class T>
struct kv_vec;

template <>
struct kv_vec<float> {
  static constexpr int n = 4;
  OASISKV_DEVICE static void widen(const uint4& r, float (&f)[n]) {
    f[0] = __uint_as_float(r.x);
    f[1] = __uint_as_float(r.y);
    f[2] = __uint_as_float(r.z);
    f[3] = __uint_as_float(r.w);
  }
};

template <>
struct kv_vec<bf16> {
  static constexpr int n = 8;
  // bf16 is the upper half of an f32: widening is a shift (element 0 is the low half).
  OASISKV_DEVICE static void widen(const uint4& r, float (&f)[n]) {
    const unsigned w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
};

template <>
struct kv_vec<f16> {
  static constexpr int n = 8;
  OASISKV_DEVICE static void widen(const uint4& r, float (&f)[n]) {
    const unsigned w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = __half22float2(
          __halves2half2(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xffffu)),
                         __ushort_as_half(static_cast<unsigned short>(w[i] >> 16))));
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  }
};

}  // namespace oasiskv::cuda::detail
