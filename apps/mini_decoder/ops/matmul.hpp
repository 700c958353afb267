// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The products the forward pass needs, over weights in their stored format
//! (io/weight_format.hpp): the dispatch that picks, per matrix and CPU, an f32-activation kernel
//! (f32_matmul.hpp), an int8 one (int8_matmul.hpp, kquants.hpp) or OpenBLAS for prefill.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <mini_decoder/io/weight_format.hpp>

namespace mini_decoder {

void dequantize_row(const weight_matrix& w, std::uint32_t r, float* out);
void dequantize(const weight_matrix& w, std::vector<float>& out);  // [rows][cols]

//! How `matmul_quantized` treats the activations of a quantized matrix.
//! - `int8` (the default, as llama.cpp): each token's activations are quantized to int8 per
//!   block (32 values for Q4_1/Q8_0, 256 for the K-quants) and multiplied with the stored weight
//!   bytes by integer dot products (AVX-512 VNNI `vpdpbusd`, AVX2 `maddubs`, or scalar).
//! - `f32`: every weight block is expanded to f32 and multiplied with f32 activations: the
//!   exact product of the stored weights, slower; the reference that checks the model's logits.
//! F32 and F16 matrices always take the f32 path.
enum class matmul_activations : std::uint8_t { int8, f32 };
const char* to_string(matmul_activations a);
//! Parses "int8" or "f32"; anything else is a clear error naming it.
matmul_activations matmul_activations_from_string(const std::string& s);
void set_matmul_activations(matmul_activations a);
matmul_activations get_matmul_activations();

//! y[t][r] = sum_c w[r][c] * x[t][c] for `n` tokens (decode, verification, drafting, batches):
//! the weights stay quantized and each block is unpacked once for up to 4 tokens. Each output is
//! computed in the same order whatever `n` is, so a verification pass over g+1 tokens gives
//! bit-identical logits to g+1 single-token steps (greedy speculative == greedy).
//! x: [n][cols], y: [n][rows]. Rows are split over the engine's threads (threads.hpp).
void matmul_quantized(const weight_matrix& w, const float* x, std::uint32_t n, float* y);

//! The same product for many tokens (prefill): weights expanded to f32 once, then OpenBLAS sgemm.
void matmul_prefill(const weight_matrix& w, const float* x, std::uint32_t n, float* y,
                    std::vector<float>& scratch);

//! Which vector path `matmul_quantized` uses for quantized weights on this CPU, with the
//! activation mode: "avx512_vnni int8", "avx2 int8", "scalar int8", "avx512 f32", ...
std::string matmul_isa();
//! Forces a path (tests, benchmarks): "scalar", "avx2" or "avx512" (for int8 activations
//! AVX-512 means AVX-512 VNNI; without VNNI the int8 products take AVX2); "best" restores the
//! default. Unknown or unsupported names throw.
void force_matmul_isa(const std::string& isa);

}  // namespace mini_decoder
