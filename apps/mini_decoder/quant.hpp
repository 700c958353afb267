// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Weight storage types (F32, F16, Q4_1, Q8_0) and the products the forward pass needs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mini_decoder {

enum class quant_type : std::uint8_t { f32, f16, q4_1, q8_0 };

const char* to_string(quant_type t);
//! Maps a GGUF `ggml_type` id to ours; an id we cannot compute with is a clear error naming it.
quant_type quant_type_from_gguf(std::uint32_t id, const std::string& tensor,
                                const std::string& path);
std::uint32_t block_elements(quant_type t);  // elements per quant block (1 for F32/F16)
std::size_t block_bytes(quant_type t);       // bytes per quant block
std::size_t row_bytes(quant_type t, std::uint32_t cols);

//! A row-major matrix in its stored type: `rows` output features of `cols` inputs each.
struct weight_matrix {
  quant_type type = quant_type::f32;
  const std::byte* data = nullptr;
  std::uint32_t rows = 0, cols = 0;
  std::size_t row_stride = 0;  // bytes per row
  const std::byte* row(std::uint32_t r) const { return data + std::size_t{r} * row_stride; }
};

void dequantize_row(const weight_matrix& w, std::uint32_t r, float* out);
void dequantize(const weight_matrix& w, std::vector<float>& out);  // [rows][cols]

//! y[t][r] = sum_c w[r][c] * x[t][c] for a few tokens (decode, verification, drafting): the
//! weights stay quantized and each block is expanded once for all `n` tokens. Each output is
//! computed in the same order whatever `n` is, so a verification pass over g+1 tokens gives
//! bit-identical logits to g+1 single-token steps (greedy speculative == greedy).
//! x: [n][cols], y: [n][rows]. Rows are split over OpenMP threads.
void matmul_quantized(const weight_matrix& w, const float* x, std::uint32_t n, float* y);

//! The same product for many tokens (prefill): weights expanded to f32 once, then OpenBLAS sgemm.
void matmul_prefill(const weight_matrix& w, const float* x, std::uint32_t n, float* y,
                    std::vector<float>& scratch);

//! Which vector path `matmul_quantized` uses on this CPU ("avx512", "avx2", "scalar").
const char* matmul_isa();
//! Forces a path (tests); "best" restores the default. Unknown or unsupported names throw.
void force_matmul_isa(const std::string& isa);

void set_num_threads(int n);  // OpenMP and OpenBLAS threads
int num_threads();

float f16_to_f32(std::uint16_t h);

}  // namespace mini_decoder
