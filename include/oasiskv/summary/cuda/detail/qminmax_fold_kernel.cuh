// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Kernel of `cuda::device_quantized_minmax_summary::update` / `recompute` / `reset`:
//! folds key rows into one entry's int8 codes, power-of-two scales and norms with the host
//! `quantized_minmax_summary::update` rule (`qminmax_math.cuh`), so both store the same bits.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "oasiskv/config.hpp"
#include "oasiskv/core/dtype.hpp"
#include "oasiskv/summary/cuda/detail/qminmax_math.cuh"
#include "oasiskv/summary/cuda/detail/summary_fold.cuh"

namespace oasiskv::cuda::detail {

//! @brief One fold (`summary_fold`) into an entry's int8 codes, scales, norms and bias: `fresh`
//! starts from the empty entry, `clear` writes it (zero codes, scales and norms, bias `-inf`, no
//! tokens).
struct qminmax_fold_args : summary_fold {
  std::uint32_t* codes = nullptr;  // [num_kv_heads][capacity][head_dim / 2] code words
  float* scale = nullptr;          // [num_kv_heads][capacity]: 2^e, 0 when empty
  float* norm = nullptr;           // [num_kv_heads][capacity]: ||A||_2 rounded up
  float* bias = nullptr;           // [capacity]: 0; -inf empty; +inf a non-finite key
};
static_assert(std::is_trivially_copyable_v<qminmax_fold_args>);

inline constexpr int qfold_threads = 128;

//! The maximum of `v` over the CTA (NaN-free inputs), returned to every thread.
OASISKV_DEVICE float qfold_block_max(float v, float* scratch) {
  for (int off = 16; off > 0; off >>= 1) {
    const float o = __shfl_xor_sync(0xffffffffu, v, off);
    v = v < o ? o : v;
  }
  __syncthreads();  // scratch is free
  if ((threadIdx.x & 31u) == 0) {
    scratch[threadIdx.x >> 5] = v;
  }
  __syncthreads();
  float m = scratch[0];
  for (int w = 1; w < qfold_threads / 32; ++w) {
    m = m < scratch[w] ? scratch[w] : m;
  }
  return m;
}

//! The sum of `v` over the CTA, returned to every thread (integers: any order gives the same).
OASISKV_DEVICE std::uint32_t qfold_block_sum(std::uint32_t v, std::uint32_t* scratch) {
  for (int off = 16; off > 0; off >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, off);
  }
  __syncthreads();
  if ((threadIdx.x & 31u) == 0) {
    scratch[threadIdx.x >> 5] = v;
  }
  __syncthreads();
  std::uint32_t s = 0;
  for (int w = 0; w < qfold_threads / 32; ++w) {
    s += scratch[w];
  }
  return s;
}

//! One CTA for the entry (every KV head, so the entry's bias is decided in one place); per head,
//! a thread per dimension pair: the new keys' bounds and largest magnitude (`qminmax_take_key`,
//! tokens in order), the scale grown to cover them (`qminmax_exponent`), the old codes rescaled
//! and the new bounds merged (`qminmax_quantize`), the norm from the summed squares.
template <class T>
__global__ void __launch_bounds__(qfold_threads) qminmax_fold_kernel(const qminmax_fold_args a) {
  __shared__ float fscratch[qfold_threads / 32];
  __shared__ std::uint32_t uscratch[qfold_threads / 32];
  const std::uint32_t pairs = a.head_dim / 2;
  bool overflow = false;
  for (std::uint32_t h = 0; h < a.num_kv_heads; ++h) {
    const std::size_t slot = std::size_t{h} * a.capacity + a.entry;
    std::uint32_t* words = a.codes + slot * pairs;
    if (a.clear) {
      for (std::uint32_t p = threadIdx.x; p < pairs; p += qfold_threads) {
        words[p] = 0;
      }
      if (threadIdx.x == 0) {
        a.scale[slot] = 0.0f;
        a.norm[slot] = 0.0f;
      }
      continue;
    }
    const T* keys = static_cast<const T*>(a.keys) + std::size_t{h} * a.head_stride;
    // Pass 1: the new keys' largest finite magnitude (the bounds are recomputed in pass 2, which
    // is cheaper than keeping head_dim of them per thread).
    float mag = 0.0f;
    for (std::uint32_t p = threadIdx.x; p < pairs; p += qfold_threads) {
      for (std::uint32_t k = 0; k < 2; ++k) {
        float hi = -INFINITY, lo = INFINITY;
        for (std::uint32_t t = 0; t < a.count; ++t) {
          qminmax_take_key(to_float(keys[std::size_t{t} * a.token_stride + 2 * p + k]), hi, lo, mag,
                           overflow);
        }
      }
    }
    mag = qfold_block_max(mag, fscratch);
    const float old_scale = a.scale[slot];
    const bool fresh = a.fresh || old_scale == 0.0f;
    const int old_e = fresh ? qminmax_min_exponent : qminmax_exponent_of(old_scale);
    const int e = qminmax_exponent(mag, old_e);
    const float s = qminmax_pow2f(e);
    const int shift = fresh || e <= old_e ? 0 : (e - old_e < 31 ? e - old_e : 31);
    std::uint32_t sq = 0;
    for (std::uint32_t p = threadIdx.x; p < pairs; p += qfold_threads) {
      const std::uint32_t old = fresh ? 0u : words[p];
      std::int32_t c_hi[2], c_lo[2];
      for (int k = 0; k < 2; ++k) {
        if (fresh) {
          c_hi[k] = -127;
          c_lo[k] = 127;
        } else {
          c_hi[k] = qminmax_rescale_max(qminmax_word_max(old, 2 * k), shift);
          c_lo[k] = qminmax_rescale_min(qminmax_word_min(old, 2 * k), shift);
        }
        float hi = -INFINITY, lo = INFINITY, unused_mag = 0.0f;
        bool unused_overflow = false;
        for (std::uint32_t t = 0; t < a.count; ++t) {
          qminmax_take_key(to_float(keys[std::size_t{t} * a.token_stride + 2 * p + k]), hi, lo,
                           unused_mag, unused_overflow);
        }
        qminmax_quantize(hi, lo, s, c_hi[k], c_lo[k]);
        sq += qminmax_square(c_hi[k], c_lo[k]);
      }
      words[p] = qminmax_pack(c_hi[0], c_lo[0], c_hi[1], c_lo[1]);
    }
    sq = qfold_block_sum(sq, uscratch);  // <= 127^2 * 1024: no overflow
    if (threadIdx.x == 0) {
      a.scale[slot] = s;
      a.norm[slot] = qminmax_norm(sq, e);
    }
  }
  overflow = __syncthreads_or(overflow ? 1 : 0) != 0;
  if (threadIdx.x == 0) {
    if (a.clear) {
      a.bias[a.entry] = -INFINITY;
    } else {
      const bool was = !a.fresh && a.bias[a.entry] == INFINITY;
      a.bias[a.entry] = was || overflow ? INFINITY : 0.0f;
    }
    a.tokens[a.entry] = a.new_tokens;
  }
}

}  // namespace oasiskv::cuda::detail
