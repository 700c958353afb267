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

#include "kquants.hpp"
#include "quant.hpp"

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
int8_matmul_fn int8_matmul_kernel(quant_type t, dot_isa isa);

}  // namespace mini_decoder
