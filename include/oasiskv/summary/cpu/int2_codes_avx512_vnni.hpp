// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The AVX512_VNNI scoring kernel of `qminmax_int2_summary` (codes and the integer query:
//! `int2_codes_layout.hpp`): whole 16-token entries scored with 8-bit integer products, 64
//! per instruction, against the int8 bounds of `quantized_minmax_summary`. Compiled with
//! `OASISKV_TARGET_AVX512VNNI`, chosen at run time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/summary/cpu/int2_codes_avx512.hpp"
#include "oasiskv/summary/cpu/int2_codes_layout.hpp"

#if OASISKV_X86_KERNELS

#include "oasiskv/cpu/kernel_begin.hpp"

namespace oasiskv::cpu::detail {

// With the bounds as int8 codes `H`, `L` at a power-of-two scale `s` (quantized_minmax_summary),
// `k'_x = s (L_x + u_x D_x / 3)` with `D = H - L` in [0, 254], and a query row quantized to int8,
// `q ~ alpha Q`, a dot product is `alpha s (C + A)` with the integers `C = sum_x Q_x L_x` and
// `A = sum_x Q_x v_x`, `v_x = round(u_x D_x / 3)` (in [0, 254]: within a third of an int8 step of
// the code's value). Per block, each dimension's four values `v` (u = 0..3) are one 32-bit word,
// so four dimensions' values are a 16-byte table that `vpshufb` reads with the codes as indices:
// the 16 tokens' codes of four dimensions become their `v` bytes, token `t` in lane `t`, in five
// instructions, and `vpdpbusd` multiplies them by a row's four `Q` (64 products per
// instruction, 4x the f32 FMA's). `C` comes from one more accumulator whose lanes are the rows,
// over `L + 128` as unsigned bytes, less the row's `128 sum_x Q_x`.

//! The most dimensions the VNNI kernel's stack buffers hold.
inline constexpr std::uint32_t int2_avx512_vnni_max_dim = 256;

// The per-block tables of `int2_block_avx512_vnni`: for dimension x, `tab` holds the word
// (0, round(D/3), round(2D/3), D) (bytes 0-3), four dimensions to a 16-byte table, and `lq` the
// byte `L + 128`, from `bound` (quantized_minmax_summary::bound_words) for `d` dimensions (a
// multiple of 32). Table of dimensions `4p .. 4p + 3`: `int2_table_of(tab, p)`.
OASISKV_TARGET_AVX512VNNI inline void int2_tables_avx512_vnni(const std::uint32_t* bound,
                                                              std::uint32_t d, std::uint8_t* tab,
                                                              std::uint8_t* lq) {
  const __m512i one = _mm512_set1_epi16(1), third = _mm512_set1_epi16(-21845);  // 43691
  for (std::uint32_t x0 = 0; x0 < d; x0 += 32) {
    const __m512i g = _mm512_loadu_si512(bound + x0 / 2);  // int16 lane x: (hi, -lo) bytes
    const __m512i hi = _mm512_srai_epi16(_mm512_slli_epi16(g, 8), 8);
    const __m512i nlo = _mm512_srai_epi16(g, 8);
    const __m512i dd = _mm512_add_epi16(hi, nlo);
    // round(D / 3) = floor((D + 1) / 3), round(2 D / 3) = floor((2 D + 1) / 3): x / 3 as
    // (x * 43691) >> 17, exact below 2^16.
    const __m512i r1 = _mm512_srli_epi16(_mm512_mulhi_epu16(_mm512_add_epi16(dd, one), third), 1);
    const __m512i r2 = _mm512_srli_epi16(
        _mm512_mulhi_epu16(_mm512_add_epi16(_mm512_add_epi16(dd, dd), one), third), 1);
    const __m512i wlo = _mm512_slli_epi16(r1, 8);                       // bytes (0, r1)
    const __m512i whi = _mm512_or_si512(r2, _mm512_slli_epi16(dd, 8));  // bytes (r2, D)
    // 128-bit lane k of the low interleave holds dimensions x0 + 8k .. + 3, of the high one
    // x0 + 8k + 4 .. + 7.
    _mm512_store_si512(tab + 4 * x0, _mm512_unpacklo_epi16(wlo, whi));
    _mm512_store_si512(tab + 4 * x0 + 64, _mm512_unpackhi_epi16(wlo, whi));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lq + x0),
                        _mm512_cvtepi16_epi8(_mm512_sub_epi16(_mm512_set1_epi16(128), nlo)));
  }
}

// Where `int2_tables_avx512_vnni` put the table of dimensions 4p .. 4p + 3.
inline const std::uint8_t* int2_table_of(const std::uint8_t* tab, std::uint32_t p) noexcept {
  return tab + std::size_t{p / 8} * 128 + (p % 2) * 64 + ((p % 8) / 2) * 16;
}

