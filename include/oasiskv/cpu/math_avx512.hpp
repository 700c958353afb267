// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The AVX-512 (F/BW/DQ/VL) paths of the shared SIMD math (dispatched by `math.hpp`):
//! 16-lane f32 / f16 / bf16 loads, the tiled entry dot products, the `exp` polynomial, the
//! softmax helpers with masked tails, and entry-id statistics. Compiled with
//! `OASISKV_TARGET_AVX512`, chosen at run time.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/cpu/math_avx2.hpp"
#include "oasiskv/cpu/math_scalar.hpp"

#if OASISKV_X86_KERNELS

#include "oasiskv/cpu/kernel_begin.hpp"

namespace oasiskv::cpu::detail {

OASISKV_TARGET_AVX512 inline __m512 load16(const float* p) {
  return _mm512_loadu_ps(p);
}
OASISKV_TARGET_AVX512 inline __m512 load16(const f16* p) {
  return _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
OASISKV_TARGET_AVX512 inline __m512 load16(const bf16* p) {
  const __m512i w =
      _mm512_maskz_cvtepu16_epi32(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, w, 16));
}
// The 8-element tail of a row whose length is 8 mod 16; the upper lanes are zero.
OASISKV_TARGET_AVX512 inline __m512 load8_zext(const float* p) {
  return _mm512_maskz_loadu_ps(0x00ff, p);
}
OASISKV_TARGET_AVX512 inline __m512 load8_zext(const f16* p) {
  return _mm512_maskz_cvtph_ps(
      0xffff, _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
OASISKV_TARGET_AVX512 inline __m512 load8_zext(const bf16* p) {
  const __m512i w = _mm512_maskz_cvtepu16_epi32(
      0xffff, _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, w, 16));
}

// Writes the horizontal sums of R accumulators to out[0..R): for 4 and 8 rows a transposing
// add tree, which costs about a third of R separate reductions.
template <int R>
OASISKV_TARGET_AVX512 inline void reduce_store(const __m512* acc, float* out) {
  __m256 y[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    y[r] = _mm256_add_ps(
        _mm512_castps512_ps256(acc[r]),
        _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(0xff, _mm512_castps_pd(acc[r]), 1)));
  }
  if constexpr (R == 8) {
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(y[0], y[1]), _mm256_hadd_ps(y[2], y[3]));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(y[4], y[5]), _mm256_hadd_ps(y[6], y[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20),
                                        _mm256_permute2f128_ps(h0, h1, 0x31)));
  } else if constexpr (R == 4) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(y[0], y[1]), _mm256_hadd_ps(y[2], y[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  } else {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      out[r] = hsum8(y[r]);
    }
  }
}

// R query rows against one entry. Fewer than 8 rows keep two accumulators per row, so at
// least 8 independent FMA chains hide the FMA latency.
template <int R, class S>
OASISKV_TARGET_AVX512 inline void dot_tile_avx512(const S* v, const float* rows, std::uint32_t len,
                                                  float* out) {
  constexpr int split = R >= 8 ? 1 : 2;
  __m512 acc[split][R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc[0][r] = _mm512_setzero_ps();
    acc[split - 1][r] = _mm512_setzero_ps();
  }
  std::uint32_t x = 0;
  for (; x + 16 * split <= len; x += 16 * split) {
#pragma GCC unroll 2
    for (int k = 0; k < split; ++k) {
      const __m512 e = load16(v + x + 16 * k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        acc[k][r] = _mm512_fmadd_ps(
            _mm512_loadu_ps(rows + static_cast<std::size_t>(r) * len + x + 16 * k), e, acc[k][r]);
      }
    }
  }
  for (; x + 16 <= len; x += 16) {
    const __m512 e = load16(v + x);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      acc[0][r] = _mm512_fmadd_ps(_mm512_loadu_ps(rows + static_cast<std::size_t>(r) * len + x), e,
                                  acc[0][r]);
    }
  }
  if (x < len) {
    const __m512 e = load8_zext(v + x);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      acc[0][r] =
          _mm512_fmadd_ps(load8_zext(rows + static_cast<std::size_t>(r) * len + x), e, acc[0][r]);
    }
  }
  if constexpr (split == 2) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      acc[0][r] = _mm512_add_ps(acc[0][r], acc[1][r]);
    }
  }
  reduce_store<R>(acc[0], out);
}

