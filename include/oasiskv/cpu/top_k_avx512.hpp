// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The AVX-512 top-k kernel (see `top_k.hpp`): `keep_top_scalar` with 16 candidates per
//! step, vector compares and compress-stores. Compiled with `OASISKV_TARGET_AVX512`, chosen at
//! run time.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/cpu/math_avx512.hpp"

#if OASISKV_X86_KERNELS

#include "oasiskv/cpu/kernel_begin.hpp"

namespace oasiskv::cpu::detail {

// 16 candidates from i (fewer at the tail: `valid`), NaN as +inf; lanes not valid are -inf.
OASISKV_TARGET_AVX512 inline __m512 load_ranked(const float* cand, std::uint32_t i,
                                                __mmask16 valid) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-inf), valid, cand + i);
  return _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_ps(inf));
}

// keep_top_scalar with 16 candidates per step. The lower bound of the k-th highest score is
// the least maximum of 16 x c disjoint groups (c chunks of s vectors; a group is one lane of
// a chunk), c the fewest giving at least k groups. The pool is built by compress-stores and
// the kept indices by compressing an index vector. `pool_buf` is the caller's scratch.
OASISKV_TARGET_AVX512 inline void keep_top_avx512(const float* cand, std::uint32_t m,
                                                  std::uint32_t k, std::uint32_t base,
                                                  std::vector<float>& pool_buf,
                                                  std::vector<std::uint32_t>& out) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  __m512 lower = _mm512_set1_ps(-inf);
  if (std::uint64_t{k} * 8 <= m) {
    const std::uint32_t chunks = (k + 15) / 16;
    const std::uint32_t s = m / (16 * chunks);  // vectors per chunk
    if (s > 0) {
      __m512 least = _mm512_set1_ps(inf);
      for (std::uint32_t c = 0; c < chunks; ++c) {
        __m512 top = _mm512_set1_ps(-inf);
        for (std::uint32_t v = 0; v < s; ++v) {
          top = _mm512_max_ps(top, load_ranked(cand, (c * s + v) * 16, 0xffff));
        }
        least = _mm512_min_ps(least, top);
      }
      lower = _mm512_set1_ps(_mm512_reduce_min_ps(least));
    }
  }
  pool_buf.resize(std::size_t{m} + 16);  // a full vector may be stored at the last position
  float* pool = pool_buf.data();
  std::uint32_t pooled = 0;
  for (std::uint32_t i = 0; i < m; i += 16) {
    const __mmask16 valid = tail16(i, m);
    const __m512 v = load_ranked(cand, i, valid);
    const __mmask16 in = _mm512_mask_cmp_ps_mask(valid, v, lower, _CMP_GE_OQ);
    _mm512_storeu_ps(pool + pooled, _mm512_maskz_compress_ps(in, v));
    pooled += static_cast<std::uint32_t>(__builtin_popcount(in));
  }
  std::nth_element(pool, pool + (k - 1), pool + pooled, std::greater<float>());
  const float threshold = pool[k - 1];
  const __m512 thr = _mm512_set1_ps(threshold);
  std::uint32_t above = 0;
  for (std::uint32_t i = 0; i + 1 < k; i += 16) {
    const __mmask16 valid = tail16(i, k - 1);
    const __m512 v = _mm512_maskz_loadu_ps(valid, pool + i);
    above += static_cast<std::uint32_t>(
        __builtin_popcount(_mm512_mask_cmp_ps_mask(valid, v, thr, _CMP_GT_OQ)));
  }
  // Every block above the threshold, and the first `k - above` equal to it.
  std::uint32_t ties = k - above;
  const std::size_t at = out.size();
  out.resize(at + m + 16);  // room for any candidate and a full last vector; trimmed
  std::uint32_t* dst = out.data() + at;
  std::uint32_t kept = 0;
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (std::uint32_t i = 0; i < m; i += 16) {
    const __mmask16 valid = tail16(i, m);
    const __m512 v = load_ranked(cand, i, valid);
    __mmask16 keep = _mm512_mask_cmp_ps_mask(valid, v, thr, _CMP_GT_OQ);
    unsigned eq = _mm512_mask_cmp_ps_mask(valid, v, thr, _CMP_EQ_OQ);
    while (eq != 0 && ties > 0) {  // the lowest lanes equal to the threshold, while any remain
      const unsigned lowest = eq & (0u - eq);
      keep = static_cast<__mmask16>(keep | lowest);
      eq ^= lowest;
      --ties;
    }
    const __m512i idx = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(base + i)));
    _mm512_storeu_si512(dst + kept, _mm512_maskz_compress_epi32(keep, idx));
    kept += static_cast<std::uint32_t>(__builtin_popcount(keep));
  }
  out.resize(at + kept);
}

}  // namespace oasiskv::cpu::detail

#include "oasiskv/cpu/kernel_end.hpp"
#endif  // OASISKV_X86_KERNELS
