// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The per-element math of `cuda::device_quantized_minmax_summary` and of its scoring in
//! `cuda::topk_selector`, as `__host__ __device__` functions: the host's
//! `quantized_minmax_summary` rules (power-of-two scale, outward quantization, exact rescale,
//! `||A||_2` rounded up, u8 query codes and their error term), written so that the host and the
//! device compute the same bits. The kernels call exactly these functions, so running them on the
//! host checks the kernels' arithmetic without a device
//! (`tests/cuda/device_qminmax_summary.test.cu`).
//!
//! Bit-exactness: every quotient by a power-of-two scale is exact, the code magnitudes' squares
//! are summed as integers (the host's double sum of `(m 2^e)^2` is exact too), and the few f32 /
//! f64 operations whose rounding matters use the `_rn` intrinsics on the device, so nvcc cannot
//! contract them into FMAs. Built without `-ftz=true` / `--use_fast_math` (subnormal f32 keys
//! must not be flushed).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "oasiskv/config.hpp"
#include "oasiskv/core/dtype.hpp"

namespace oasiskv::cuda::detail {

//! The exponent of a fresh entry's scale (`2^-126`, the least normal f32), as the host's.
inline constexpr int qminmax_min_exponent = -126;

//! `2^e` as f32 for `e` in [-126, 127], `+inf` above (`std::ldexp(1.0f, e)` over that range).
OASISKV_HOST_DEVICE float qminmax_pow2f(int e) {
  return e > 127 ? oasiskv::detail::bit_cast<float>(0x7f800000u)
                 : oasiskv::detail::bit_cast<float>(static_cast<std::uint32_t>(e + 127) << 23);
}

//! The exponent of a normal power of two (`std::ilogb` of a scale).
OASISKV_HOST_DEVICE int qminmax_exponent_of(float s) {
  return static_cast<int>((oasiskv::detail::bit_cast<std::uint32_t>(s) >> 23) & 0xffu) - 127;
}

//! The least float at or above `v` (the host's `round_up`: nearest, one ulp up if below `v`).
OASISKV_HOST_DEVICE float qminmax_round_up(double v) {
  const float f = static_cast<float>(v);
  if (!(static_cast<double>(f) < v)) {
    return f;
  }
  if (f == 0.0f) {
    return oasiskv::detail::bit_cast<float>(0x00000001u);  // nextafter(+-0, +inf)
  }
  const std::uint32_t u = oasiskv::detail::bit_cast<std::uint32_t>(f);
  return oasiskv::detail::bit_cast<float>((u & 0x80000000u) ? u - 1u : u + 1u);
}

//! Folds one key element `v` into the new keys' bounds of its dimension (`hi`, `lo`) and the
//! largest finite magnitude `mag`, with the host's rule: an infinite key is left out and marks
//! the entry (`overflow`), a NaN changes nothing.
OASISKV_HOST_DEVICE void qminmax_take_key(float v, float& hi, float& lo, float& mag,
                                          bool& overflow) {
  const float a = fabsf(v);
  if (a == INFINITY) {
    overflow = true;
    return;
  }
  hi = v > hi ? v : hi;
  lo = v < lo ? v : lo;
  mag = mag < a ? a : mag;  // std::max(mag, a): a NaN leaves mag
}

//! The least exponent `e >= from` with `mag <= 127 * 2^e` (the host's loop; `from` is the
//! entry's exponent, `qminmax_min_exponent` for a fresh entry).
OASISKV_HOST_DEVICE int qminmax_exponent(float mag, int from) {
  int e = from;
  while (mag > 127.0f * qminmax_pow2f(e)) {
    ++e;
  }
  return e;
}

//! A maximum code at a scale `2^k` times larger: `ceil(c / 2^k)` (`k` at most 31).
OASISKV_HOST_DEVICE std::int32_t qminmax_rescale_max(std::int32_t c, int k) {
  return -((-c) >> k);
}
//! A minimum code at a scale `2^k` times larger: `floor(c / 2^k)` (`k` at most 31).
OASISKV_HOST_DEVICE std::int32_t qminmax_rescale_min(std::int32_t c, int k) {
  return c >> k;
}

//! Merges a dimension's new bounds (`hi`, `lo`; `hi < lo` when no finite key reached it) into
//! its codes at scale `s`: `c_hi = max(c_hi, ceil(hi / s))`, `c_lo = min(c_lo, floor(lo / s))`.
//! The quotients are exact (`s` is a power of two, `|bound| <= 127 s`).
OASISKV_HOST_DEVICE void qminmax_quantize(float hi, float lo, float s, std::int32_t& c_hi,
                                          std::int32_t& c_lo) {
  if (hi >= lo) {
    const auto up = static_cast<std::int32_t>(ceilf(hi / s));
    const auto down = static_cast<std::int32_t>(floorf(lo / s));
    c_hi = c_hi < up ? up : c_hi;
    c_lo = down < c_lo ? down : c_lo;
  }
}

//! A dimension's contribution to `||A||_2^2 / 4^e`: `max(|c_hi|, |c_lo|)^2`.
OASISKV_HOST_DEVICE std::uint32_t qminmax_square(std::int32_t c_hi, std::int32_t c_lo) {
  const std::int32_t a = c_hi < 0 ? -c_hi : c_hi;
  const std::int32_t b = c_lo < 0 ? -c_lo : c_lo;
  const auto m = static_cast<std::uint32_t>(a < b ? b : a);
  return m * m;
}

//! `||A||_2` rounded up to f32 from the summed squares of the code magnitudes at scale `2^e`:
//! `round_up(sqrt(sum 4^e) (1 + 2^-40))`, the bits of the host's `fold`.
OASISKV_HOST_DEVICE float qminmax_norm(std::uint64_t sum_sq, int e) {
  const double sq = ldexp(static_cast<double>(sum_sq), 2 * e);
#if defined(__CUDA_ARCH__)
  return qminmax_round_up(__dmul_rn(__dsqrt_rn(sq), 1.0 + 0x1p-40));
#else
  return qminmax_round_up(sqrt(sq) * (1.0 + 0x1p-40));
#endif
}

//! One code word: the int8 codes `c_hi(2p)`, `-c_lo(2p)`, `c_hi(2p+1)`, `-c_lo(2p+1)` in bytes
//! 0-3 (the host's `bound_words` format).
OASISKV_HOST_DEVICE std::uint32_t qminmax_pack(std::int32_t hi0, std::int32_t lo0, std::int32_t hi1,
                                               std::int32_t lo1) {
  return (static_cast<std::uint32_t>(hi0) & 0xffu) |
         ((static_cast<std::uint32_t>(-lo0) & 0xffu) << 8) |
         ((static_cast<std::uint32_t>(hi1) & 0xffu) << 16) |
         ((static_cast<std::uint32_t>(-lo1) & 0xffu) << 24);
}
//! The maximum code of byte `k` (0 or 2) of a code word.
OASISKV_HOST_DEVICE std::int32_t qminmax_word_max(std::uint32_t w, int k) {
  return static_cast<std::int8_t>(static_cast<std::uint8_t>(w >> (8 * k)));
}
//! The minimum code of byte `k + 1` (k = 0 or 2) of a code word (stored negated).
OASISKV_HOST_DEVICE std::int32_t qminmax_word_min(std::uint32_t w, int k) {
  return -static_cast<std::int32_t>(
      static_cast<std::int8_t>(static_cast<std::uint8_t>(w >> (8 * k + 8))));
}

//! Quantizes one query row `q` (`d` floats) as the host's scoring does: `words[p]` (`d / 2`)
//! holds the u8 codes `q+(2p)`, `|q-(2p)|`, `q+(2p+1)`, `|q-(2p+1)|`, with `q_x ~ t u_x`,
//! `t = max|q| / 255`, `u = min(255, rint(|q_x| 255 / max|q|))`; `slack` = `||q - t u||_2`
//! (summed in f64 in dimension order) rounded up.
OASISKV_HOST_DEVICE void qminmax_quantize_query(const float* q, std::uint32_t d,
                                                std::uint32_t* words, float& t, float& slack) {
  float m = 0.0f;
  for (std::uint32_t x = 0; x < d; ++x) {
    const float a = fabsf(q[x]);
    m = m < a ? a : m;
  }
#if defined(__CUDA_ARCH__)
  t = __fdiv_rn(m, 255.0f);
  const float inv = m > 0.0f ? __fdiv_rn(255.0f, m) : 0.0f;
#else
  t = m / 255.0f;
  const float inv = m > 0.0f ? 255.0f / m : 0.0f;
#endif
  double err = 0.0;
  for (std::uint32_t p = 0; p < d / 2; ++p) {
    std::uint32_t w = 0;
    for (std::uint32_t k = 0; k < 2; ++k) {
      const float v = q[2 * p + k];
#if defined(__CUDA_ARCH__)
      const float r = rintf(__fmul_rn(fabsf(v), inv));
#else
      const float r = rintf(fabsf(v) * inv);
#endif
      const auto u = static_cast<std::uint32_t>(r < 255.0f ? r : 255.0f);
#if defined(__CUDA_ARCH__)
      const double e = __dsub_rn(fabs(static_cast<double>(v)),
                                 __dmul_rn(static_cast<double>(t), static_cast<double>(u)));
      err = __dadd_rn(err, __dmul_rn(e, e));
#else
      const double e = fabs(static_cast<double>(v)) - static_cast<double>(t) * u;
      err += e * e;
#endif
      w |= (v > 0.0f ? u : u << 8) << (16 * k);
    }
    words[p] = w;
  }
#if defined(__CUDA_ARCH__)
  slack = qminmax_round_up(__dmul_rn(__dsqrt_rn(err), 1.0 + 0x1p-40));
#else
  slack = qminmax_round_up(sqrt(err) * (1.0 + 0x1p-40));
#endif
}

//! `acc` plus the four byte products of a query word (u8) and a code word (s8): `dp4a` on the
//! device, the same integers on the host.
OASISKV_HOST_DEVICE std::int32_t qminmax_dot4(std::uint32_t q, std::uint32_t c, std::int32_t acc) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 610
  std::int32_t out;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(out) : "r"(q), "r"(c), "r"(acc));
  return out;
#else
  for (int k = 0; k < 4; ++k) {
    acc += static_cast<std::int32_t>((q >> (8 * k)) & 0xffu) *
           static_cast<std::int32_t>(
               static_cast<std::int8_t>(static_cast<std::uint8_t>(c >> (8 * k))));
  }
  return acc;
#endif
}

//! The score of one (query row, entry): `dot * (scale * t) + norm * slack + bias`, in the host
//! epilogue's order (no contraction on the device; the host's vector kernel may fuse, so the two
//! agree to f32 rounding).
OASISKV_HOST_DEVICE float qminmax_score(std::int32_t dot, float scale, float t, float norm,
                                        float slack, float bias) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(
      __fadd_rn(__fmul_rn(static_cast<float>(dot), __fmul_rn(scale, t)), __fmul_rn(norm, slack)),
      bias);
#else
  return (static_cast<float>(dot) * (scale * t) + norm * slack) + bias;
#endif
}

}  // namespace oasiskv::cuda::detail
