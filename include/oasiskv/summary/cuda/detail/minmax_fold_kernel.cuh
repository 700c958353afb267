// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Kernel of `cuda::device_minmax_summary::update` / `recompute` / `reset`: folds key rows
//! into one entry's f16 bounds with the host `minmax_summary<f16>::update` rule, so both produce
//! the same bits.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "oasiskv/config.hpp"
#include "oasiskv/core/dtype.hpp"
#include "oasiskv/summary/cuda/detail/summary_fold.cuh"

namespace oasiskv::cuda::detail {

//! @brief One fold (`summary_fold`) into an entry's f16 bounds: `fresh` starts from the empty
//! bounds (max `-inf`, min `+inf`), `clear` writes the empty entry (zero bounds, no tokens).
struct minmax_fold_args : summary_fold {
  f16* bounds = nullptr;  // [num_kv_heads][capacity][2][head_dim]
};
static_assert(std::is_trivially_copyable_v<minmax_fold_args>);

inline constexpr int fold_threads = 128;

// `cpu::detail::round_up<f16>` / `round_down<f16>` of summary/cpu/minmax_layout.hpp, on the device:
// the nearest f16 (`f16::from_float`, round to nearest even), stepped one ulp outward when it
// landed on the wrong side of `x`. Exact for f16 inputs; a bf16 or f32 key rounds outward.
OASISKV_HOST_DEVICE f16 f16_round_up(float x) {
  const f16 r = f16::from_float(x);
  if (!(r.to_float() < x)) {
    return r;
  }
  if (r.bits == 0x0000u || r.bits == 0x8000u) {
    return f16{0x0001u};
  }
  return f16{static_cast<std::uint16_t>((r.bits & 0x8000u) ? r.bits - 1u : r.bits + 1u)};
}
OASISKV_HOST_DEVICE f16 f16_round_down(float x) {
  const f16 r = f16::from_float(x);
  if (!(r.to_float() > x)) {
    return r;
  }
  if (r.bits == 0x0000u || r.bits == 0x8000u) {
    return f16{0x8001u};
  }
  return f16{static_cast<std::uint16_t>((r.bits & 0x8000u) ? r.bits + 1u : r.bits - 1u)};
}

//! Folds `count` keys (`keys[t * stride]`) into one dimension's bounds, in order, with the
//! host's rule (`if (v > max) max = round_up(v)`, `if (v < min) min = round_down(v)`; NaN keys
//! leave the bounds alone), so even the sign of a zero bound matches the host's.
template <class T>
OASISKV_HOST_DEVICE void fold_dim(f16& hi, f16& lo, const T* keys, std::size_t stride,
                                  std::uint32_t count) {
  float hf = hi.to_float(), lf = lo.to_float();
  for (std::uint32_t t = 0; t < count; ++t) {
    const float v = to_float(keys[std::size_t{t} * stride]);
    if (v > hf) {
      hi = f16_round_up(v);
      hf = hi.to_float();
    }
    if (v < lf) {
      lo = f16_round_down(v);
      lf = lo.to_float();
    }
  }
}

//! One CTA per KV head, a thread per dimension (`fold_dim`).
template <class T>
__global__ void __launch_bounds__(fold_threads) minmax_fold_kernel(const minmax_fold_args a) {
  const std::uint32_t h = blockIdx.x;
  f16* hi_row = a.bounds + (std::size_t{h} * a.capacity + a.entry) * 2 * a.head_dim;
  f16* lo_row = hi_row + a.head_dim;
  const T* keys = static_cast<const T*>(a.keys) + std::size_t{h} * a.head_stride;
  for (std::uint32_t x = threadIdx.x; x < a.head_dim; x += fold_threads) {
    if (a.clear) {
      hi_row[x] = f16{0};
      lo_row[x] = f16{0};
      continue;
    }
    f16 hi = a.fresh ? f16{0xFC00u} : hi_row[x];  // -inf
    f16 lo = a.fresh ? f16{0x7C00u} : lo_row[x];  // +inf
    fold_dim(hi, lo, keys + x, a.token_stride, a.count);
    hi_row[x] = hi;
    lo_row[x] = lo;
  }
  if (h == 0 && threadIdx.x == 0) {
    a.tokens[a.entry] = a.new_tokens;
  }
}

}  // namespace oasiskv::cuda::detail
