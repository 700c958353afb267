// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The AVX2 min/max tile scoring kernel (see `minmax_layout.hpp`): the AVX-512 kernel's
//! scheme on two halves of 8 lanes. Compiled with `OASISKV_TARGET_AVX2`, chosen at run time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <utility>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/cpu/math_avx2.hpp"
#include "oasiskv/summary/cpu/minmax_layout.hpp"
#include "oasiskv/summary/cpu/tiles.hpp"

#if OASISKV_X86_KERNELS

#include "oasiskv/cpu/kernel_begin.hpp"

namespace oasiskv::cpu::detail {

// The maximum and minimum of lanes [8 * half, 8 * half + 8) of one dimension of a tile (at `t`).
OASISKV_TARGET_AVX2 inline void load_bounds8(const float* t, std::uint32_t half, __m256& mx,
                                             __m256& mn) {
  mx = _mm256_loadu_ps(t + half * 8);
  mn = _mm256_loadu_ps(t + 16 + half * 8);
}
OASISKV_TARGET_AVX2 inline void load_bounds8(const f16* t, std::uint32_t half, __m256& mx,
                                             __m256& mn) {
  mx = load8(t + half * 8);
  mn = load8(t + 16 + half * 8);
}
OASISKV_TARGET_AVX2 inline void load_bounds8(const bf16* t, std::uint32_t half, __m256& mx,
                                             __m256& mn) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + half * 16));
  mx = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  mn = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// One bound (0 = max, 1 = min) of lanes [8 * half, 8 * half + 8) of the dimension at `t`.
template <int Which, class S>
OASISKV_TARGET_AVX2 inline __m256 load_bound8(const S* t, std::uint32_t half) {
  if constexpr (std::is_same_v<S, bf16>) {
    __m256 mx, mn;
    load_bounds8(t, half, mx, mn);
    return Which == 0 ? mx : mn;
  } else {
    return load8(t + Which * 16 + half * 8);
  }
}

// The AVX2 form of minmax_pattern_avx512: both halves of the tile, acc[half][row].
template <int R, unsigned P, class S>
[[gnu::always_inline]] OASISKV_TARGET_AVX2 inline void minmax_pattern_avx2(
    const S* tile, const minmax_row_group& g, __m256 (&acc)[2][R]) {
  constexpr unsigned all = (1u << R) - 1;
  const std::uint32_t i1 = g.begin[P + 1];
  for (std::uint32_t i = g.begin[P]; i < i1; ++i) {
    const S* t = tile + g.at[i];
    __m256 mx[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256 mn[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
#pragma GCC unroll 2
    for (std::uint32_t h = 0; h < 2; ++h) {
      if constexpr (P == 0) {
        mx[h] = load_bound8<0>(t, h);
      } else if constexpr (P == all) {
        mn[h] = load_bound8<1>(t, h);
      } else {
        load_bounds8(t, h, mx[h], mn[h]);
      }
    }
    const float* q = g.q + std::size_t{i} * minmax_group_rows;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 qv = _mm256_set1_ps(q[r]);
      const bool neg = ((P >> r) & 1u) != 0;
      acc[0][r] = _mm256_fmadd_ps(qv, neg ? mn[0] : mx[0], acc[0][r]);
      acc[1][r] = _mm256_fmadd_ps(qv, neg ? mn[1] : mx[1], acc[1][r]);
    }
  }
}

template <int R, class S, unsigned... P>
[[gnu::always_inline]] OASISKV_TARGET_AVX2 inline void minmax_patterns_avx2(
    const S* tile, const minmax_row_group& g, __m256 (&acc)[2][R],
    std::integer_sequence<unsigned, P...>) {
  (minmax_pattern_avx2<R, P>(tile, g, acc), ...);
}

// The R rows of group `g` against the 16 entries of a tile: res[r * 16 + lane].
template <int R, class S>
OASISKV_TARGET_AVX2 inline void minmax_tile_avx2(const S* tile, const float* bias,
                                                 const minmax_row_group& g, float* res) {
  __m256 acc[2][R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    acc[0][r] = _mm256_setzero_ps();
    acc[1][r] = _mm256_setzero_ps();
  }
  minmax_patterns_avx2<R>(tile, g, acc, std::make_integer_sequence<unsigned, 1u << R>{});
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(res + 16 * r, _mm256_add_ps(acc[0][r], _mm256_loadu_ps(bias)));
    _mm256_storeu_ps(res + 16 * r + 8, _mm256_add_ps(acc[1][r], _mm256_loadu_ps(bias + 8)));
  }
}

template <class S>
OASISKV_TARGET_AVX2 void minmax_run_avx2(const S* tile, const float* bias, std::uint32_t lane0,
                                         std::uint32_t count,
                                         std::span<const minmax_row_group> groups,
                                         const score_sink& out, std::size_t i0) {
  alignas(32) float res[minmax_group_rows * 16];
  for (const minmax_row_group& g : groups) {
    switch (g.rows) {
      case 4:
        minmax_tile_avx2<4>(tile, bias, g, res);
        break;
      case 3:
        minmax_tile_avx2<3>(tile, bias, g, res);
        break;
      case 2:
        minmax_tile_avx2<2>(tile, bias, g, res);
        break;
      default:
        minmax_tile_avx2<1>(tile, bias, g, res);
        break;
    }
    out.put(res, 16, lane0, count, g.first, g.rows, i0);
  }
}

}  // namespace oasiskv::cpu::detail

#include "oasiskv/cpu/kernel_end.hpp"
#endif  // OASISKV_X86_KERNELS
