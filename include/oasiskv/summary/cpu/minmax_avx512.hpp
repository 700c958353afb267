// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The AVX-512 min/max tile scoring kernel (see `minmax_layout.hpp`): per row group, one
//! 16-lane multiply-add per (row, dimension), the dimensions visited by sign pattern, the next
//! tile prefetched. Compiled with `OASISKV_TARGET_AVX512`, chosen at run time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/cpu/math_avx512.hpp"
#include "oasiskv/summary/cpu/minmax_layout.hpp"
#include "oasiskv/summary/cpu/tiles.hpp"

#if OASISKV_X86_KERNELS

#include "oasiskv/cpu/kernel_begin.hpp"

namespace oasiskv::cpu::detail {

// The maximum and minimum of one dimension of a tile (at `t`, its 16 entries), widened to f32.
OASISKV_TARGET_AVX512 inline void load_bounds16(const float* t, __m512& mx, __m512& mn) {
  mx = _mm512_loadu_ps(t);
  mn = _mm512_loadu_ps(t + 16);
}
OASISKV_TARGET_AVX512 inline void load_bounds16(const f16* t, __m512& mx, __m512& mn) {
  mx = load16(t);
  mn = load16(t + 16);
}
OASISKV_TARGET_AVX512 inline void load_bounds16(const bf16* t, __m512& mx, __m512& mn) {
  const __m512i w = _mm512_loadu_si512(t);
  mx = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, w, 16));
  mn = _mm512_castsi512_ps(
      _mm512_maskz_and_epi32(0xffff, w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// One bound of the dimension at element `at` of a tile (0 = max, 1 = min), widened to f32.
template <int Which>
OASISKV_TARGET_AVX512 inline __m512 load_bound16(const float* t) {
  return _mm512_loadu_ps(t + Which * 16);
}
template <int Which>
OASISKV_TARGET_AVX512 inline __m512 load_bound16(const f16* t) {
  return load16(t + Which * 16);
}
template <int Which>
OASISKV_TARGET_AVX512 inline __m512 load_bound16(const bf16* t) {
  __m512 mx, mn;
  load_bounds16(t, mx, mn);
  return Which == 0 ? mx : mn;
}

// Position i of a group's order, of sign pattern P (bit r set: row r of the group is negative
// there), into acc[K][row]. Every row meets the same bound of the dimension when P is 0 or all
// ones, so only that one is widened; a row takes one multiply-add (q+ . max + q- . min has one
// zero term). `pf` walks the next tile, a dimension per position: in a decode loop the
// summaries are evicted from L2 between calls, and this tile's order is not sequential.
template <int R, unsigned P, int K, class S>
[[gnu::always_inline]] OASISKV_TARGET_AVX512 inline void minmax_step_avx512(
    const S* tile, const minmax_row_group& g, std::uint32_t i, const S*& pf, __m512 (&acc)[2][R]) {
  constexpr unsigned all = (1u << R) - 1;
  _mm_prefetch(reinterpret_cast<const char*>(pf), _MM_HINT_T0);
  if constexpr (sizeof(S) == 4) {
    _mm_prefetch(reinterpret_cast<const char*>(pf + 16), _MM_HINT_T0);
  }
  pf += 2 * minmax_tile_lanes;
  const S* t = tile + g.at[i];
  __m512 mx = _mm512_setzero_ps(), mn = _mm512_setzero_ps();
  if constexpr (P == 0) {
    mx = load_bound16<0>(t);
  } else if constexpr (P == all) {
    mn = load_bound16<1>(t);
  } else {
    load_bounds16(t, mx, mn);
  }
  const float* q = g.q + std::size_t{i} * minmax_group_rows;
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    acc[K][r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r]), ((P >> r) & 1u) != 0 ? mn : mx, acc[K][r]);
  }
}

// The positions of sign pattern P, alternating between the two accumulator sets.
template <int R, unsigned P, class S>
[[gnu::always_inline]] OASISKV_TARGET_AVX512 inline void minmax_pattern_avx512(
    const S* tile, const minmax_row_group& g, const S*& pf, __m512 (&acc)[2][R]) {
  const std::uint32_t i1 = g.begin[P + 1];
  std::uint32_t i = g.begin[P];
  for (; i + 2 <= i1; i += 2) {
    minmax_step_avx512<R, P, 0>(tile, g, i, pf, acc);
    minmax_step_avx512<R, P, 1>(tile, g, i + 1, pf, acc);
  }
  if (i < i1) {
    minmax_step_avx512<R, P, 0>(tile, g, i, pf, acc);
  }
}

template <int R, class S, unsigned... P>
[[gnu::always_inline]] OASISKV_TARGET_AVX512 inline void minmax_patterns_avx512(
    const S* tile, const minmax_row_group& g, const S* pf, __m512 (&acc)[2][R],
    std::integer_sequence<unsigned, P...>) {
  (minmax_pattern_avx512<R, P>(tile, g, pf, acc), ...);
}

// The R rows of group `g` against the 16 entries of a tile: res[r * 16 + lane].
template <int R, class S>
OASISKV_TARGET_AVX512 inline void minmax_tile_avx512(const S* tile, const float* bias,
                                                     std::uint32_t d, const minmax_row_group& g,
                                                     float* res) {
  __m512 acc[2][R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    acc[0][r] = _mm512_setzero_ps();
    acc[1][r] = _mm512_setzero_ps();
  }
  minmax_patterns_avx512<R>(tile, g, tile + std::size_t{2} * d * minmax_tile_lanes, acc,
                            std::make_integer_sequence<unsigned, 1u << R>{});
  const __m512 bv = _mm512_loadu_ps(bias);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(res + 16 * r, _mm512_add_ps(_mm512_add_ps(acc[0][r], acc[1][r]), bv));
  }
}

// The rows of one run of `count` consecutive lanes of a tile, a row group at a time.
template <class S>
OASISKV_TARGET_AVX512 void minmax_run_avx512(const S* tile, const float* bias, std::uint32_t d,
                                             std::uint32_t lane0, std::uint32_t count,
                                             std::span<const minmax_row_group> groups,
                                             const score_sink& out, std::size_t i0) {
  alignas(64) float res[minmax_group_rows * 16];
  for (const minmax_row_group& g : groups) {
    switch (g.rows) {
      case 4:
        minmax_tile_avx512<4>(tile, bias, d, g, res);
        break;
      case 3:
        minmax_tile_avx512<3>(tile, bias, d, g, res);
        break;
      case 2:
        minmax_tile_avx512<2>(tile, bias, d, g, res);
        break;
      default:
        minmax_tile_avx512<1>(tile, bias, d, g, res);
        break;
    }
    out.put(res, 16, lane0, count, g.first, g.rows, i0);
  }
}

}  // namespace oasiskv::cpu::detail

#include "oasiskv/cpu/kernel_end.hpp"
#endif  // OASISKV_X86_KERNELS
