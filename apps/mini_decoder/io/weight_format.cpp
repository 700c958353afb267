// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/io/weight_format.hpp>

#include <mini_decoder/io/error.hpp>

#include "oasiskv/core/dtype.hpp"

namespace mini_decoder {

const char* to_string(quant_type t) {
  switch (t) {
    case quant_type::f32:
      return "F32";
    case quant_type::f16:
      return "F16";
    case quant_type::q4_1:
      return "Q4_1";
    case quant_type::q8_0:
      return "Q8_0";
    case quant_type::q4_k:
      return "Q4_K";
    case quant_type::q6_k:
      return "Q6_K";
  }
  return "?";
}

quant_type quant_type_from_gguf(std::uint32_t id, const std::string& tensor,
                                const std::string& path) {
  switch (id) {
    case 0:
      return quant_type::f32;
    case 1:
      return quant_type::f16;
    case 3:
      return quant_type::q4_1;
    case 8:
      return quant_type::q8_0;
    case 12:
      return quant_type::q4_k;
    case 14:
      return quant_type::q6_k;
    default:
      fail("GGUF file '", path, "': tensor ", tensor, " has quant type ", id,
           ", which this decoder does not support (supported: F32=0, F16=1, Q4_1=3, Q8_0=8, "
           "Q4_K=12, Q6_K=14)");
  }
}

std::uint32_t block_elements(quant_type t) {
  switch (t) {
    case quant_type::q4_1:
    case quant_type::q8_0:
      return 32;
    case quant_type::q4_k:
    case quant_type::q6_k:
      return qk_k;
    default:
      return 1;
  }
}
std::size_t block_bytes(quant_type t) {
  switch (t) {
    case quant_type::f32:
      return 4;
    case quant_type::f16:
      return 2;
    case quant_type::q4_1:
      return 20;  // f16 d, f16 m, 16 bytes of nibbles
    case quant_type::q8_0:
      return 34;  // f16 d, 32 int8
    case quant_type::q4_k:
      return q4_k_block_bytes;
    case quant_type::q6_k:
      return q6_k_block_bytes;
  }
  return 0;
}
std::size_t row_bytes(quant_type t, std::uint32_t cols) {
  return cols / block_elements(t) * block_bytes(t);
}

float f16_to_f32(std::uint16_t h) {
  return oasiskv::f16{h}.to_float();
}

}  // namespace mini_decoder
