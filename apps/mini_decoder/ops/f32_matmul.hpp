// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The products with f32 activations, one kernel per path (scalar reference, AVX2,
//! AVX-512), for F32, F16, Q4_1 and Q8_0 weights: each weight block is expanded to f32 and
//! multiplied with the activations. `matmul_quantized` (matmul.hpp) picks one at run time.
#pragma once

#include <cstddef>
#include <cstdint>

#include <mini_decoder/io/weight_format.hpp>

namespace mini_decoder {

//! Rows [r0, r1) of y[t][r] = sum_c w[r][c] * x[t][c] for `n` tokens; x: [n][cols], y: [n][rows].
//! Up to 4 tokens share each block's expansion; each token's sum is computed in the same order
//! whatever `n` is.
using f32_matmul_fn = void (*)(const weight_matrix& w, const float* x, std::uint32_t n, float* y,
                               std::uint32_t r0, std::uint32_t r1);

//! The definition the vector paths must match closely.
void f32_matmul_scalar(const weight_matrix& w, const float* x, std::uint32_t n, float* y,
                       std::uint32_t r0, std::uint32_t r1);
//! Needs AVX2, FMA and F16C (the dispatcher checks the CPU).
void f32_matmul_avx2(const weight_matrix& w, const float* x, std::uint32_t n, float* y,
                     std::uint32_t r0, std::uint32_t r1);
//! Needs AVX-512 F/BW/VL (the dispatcher checks the CPU).
void f32_matmul_avx512(const weight_matrix& w, const float* x, std::uint32_t n, float* y,
                       std::uint32_t r0, std::uint32_t r1);

//! One 32-element Q4_1 or Q8_0 block `b` expanded to f32 (`out`: 32 values).
void dequantize_block(quant_type t, const std::byte* b, float* out);

}  // namespace mini_decoder