template <class S>
OASISKV_TARGET_AVX512 void dot_entries_avx512(const S* base, std::size_t entry_stride,
                                              std::span<const std::uint32_t> ids, const float* rows,
                                              std::uint32_t n, std::uint32_t len, float* out) {
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const S* v = base + std::size_t{ids[i]} * entry_stride;
    if (i + 1 < ids.size()) {
      _mm_prefetch(reinterpret_cast<const char*>(base + std::size_t{ids[i + 1]} * entry_stride),
                   _MM_HINT_T0);
    }
    float* o = out + i * n;
    std::uint32_t r = 0;
    for (; r + 8 <= n; r += 8) {
      dot_tile_avx512<8>(v, rows + std::size_t{r} * len, len, o + r);
    }
    // The rest in one tile: GQA groups of 3 (SmolLM2) or 6 rows stay one pass over the entry.
    const float* rest = rows + std::size_t{r} * len;
    switch (n - r) {
      case 7:
        dot_tile_avx512<7>(v, rest, len, o + r);
        break;
      case 6:
        dot_tile_avx512<6>(v, rest, len, o + r);
        break;
      case 5:
        dot_tile_avx512<5>(v, rest, len, o + r);
        break;
      case 4:
        dot_tile_avx512<4>(v, rest, len, o + r);
        break;
      case 3:
        dot_tile_avx512<3>(v, rest, len, o + r);
        break;
      case 2:
        dot_tile_avx512<2>(v, rest, len, o + r);
        break;
      case 1:
        dot_tile_avx512<1>(v, rest, len, o + r);
        break;
      default:
        break;
    }
  }
}

// exp8_avx2 on 16 floats.
OASISKV_TARGET_AVX512 inline __m512 exp16_avx512(__m512 x) {
  x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3365478515625f));
  const __m512 fx = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, z, x), _mm512_set1_ps(1.0f));
  const __m512i e =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(0x7f)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

OASISKV_TARGET_AVX512 inline __mmask16 tail16(std::size_t i, std::size_t count) {
  return count - i >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (count - i)) - 1u);
}

// exp16_avx512, with 0 where the argument is below the clamp (-87.34: the exact result is
// below FLT_MIN). Blocks far below a row's maximum, such as the -inf of blocks a two-stage
// summary ruled out, then add exact zeros instead of subnormal products, each of which costs a
// microcode assist in the sums and in add_scaled.
OASISKV_TARGET_AVX512 inline __m512 exp16_normal(__m512 x) {
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3365478515625f), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(normal, exp16_avx512(x));
}

// 2^x of 16 floats x <= 0: x = n + f with |f| <= 1/2, a degree-7 Taylor polynomial of 2^f
// (relative error below 1e-8, under f32 rounding), then scalef by 2^n (which also flushes very
// negative x to 0). The attention kernels' exponential (their logits are in base 2).
OASISKV_TARGET_AVX512 inline __m512 exp2_16_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.525273380405984e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// exp(x) of 16 floats x <= 0 (NaN gives 0), 0 where the result would be below FLT_MIN (as
// exp16_normal, so that sums of them take no subnormal assists): exp2_16_nonpositive(x log2 e),
// half the operations of exp16_normal, for the epilogues that take one per scored key.
OASISKV_TARGET_AVX512 inline __m512 exp16_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(normal, exp2_16_nonpositive(t));
}

// The natural log of 16 positive normal floats, within a few ulp: x = 2^e m with m in [1, 2),
// log m = 2 atanh(t) with t = (m - 1) / (m + 1) <= 1/3, its odd series to t^13 (the next term is
// below 1e-8).
OASISKV_TARGET_AVX512 inline __m512 log16_avx512(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 e = _mm512_getexp_ps(x);
  const __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(m, one), _mm512_add_ps(m, one));
  const __m512 t2 = _mm512_mul_ps(t, t);
  __m512 p = _mm512_set1_ps(1.0f / 13);
  p = _mm512_fmadd_ps(p, t2, _mm512_set1_ps(1.0f / 11));
  p = _mm512_fmadd_ps(p, t2, _mm512_set1_ps(1.0f / 9));
  p = _mm512_fmadd_ps(p, t2, _mm512_set1_ps(1.0f / 7));
  p = _mm512_fmadd_ps(p, t2, _mm512_set1_ps(1.0f / 5));
  p = _mm512_fmadd_ps(p, t2, _mm512_set1_ps(1.0f / 3));
  p = _mm512_fmadd_ps(p, t2, one);
  const __m512 tt = _mm512_add_ps(t, t);
  return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693147180559945309f), _mm512_mul_ps(tt, p));
}

