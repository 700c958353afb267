// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Integer dot products of the 32-element block formats (Q4_1, Q8_0) with activations
//! quantized to int8 per 32-element block, as llama.cpp computes them: the weights stay in
//! their stored bytes, each product is an int8 x (u)int8 dot (VNNI `vpdpbusd` on AVX-512,
//! `maddubs` on AVX2, a scalar reference) and the block scales are applied once per block.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <mini_decoder/io/weight_format.hpp>
#include <mini_decoder/ops/int_dot_path.hpp>

namespace mini_decoder {

//! One matrix-vector product's activations, `n` tokens of `cols` values each, quantized per
//! 32-element block: q = round(x / d) with d = max|x| / 127. Padded with zero blocks to a whole
//! number of 4-block groups, so the vector kernels need no tail code on the activation side.
struct q8_activations {
  std::uint32_t n = 0, cols = 0;
  std::uint32_t blocks = 0;  //!< cols / 32
  std::uint32_t groups = 0;  //!< blocks rounded up to a multiple of 4, divided by 4
  //! [n][groups * 128] int8 values in their natural order (zero padding).
  std::vector<std::int8_t> q;
  //! The same values in the AVX-512 Q4_1 kernel's order: per 4-block group, the first 16
  //! values of the four blocks, then their last 16 (the low and high nibbles of Q4_1).
  std::vector<std::int8_t> q_split;
  std::vector<float> d;   //!< [n][groups * 4] block scales
  std::vector<float> s;   //!< [n][groups * 4] d * (sum of the block's q): Q4_1's offset term
  std::vector<float> d4;  //!< [n][groups * 16] each block's d four times (AVX-512 Q4_1 lanes)
  std::vector<float> s4;  //!< [n][groups * 16] each block's s then three zeros
  std::vector<float> d8;  //!< [n][groups * 32] each block's d eight times (AVX-512 Q8_0 lanes)
  std::size_t q_stride() const { return std::size_t{groups} * 128; }
  std::size_t d_stride() const { return std::size_t{groups} * 4; }
};

//! Quantizes x ([n][cols], cols a multiple of 32) into `a`, reusing its storage.
void quantize_activations(const float* x, std::uint32_t n, std::uint32_t cols, q8_activations& a);

//! Rows [r0, r1) of y[t][r] = sum_c w[r][c] * x_q[t][c] for a Q4_1 or Q8_0 matrix.
using int8_matmul_fn = void (*)(const weight_matrix& w, const q8_activations& a, float* y,
                                std::uint32_t r0, std::uint32_t r1);
//! The kernel of `isa` for `t` (Q4_1 or Q8_0); throws when the CPU lacks `isa`.
int8_matmul_fn int8_matmul_kernel(quant_type t, oasiskv::cpu_isa isa);

//! Rows per panel of the repacked layout: `matmul_quantized` splits rows into chunks of this
//! many, so a chunk is a panel.
inline constexpr std::uint32_t panel_rows = 16;

//! Bytes of `w`'s panel copy (`pack_panels`): its first `rows / 16 * 16` rows, repacked, 64-byte
//! multiples per panel; 0 for types without a panel layout (only Q4_1 and Q8_0 have one).
//!
//! A panel holds 16 rows side by side, so that one `vpdpbusd` computes 4 products of each of the
//! 16 rows against the same 4 activations (broadcast) and its 16 int32 lanes are the 16 rows'
//! partial sums: no horizontal sums, and every byte of a 64-byte load is used. A panel of `nb`
//! 32-value blocks is a scale area, then a value area:
//! - Q4_1: per block 16 f16 `d` then 16 f16 `m` (64 bytes); per block four 64-byte chunks, byte
//!   `4 i + j` of chunk `k` holding row `i`'s value `4 k + j` in its low nibble and value
//!   `16 + 4 k + j` in its high nibble. Same bytes as the rows: 320 per block of 16 rows.
//! - Q8_0: per block 16 f16 `d` (32 bytes, the area padded to 64); per block eight 64-byte
//!   chunks, byte `4 i + j` of chunk `k` holding row `i`'s value `4 k + j` plus 128 (the
//!   unsigned operand of `vpdpbusd`; the kernel subtracts 128 times the activations' sum).
std::size_t panel_bytes(const weight_matrix& w);
//! Writes `w`'s panel copy into `out` (`panel_bytes(w)` bytes, 64-byte aligned).
void pack_panels(const weight_matrix& w, std::byte* out);

//! Panel `p` (rows `[16 p, 16 p + 16)`) of y[t][r] = sum_c w[r][c] * x_q[t][c], from
//! `w.panels`. Computes each token's sums in the same order whatever `a.n` is.
using panel_matmul_fn = void (*)(const weight_matrix& w, const q8_activations& a, float* y,
                                 std::uint32_t p);
//! The AVX-512 VNNI panel kernel for `t` (Q4_1 or Q8_0); null where the CPU lacks AVX-512 VNNI
//! or `t` has no panel layout.
panel_matmul_fn panel_matmul_kernel(quant_type t);

}  // namespace mini_decoder
