// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The code layout of `quantized_key_summary` that its scoring kernels share: int8 or
//! int4 codes of every key element, 16 tokens per lane group, and a scale per token.
#pragma once

#include <cstddef>
#include <cstdint>

namespace oasiskv::cpu::detail {

// Tokens are stored in lanes of 16 (codes of one dimension for 16 tokens: 16 bytes in int8, 8
// in int4), so one dimension of a lane group widens to two vectors of 8 floats.
inline constexpr std::uint32_t qkey_lanes = 16;

// Per-token scale sentinels: a token not (yet) folded in, and a token whose key is not finite.
inline constexpr float qkey_absent = -1.0f;

// Code of dimension `x`, token `t` in one (entry, KV head)'s `codes`: `[head_dim][tp]` int8, or
// `[head_dim][tp / 2]` bytes of two int4 codes (token 2i in the low nibble) for Bits == 4.
template <int Bits>
inline std::int32_t qkey_code(const std::uint8_t* codes, std::uint32_t tp, std::uint32_t x,
                              std::uint32_t t) noexcept {
  if constexpr (Bits == 8) {
    return static_cast<std::int8_t>(codes[std::size_t{x} * tp + t]);
  } else {
    const std::uint32_t byte = codes[std::size_t{x} * (tp / 2) + t / 2];
    const std::uint32_t nib = (t % 2 == 0 ? byte : byte >> 4) & 0xfu;
    return static_cast<std::int32_t>(nib ^ 8u) - 8;
  }
}

}  // namespace oasiskv::cpu::detail
