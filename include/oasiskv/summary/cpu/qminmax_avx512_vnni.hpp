// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The AVX512_VNNI kernel of `quantized_minmax_summary` (tiles: `qminmax_layout.hpp`):
//! `vpdpbusd` multiplies both bounds of two dimensions of 16 entries by the query bytes per
//! instruction, up to 8 rows per pass, with the f32 epilogue in vectors of 16 entries. Compiled
//! with `OASISKV_TARGET_AVX512VNNI`, chosen at run time.
#pragma once

#include <cstddef>
#include <cstdint>

#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/summary/cpu/qminmax_layout.hpp"
#include "oasiskv/summary/cpu/tiles.hpp"

#if OASISKV_X86_KERNELS

#include "oasiskv/cpu/kernel_begin.hpp"

namespace oasiskv::cpu::detail {

template <int R>
OASISKV_TARGET_AVX512VNNI inline void qminmax_tile_avx512_vnni(const std::int8_t* tile,
                                                               std::uint32_t d,
                                                               const std::uint32_t* qw,
                                                               std::int32_t* acc_out) {
  __m512i acc[2][R];
  OASISKV_UNROLL(8)
  for (int r = 0; r < R; ++r) {
    acc[0][r] = _mm512_setzero_si512();
    acc[1][r] = _mm512_setzero_si512();
  }
  const std::uint32_t pairs = d / 2;  // even: head_dim is a multiple of 8
  for (std::uint32_t p = 0; p < pairs; p += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(tile + std::size_t{p + 8} * 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(tile + std::size_t{p + 9} * 64), _MM_HINT_T0);
    OASISKV_UNROLL(2)
    for (std::uint32_t k = 0; k < 2; ++k) {
      const __m512i c = _mm512_loadu_si512(tile + std::size_t{p + k} * 64);
      OASISKV_UNROLL(8)
      for (int r = 0; r < R; ++r) {
        const __m512i q = _mm512_set1_epi32(
            static_cast<int>(qw[std::size_t{pairs} * static_cast<std::size_t>(r) + p + k]));
        acc[k][r] = _mm512_dpbusd_epi32(acc[k][r], q, c);
      }
    }
  }
  OASISKV_UNROLL(8)
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_si512(acc_out + 16 * r, _mm512_add_epi32(acc[0][r], acc[1][r]));
  }
}

// Lanes [lane0, lane0 + count) of one tile, every row: entry i0 + k, row r of `out` =
// dot * (scale * t[r]) + slack[r] * norm + bias, the epilogue in vectors of 16 entries.
OASISKV_TARGET_AVX512VNNI inline void qminmax_run_avx512_vnni(
    const std::int8_t* tile, const float* scale, const float* norm, const float* bias,
    std::uint32_t d, std::uint32_t lane0, std::uint32_t count, const std::uint32_t* qw,
    const float* t, const float* slack, std::uint32_t n, const score_sink& out, std::size_t i0) {
  alignas(64) std::int32_t acc[8 * 16];
  alignas(64) float res[8 * 16];
  const __m512 sv = _mm512_loadu_ps(scale), nv = _mm512_loadu_ps(norm);
  const __m512 bv = _mm512_loadu_ps(bias);
  for (std::uint32_t r0 = 0; r0 < n; r0 += 8) {
    const std::uint32_t rows = n - r0 < 8 ? n - r0 : 8;
    const std::uint32_t* w = qw + std::size_t{r0} * (d / 2);
    switch (rows) {
      case 8:
        qminmax_tile_avx512_vnni<8>(tile, d, w, acc);
        break;
      case 7:
        qminmax_tile_avx512_vnni<7>(tile, d, w, acc);
        break;
      case 6:
        qminmax_tile_avx512_vnni<6>(tile, d, w, acc);
        break;
      case 5:
        qminmax_tile_avx512_vnni<5>(tile, d, w, acc);
        break;
      case 4:
        qminmax_tile_avx512_vnni<4>(tile, d, w, acc);
        break;
      case 3:
        qminmax_tile_avx512_vnni<3>(tile, d, w, acc);
        break;
      case 2:
        qminmax_tile_avx512_vnni<2>(tile, d, w, acc);
        break;
      default:
        qminmax_tile_avx512_vnni<1>(tile, d, w, acc);
        break;
    }
    for (std::uint32_t r = 0; r < rows; ++r) {
      const __m512 dot = _mm512_maskz_cvtepi32_ps(0xffff, _mm512_load_si512(acc + 16 * r));
      const __m512 v = _mm512_fmadd_ps(dot, _mm512_mul_ps(sv, _mm512_set1_ps(t[r0 + r])),
                                       _mm512_mul_ps(nv, _mm512_set1_ps(slack[r0 + r])));
      _mm512_store_ps(res + 16 * r, _mm512_add_ps(v, bv));
    }
    out.put(res, 16, lane0, count, r0, rows, i0);
  }
}

}  // namespace oasiskv::cpu::detail

#include "oasiskv/cpu/kernel_end.hpp"
#endif  // OASISKV_X86_KERNELS
