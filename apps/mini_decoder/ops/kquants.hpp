// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief GGUF K-quant weight formats Q4_K and Q6_K: dequantization, simple quantizers, and
//! integer dot products of a weight row against int8-quantized activations (Q8_K), with a
//! scalar reference path and AVX2 / AVX-512 VNNI paths chosen at run time. Their block geometry
//! (`qk_k`, block bytes) is io/weight_format.hpp's.
#pragma once

#include <cstddef>
#include <cstdint>

#include <mini_decoder/io/weight_format.hpp>
#include <mini_decoder/ops/int_dot_path.hpp>

namespace mini_decoder {

//! Activations quantized for the K-quant dots, as ggml's Q8_K: one f32 scale per 256 values,
//! int8 values, and the int16 sums of each 16 values.
struct q8k_block {
  float d;                 //!< scale: value i is d * q[i]
  std::int8_t q[256];      //!< quantized values
  std::int16_t bsums[16];  //!< bsums[g] = sum of q[16g .. 16g + 15]
};

//! Quantizes `n` floats (a multiple of 256, else `decoder_error` naming n) into n / 256
//! blocks: d = max|x| / 127 and q = round(x / d) (half away from zero); d = 0 and q = 0 for an
//! all-zero block.
void quantize_q8_k(const float* x, std::uint32_t n, q8k_block* out);

//! Dequantizes `n` elements (a multiple of 256) of Q4_K blocks to f32, exactly as ggml does.
void dequantize_q4_k(const std::byte* blocks, std::uint32_t n, float* out);
//! Dequantizes `n` elements (a multiple of 256) of Q6_K blocks to f32, exactly as ggml does.
void dequantize_q6_k(const std::byte* blocks, std::uint32_t n, float* out);

//! Simple round-to-nearest quantizer f32 -> Q4_K (`n` a multiple of 256), for tests and tools:
//! not ggml's search-based one, but the same format. Inputs must be finite.
void quantize_q4_k(const float* x, std::uint32_t n, std::byte* out);
//! Simple round-to-nearest quantizer f32 -> Q6_K (`n` a multiple of 256), for tests and tools:
//! not ggml's search-based one, but the same format. Inputs must be finite.
void quantize_q6_k(const float* x, std::uint32_t n, std::byte* out);

//! out[t] = dot(row, activations of token t) for t < ntok (1..4; larger counts are handled four
//! at a time, 0 does nothing), where row holds `nblocks` super-blocks of the weight type and
//! token t's activations are x + t * x_stride (in q8k_blocks, nblocks of them). The ntok tokens
//! share each weight block's unpacking. Each token's result does not depend on ntok or on the
//! other tokens (bit-identical whatever ntok is).
using kdot_fn = void (*)(const std::byte* row, const q8k_block* x, std::size_t x_stride,
                         std::uint32_t ntok, std::uint32_t nblocks, float* out);

//! The Q4_K dot of path `isa`; throws `decoder_error` if this build or CPU cannot run it.
kdot_fn kdot_q4_k(oasiskv::cpu_isa isa);
//! The Q6_K dot of path `isa`; throws `decoder_error` if this build or CPU cannot run it.
kdot_fn kdot_q6_k(oasiskv::cpu_isa isa);

}  // namespace mini_decoder