// The max (`Max`) or the sum of two registers.
template <bool Max>
OASISKV_TARGET_AVX512 inline __m512 max_or_add(__m512 a, __m512 b) {
  return Max ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b);
}

// The horizontal maxima (`Max`) or sums of 16 registers in one: lane r is v[r]'s. A transposing
// tree (in-lane unpacks, then 128-bit lane shuffles) of 15 operations and 30 shuffles, about a
// third of the work of 16 separate reductions.
template <bool Max>
OASISKV_TARGET_AVX512 inline __m512 transpose_reduce16(const __m512* v) {
  constexpr auto op = max_or_add<Max>;
  __m512 c[8], d[4];
  OASISKV_UNROLL(8)
  for (int k = 0; k < 8; ++k) {  // per 128-bit lane: [v2k 0+2, v2k+1 0+2, v2k 1+3, v2k+1 1+3]
    c[k] =
        op(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  }
  OASISKV_UNROLL(4)
  for (int j = 0; j < 4; ++j) {  // per 128-bit lane: v4j .. v4j+3, each over that lane
    const __m512d a = _mm512_castps_pd(c[2 * j]), b = _mm512_castps_pd(c[2 * j + 1]);
    d[j] =
        op(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 e0 =
      op(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
  const __m512 e1 =
      op(_mm512_shuffle_f32x4(d[2], d[3], 0x88), _mm512_shuffle_f32x4(d[2], d[3], 0xDD));
  return op(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD));
}

// exp_sum_avx2 16 at a time; the tail is masked (the polynomial too, not std::exp).
OASISKV_TARGET_AVX512 inline float exp_sum_avx512(const float* x, float m, std::size_t count,
                                                  float scale, float* out) {
  const __m512 s = _mm512_set1_ps(scale), mv = _mm512_set1_ps(m);
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  std::size_t i = 0;
  for (; i + 32 <= count; i += 32) {
    const __m512 e0 = exp16_normal(_mm512_mul_ps(s, _mm512_sub_ps(_mm512_loadu_ps(x + i), mv)));
    const __m512 e1 =
        exp16_normal(_mm512_mul_ps(s, _mm512_sub_ps(_mm512_loadu_ps(x + i + 16), mv)));
    _mm512_storeu_ps(out + i, e0);
    _mm512_storeu_ps(out + i + 16, e1);
    a0 = _mm512_add_ps(a0, e0);
    a1 = _mm512_add_ps(a1, e1);
  }
  for (; i < count; i += 16) {
    const __mmask16 k = tail16(i, count);
    const __m512 e =
        exp16_normal(_mm512_mul_ps(s, _mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), mv)));
    _mm512_mask_storeu_ps(out + i, k, e);
    a0 = _mm512_mask_add_ps(a0, k, a0, e);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

// argmax_scalar 16 at a time: each lane keeps its first largest value and that value's index;
// the lowest index among the lanes holding the overall largest wins.
OASISKV_TARGET_AVX512 inline std::size_t argmax_avx512(const float* x, std::size_t count) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m = ninf;
  __m512i at = _mm512_setzero_si512();
  __mmask16 seen = 0;  // lanes that have held a value (so -inf itself can be the answer)
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (std::size_t i = 0; i < count; i += 16) {
    const __mmask16 k = tail16(i, count);
    const __m512 v = _mm512_maskz_loadu_ps(k, x + i);
    // Greater, or equal in a lane not yet seen (a first -inf); NaN is neither.
    const __mmask16 take = static_cast<__mmask16>(
        k & (_mm512_cmp_ps_mask(v, m, _CMP_GT_OQ) |
             (static_cast<__mmask16>(~seen) & _mm512_cmp_ps_mask(v, m, _CMP_EQ_OQ))));
    m = _mm512_mask_mov_ps(m, take, v);
    at = _mm512_mask_mov_epi32(at, take, idx);
    seen = static_cast<__mmask16>(seen | take);
    idx = _mm512_add_epi32(idx, step);
  }
  if (seen == 0) {
    return 0;
  }
  const float best = _mm512_mask_reduce_max_ps(seen, m);
  const __mmask16 top =
      static_cast<__mmask16>(seen & _mm512_cmp_ps_mask(m, _mm512_set1_ps(best), _CMP_EQ_OQ));
  return static_cast<std::size_t>(
      static_cast<std::uint32_t>(_mm512_mask_reduce_min_epu32(top, at)));
}

// clamp_finite_max_avx2 16 at a time, with a masked tail.
OASISKV_TARGET_AVX512 inline float clamp_finite_max_avx512(const float* x, std::size_t count,
                                                           float* out) {
  constexpr float lim = std::numeric_limits<float>::max();
  const __m512 hi = _mm512_set1_ps(lim), lo = _mm512_set1_ps(-lim);
  __m512 m0 = lo, m1 = lo;
  std::size_t i = 0;
  for (; i + 32 <= count; i += 32) {
    // minps returns its second operand when either is NaN: NaN and +inf become lim.
    const __m512 v0 = _mm512_max_ps(_mm512_min_ps(_mm512_loadu_ps(x + i), hi), lo);
    const __m512 v1 = _mm512_max_ps(_mm512_min_ps(_mm512_loadu_ps(x + i + 16), hi), lo);
    _mm512_storeu_ps(out + i, v0);
    _mm512_storeu_ps(out + i + 16, v1);
    m0 = _mm512_max_ps(m0, v0);
    m1 = _mm512_max_ps(m1, v1);
  }
  for (; i < count; i += 16) {
    const __mmask16 k = tail16(i, count);
    const __m512 v = _mm512_max_ps(_mm512_min_ps(_mm512_maskz_loadu_ps(k, x + i), hi), lo);
    _mm512_mask_storeu_ps(out + i, k, v);
    m0 = _mm512_mask_max_ps(m0, k, m0, v);
  }
  return _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
}

// acc[i] += k * x[i], 16 at a time, with a masked tail.
OASISKV_TARGET_AVX512 inline void add_scaled_avx512(float* acc, const float* x, float k,
                                                    std::size_t count) {
  const __m512 kv = _mm512_set1_ps(k);
  for (std::size_t i = 0; i < count; i += 16) {
    const __mmask16 t = tail16(i, count);
    _mm512_mask_storeu_ps(
        acc + i, t,
        _mm512_fmadd_ps(kv, _mm512_maskz_loadu_ps(t, x + i), _mm512_maskz_loadu_ps(t, acc + i)));
  }
}

// One pass, 16 ids at a time (each beside its predecessor, loaded one id back).
OASISKV_TARGET_AVX512 inline entry_id_stats entry_id_stats_avx512(
    std::span<const std::uint32_t> ids) {
  const std::uint32_t* p = ids.data();
  const std::size_t n = ids.size();
  __m512i top = _mm512_setzero_si512();
  std::uint32_t steps = 0;
  const __m512i one = _mm512_set1_epi32(1);
  std::size_t i = 1;  // ids[i - 1] exists
  for (; i + 16 <= n; i += 16) {
    const __m512i v = _mm512_loadu_si512(p + i);
    const __m512i prev = _mm512_loadu_si512(p + i - 1);
    top = _mm512_max_epu32(top, v);
    steps += static_cast<std::uint32_t>(
        __builtin_popcount(_mm512_cmpeq_epi32_mask(v, _mm512_add_epi32(prev, one))));
  }
  std::uint32_t t = std::max(_mm512_reduce_max_epu32(top), p[0]);
  for (; i < n; ++i) {
    t = p[i] > t ? p[i] : t;
    steps += p[i] == p[i - 1] + 1 ? 1u : 0u;
  }
  return {t, steps};
}

}  // namespace oasiskv::cpu::detail

#include "oasiskv/cpu/kernel_end.hpp"
#endif  // OASISKV_X86_KERNELS
