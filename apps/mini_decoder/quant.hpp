// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Weight storage types (F32, F16, Q4_1, Q8_0, Q4_K, Q6_K) and the products the forward
//! pass needs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace oasiskv::cpu {
class thread_pool;
}

namespace mini_decoder {

enum class quant_type : std::uint8_t { f32, f16, q4_1, q8_0, q4_k, q6_k };

const char* to_string(quant_type t);
//! Maps a GGUF `ggml_type` id to ours; an id we cannot compute with is a clear error naming it.
quant_type quant_type_from_gguf(std::uint32_t id, const std::string& tensor,
                                const std::string& path);
std::uint32_t block_elements(quant_type t);  // elements per quant block (1 for F32/F16, 256 for K)
std::size_t block_bytes(quant_type t);       // bytes per quant block
std::size_t row_bytes(quant_type t, std::uint32_t cols);

//! A row-major matrix in its stored type: `rows` output features of `cols` inputs each.
struct weight_matrix {
  quant_type type = quant_type::f32;
  const std::byte* data = nullptr;
  std::uint32_t rows = 0, cols = 0;
  std::size_t row_stride = 0;  // bytes per row
  //! The same weights repacked in panels of 16 rows (quant_int8.hpp, `pack_panels`) for the
  //! AVX-512 VNNI products, or null; rows past the last whole panel are read from `data`.
  const std::byte* panels = nullptr;
  const std::byte* row(std::uint32_t r) const { return data + std::size_t{r} * row_stride; }
};

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
//! x: [n][cols], y: [n][rows]. Rows are split over OpenMP threads.
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

//! Threads of the engine's pool (`engine_pool`) and of OpenBLAS (prefill's sgemm); 1 at start.
void set_num_threads(int n);
int num_threads();
//! The engine's one thread pool: the products run on it, and the KV backends hand it to the
//! attention kernel, so products and attention never have two pools contending for the cores.
//! `set_num_threads` replaces it; holders of `shared_engine_pool` keep the one they got.
oasiskv::cpu::thread_pool& engine_pool();
std::shared_ptr<oasiskv::cpu::thread_pool> shared_engine_pool();

float f16_to_f32(std::uint16_t h);

}  // namespace mini_decoder