// R <= 16 rows (one pass of `z`: `columns` its [d / 4][16], `bias` its 16 lanes) against one group
// of 16 tokens whose bounds are `bound` at scale `s`; `d` a multiple of 32, at most
// int2_avx512_vnni_max_dim.
template <int R>
OASISKV_TARGET_AVX512VNNI inline void int2_block_avx512_vnni(
    const std::uint32_t* words, const std::uint32_t* bound, float s, std::uint32_t d,
    std::uint32_t tokens, const std::int32_t* columns, const std::int32_t* bias, const float* alpha,
    float scale, float* out) {
  const std::uint32_t q4 = d / 4;
  alignas(64) std::uint8_t tab[4 * int2_avx512_vnni_max_dim];
  alignas(64) std::uint8_t lq[int2_avx512_vnni_max_dim];
  int2_tables_avx512_vnni(bound, d, tab, lq);
  // The four code words of dimensions 4p .. 4p + 3 (token i at bits 2i of each), broadcast to
  // every 128-bit lane k: dword i of lane k (token 4k + i) takes byte k of each word (tokens 4k ..
  // 4k + 3), shifts right by 2i and keeps two bits per byte, plus 4j in byte j: the index of
  // dimension 4p + j's code in the table.
  const __m512i route = _mm512_set_epi8(15, 11, 7, 3, 15, 11, 7, 3, 15, 11, 7, 3, 15, 11, 7, 3,  //
                                        14, 10, 6, 2, 14, 10, 6, 2, 14, 10, 6, 2, 14, 10, 6, 2,  //
                                        13, 9, 5, 1, 13, 9, 5, 1, 13, 9, 5, 1, 13, 9, 5, 1,      //
                                        12, 8, 4, 0, 12, 8, 4, 0, 12, 8, 4, 0, 12, 8, 4, 0);
  const __m512i shifts = _mm512_set_epi32(6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2, 0);
  const __m512i mask = _mm512_set1_epi32(0x03030303), base = _mm512_set1_epi32(0x0c080400);
  __m512i acc[R];
  OASISKV_UNROLL(16)
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_si512();
  }
  __m512i c = _mm512_setzero_si512();
  for (std::uint32_t p = 0; p < q4; ++p) {
    const __m512i w =
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(words + 4 * p)));
    const __m512i idx = _mm512_ternarylogic_epi32(
        _mm512_srlv_epi32(_mm512_shuffle_epi8(w, route), shifts), mask, base, 0xea);  // a & b | c
    const __m512i t = _mm512_broadcast_i32x4(
        _mm_load_si128(reinterpret_cast<const __m128i*>(int2_table_of(tab, p))));
    const __m512i v = _mm512_shuffle_epi8(t, idx);
    const std::int32_t* col = columns + std::size_t{p} * 16;  // row r's four Q in lane r
    OASISKV_UNROLL(16)
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_dpbusd_epi32(acc[r], v, _mm512_set1_epi32(col[r]));
    }
    std::int32_t l4;
    std::memcpy(&l4, lq + 4 * p, 4);
    c = _mm512_dpbusd_epi32(c, _mm512_set1_epi32(l4), _mm512_loadu_si512(col));
  }
  // Row r, token t: alpha_r s (C_r + A_rt).
  const __m512 a = _mm512_mul_ps(
      _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << R) - 1u), alpha), _mm512_set1_ps(s));
  const __m512 cs =
      _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(c, _mm512_loadu_si512(bias))), a);
  __m512 f[R];
  OASISKV_UNROLL(16)
  for (int r = 0; r < R; ++r) {
    f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_set1_ps(alpha[r] * s),
                           _mm512_permutexvar_ps(_mm512_set1_epi32(r), cs));
  }
  int2_epilogue_avx512<R>(f, tokens, scale, out);
}

// int2_block_avx512_vnni for all rows of `z`, in its passes of up to 16.
OASISKV_TARGET_AVX512VNNI inline void int2_block_rows_avx512_vnni(const std::uint32_t* words,
                                                                  const std::uint32_t* bound,
                                                                  float s, std::uint32_t tokens,
                                                                  const int2_query& z, float scale,
                                                                  float* out) {
  using pass =
      void (*)(const std::uint32_t*, const std::uint32_t*, float, std::uint32_t, std::uint32_t,
               const std::int32_t*, const std::int32_t*, const float*, float, float*);
  static constexpr pass passes[int2_pass_rows] = {
      &int2_block_avx512_vnni<1>,  &int2_block_avx512_vnni<2>,  &int2_block_avx512_vnni<3>,
      &int2_block_avx512_vnni<4>,  &int2_block_avx512_vnni<5>,  &int2_block_avx512_vnni<6>,
      &int2_block_avx512_vnni<7>,  &int2_block_avx512_vnni<8>,  &int2_block_avx512_vnni<9>,
      &int2_block_avx512_vnni<10>, &int2_block_avx512_vnni<11>, &int2_block_avx512_vnni<12>,
      &int2_block_avx512_vnni<13>, &int2_block_avx512_vnni<14>, &int2_block_avx512_vnni<15>,
      &int2_block_avx512_vnni<16>};
  const std::uint32_t q4 = z.d / 4;
  for (std::uint32_t r = 0; r < z.n; r += int2_pass_rows) {
    const std::uint32_t rows = z.n - r < int2_pass_rows ? z.n - r : int2_pass_rows;
    const std::size_t pass_index = r / int2_pass_rows;
    passes[rows - 1](words, bound, s, z.d, tokens, z.columns.data() + pass_index * q4 * 16,
                     z.bias.data() + pass_index * 16, z.alpha.data() + r, scale, out + r);
  }
}

}  // namespace oasiskv::cpu::detail

#include "oasiskv/cpu/kernel_end.hpp"
#endif  // OASISKV_X86_KERNELS
