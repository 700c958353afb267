// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The portable scoring kernel of `quantized_minmax_summary` (tiles:
//! `qminmax_layout.hpp`): the integer dot products of u8 query codes with the int8 (max, -min)
//! codes, and the f32 epilogue. Plain C++ for machines without AVX512_VNNI, the same integers
//! as the VNNI kernel.
#pragma once

#include <cstddef>
#include <cstdint>

#include "oasiskv/summary/cpu/qminmax_layout.hpp"
#include "oasiskv/summary/cpu/tiles.hpp"

namespace oasiskv::cpu::detail {

// The integer dot products of R query rows (`qw`, [R][d / 2] words of 4 u8) with a tile.
inline void qminmax_lanes_scalar(const std::int8_t* tile, std::uint32_t d, std::uint32_t lane,
                                 const std::uint32_t* qw, std::uint32_t n, std::int32_t* acc) {
  for (std::uint32_t r = 0; r < n; ++r) {
    std::int32_t a = 0;
    for (std::uint32_t p = 0; p < d / 2; ++p) {
      const std::uint32_t w = qw[std::size_t{r} * (d / 2) + p];
      const std::int8_t* c = tile + (std::size_t{p} * qminmax_lanes + lane) * 4;
      for (std::uint32_t k = 0; k < 4; ++k) {
        a += static_cast<std::int32_t>((w >> (8 * k)) & 0xffu) * c[k];
      }
    }
    acc[r] = a;
  }
}

inline void qminmax_run_scalar(const std::int8_t* tile, const float* scale, const float* norm,
                               const float* bias, std::uint32_t d, std::uint32_t lane0,
                               std::uint32_t count, const std::uint32_t* qw, const float* t,
                               const float* slack, std::uint32_t n, const score_sink& out,
                               std::size_t i0) {
  for (std::uint32_t r0 = 0; r0 < n; r0 += 8) {
    const std::uint32_t rows = n - r0 < 8 ? n - r0 : 8;
    for (std::uint32_t k = 0; k < count; ++k) {
      std::int32_t acc[8];
      qminmax_lanes_scalar(tile, d, lane0 + k, qw + std::size_t{r0} * (d / 2), rows, acc);
      for (std::uint32_t r = 0; r < rows; ++r) {
        out.at(i0 + k, r0 + r) = (static_cast<float>(acc[r]) * (scale[lane0 + k] * t[r0 + r]) +
                                  norm[lane0 + k] * slack[r0 + r]) +
                                 bias[lane0 + k];
      }
    }
  }
}

}  // namespace oasiskv::cpu::detail
