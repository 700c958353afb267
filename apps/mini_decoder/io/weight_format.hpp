// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The weight formats a model file stores (F32, F16, Q4_1, Q8_0, Q4_K, Q6_K): their GGUF
//! ids, block geometry, and the matrix view the loaders hand to the products (ops/).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace mini_decoder {

enum class quant_type : std::uint8_t { f32, f16, q4_1, q8_0, q4_k, q6_k };

const char* to_string(quant_type t);
//! Maps a GGUF `ggml_type` id to ours; an id we cannot compute with is a clear error naming it.
quant_type quant_type_from_gguf(std::uint32_t id, const std::string& tensor,
                                const std::string& path);
std::uint32_t block_elements(quant_type t);  // elements per quant block (1 for F32/F16, 256 for K)
std::size_t block_bytes(quant_type t);       // bytes per quant block
std::size_t row_bytes(quant_type t, std::uint32_t cols);

inline constexpr std::uint32_t qk_k = 256;  //!< elements per K-quant super-block
//! f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
inline constexpr std::size_t q4_k_block_bytes = 144;
//! 128 bytes ql, 64 bytes qh, 16 int8 scales, f16 d
inline constexpr std::size_t q6_k_block_bytes = 210;

//! A row-major matrix in its stored type: `rows` output features of `cols` inputs each.
struct weight_matrix {
  quant_type type = quant_type::f32;
  const std::byte* data = nullptr;
  std::uint32_t rows = 0, cols = 0;
  std::size_t row_stride = 0;  // bytes per row
  //! The same weights repacked in panels of 16 rows (ops/int8_matmul.hpp, `pack_panels`) for the
  //! AVX-512 VNNI products, or null; rows past the last whole panel are read from `data`.
  const std::byte* panels = nullptr;
  const std::byte* row(std::uint32_t r) const { return data + std::size_t{r} * row_stride; }
};

float f16_to_f32(std::uint16_t h);

}  // namespace mini_decoder
