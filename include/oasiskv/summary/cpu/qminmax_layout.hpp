// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The tile layout of `quantized_minmax_summary` that its scoring kernels share.
#pragma once

#include <cstddef>
#include <cstdint>

namespace oasiskv::cpu::detail {

// Tiles of 16 entries: [dimension pair p][lane][max_2p, -min_2p, max_2p+1, -min_2p+1] int8, the
// operand shape of vpdpbusd: one instruction multiplies both bounds of two dimensions of 16
// entries by the matching query bytes (q+ codes, |q-| codes) and sums the four products.
inline constexpr std::uint32_t qminmax_lanes = 16;

inline std::size_t qminmax_at(std::uint32_t x, std::uint32_t which, std::uint32_t lane) noexcept {
  return (std::size_t{x / 2} * qminmax_lanes + lane) * 4 + (x % 2) * 2 + which;
}

}  // namespace oasiskv::cpu::detail
