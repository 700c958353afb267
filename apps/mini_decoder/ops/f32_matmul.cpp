// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/ops/f32_matmul.hpp>

// The intrinsics below: the false positives of the compilers are silenced in one place.
#include "oasiskv/cpu/kernel_begin.hpp"

#include <cstring>

#include "oasiskv/cpu/isa.hpp"

namespace mini_decoder {

namespace {

std::uint16_t load_u16(const std::byte* p) {
  std::uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

}  // namespace

// ---- scalar path: the definition the vector paths must match closely ----------------------

void dequantize_block(quant_type t, const std::byte* b, float* out) {
  if (t == quant_type::q4_1) {
    const float d = f16_to_f32(load_u16(b)), m = f16_to_f32(load_u16(b + 2));
    const auto* q = reinterpret_cast<const std::uint8_t*>(b + 4);
    for (int j = 0; j < 16; ++j) {
      out[j] = d * static_cast<float>(q[j] & 0x0F) + m;
      out[j + 16] = d * static_cast<float>(q[j] >> 4) + m;
    }
  } else {  // q8_0
    const float d = f16_to_f32(load_u16(b));
    const auto* q = reinterpret_cast<const std::int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) {
      out[j] = d * static_cast<float>(q[j]);
    }
  }
}

void f32_matmul_scalar(const weight_matrix& w, const float* x, std::uint32_t n, float* y,
                       std::uint32_t r0, std::uint32_t r1) {
  float tmp[32];
  for (std::uint32_t r = r0; r < r1; ++r) {
    const std::byte* row = w.row(r);
    for (std::uint32_t t = 0; t < n; ++t) {
      const float* xt = x + std::size_t{t} * w.cols;
      float acc = 0.0f;
      if (w.type == quant_type::f32 || w.type == quant_type::f16) {
        for (std::uint32_t c = 0; c < w.cols; ++c) {
          const float wv = w.type == quant_type::f32 ? reinterpret_cast<const float*>(row)[c]
                                                     : f16_to_f32(load_u16(row + 2 * c));
          acc += wv * xt[c];
        }
      } else {
        for (std::uint32_t c = 0; c < w.cols; c += 32) {
          dequantize_block(w.type, row + c / 32 * block_bytes(w.type), tmp);
          for (int j = 0; j < 32; ++j) {
            acc += tmp[j] * xt[c + j];
          }
        }
      }
      y[std::size_t{t} * w.rows + r] = acc;
    }
  }
}

// ---- AVX-512 ------------------------------------------------------------------------------

namespace {

constexpr std::uint32_t max_tokens_per_pass = 4;  // accumulators: 2 per token stay in registers

template <std::uint32_t NT>
OASISKV_TARGET_AVX512 void row_avx512(const weight_matrix& w, const std::byte* row, const float* x,
                                      float* y, std::uint32_t r) {
  __m512 lo[NT], hi[NT];
  for (std::uint32_t t = 0; t < NT; ++t) {
    lo[t] = _mm512_setzero_ps();
    hi[t] = _mm512_setzero_ps();
  }
  const std::uint32_t cols = w.cols;
  if (w.type == quant_type::q4_1 || w.type == quant_type::q8_0) {
    const std::size_t bb = block_bytes(w.type);
    for (std::uint32_t c = 0; c < cols; c += 32) {
      const std::byte* b = row + c / 32 * bb;
      __m512 wl, wh;
      if (w.type == quant_type::q4_1) {
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(b)));
        const __m512 m = _mm512_set1_ps(_cvtsh_ss(load_u16(b + 2)));
        const __m512i q =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)));
        wl = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))), m);
        wh = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), m);
      } else {
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(b)));
        const auto* q = reinterpret_cast<const __m128i*>(b + 2);
        wl = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
        wh = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
      }
      for (std::uint32_t t = 0; t < NT; ++t) {
        const float* xt = x + std::size_t{t} * cols + c;
        lo[t] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(xt), lo[t]);
        hi[t] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(xt + 16), hi[t]);
      }
    }
  } else {
    for (std::uint32_t c = 0; c < cols; c += 16) {
      const __mmask16 k = cols - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (cols - c)) - 1);
      const __m512 wv =
          w.type == quant_type::f32
              ? _mm512_maskz_loadu_ps(k, reinterpret_cast<const float*>(row) + c)
              : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, row + 2 * std::size_t{c}));
      for (std::uint32_t t = 0; t < NT; ++t) {
        lo[t] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(k, x + std::size_t{t} * cols + c), lo[t]);
      }
    }
  }
  for (std::uint32_t t = 0; t < NT; ++t) {
    y[std::size_t{t} * w.rows + r] = _mm512_reduce_add_ps(_mm512_add_ps(lo[t], hi[t]));
  }
}

}  // namespace

OASISKV_TARGET_AVX512 void f32_matmul_avx512(const weight_matrix& w, const float* x,
                                             std::uint32_t n, float* y, std::uint32_t r0,
                                             std::uint32_t r1) {
  for (std::uint32_t r = r0; r < r1; ++r) {
    const std::byte* row = w.row(r);
    std::uint32_t t = 0;
    for (; t + 4 <= n; t += 4) {
      row_avx512<4>(w, row, x + std::size_t{t} * w.cols, y + std::size_t{t} * w.rows, r);
    }
    const std::uint32_t left = n - t;
    const float* xt = x + std::size_t{t} * w.cols;
    float* yt = y + std::size_t{t} * w.rows;
    if (left == 3)
      row_avx512<3>(w, row, xt, yt, r);
    if (left == 2)
      row_avx512<2>(w, row, xt, yt, r);
    if (left == 1)
      row_avx512<1>(w, row, xt, yt, r);
  }
}

// ---- AVX2 ---------------------------------------------------------------------------------

namespace {

OASISKV_TARGET_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <std::uint32_t NT>
OASISKV_TARGET_AVX2 void row_avx2(const weight_matrix& w, const std::byte* row, const float* x,
                                  float* y, std::uint32_t r) {
  __m256 a[NT], b[NT];
  for (std::uint32_t t = 0; t < NT; ++t) {
    a[t] = _mm256_setzero_ps();
    b[t] = _mm256_setzero_ps();
  }
  const std::uint32_t cols = w.cols;
  float tail[NT] = {};
  if (w.type == quant_type::q4_1 || w.type == quant_type::q8_0) {
    const std::size_t bb = block_bytes(w.type);
    for (std::uint32_t c = 0; c < cols; c += 32) {
      const std::byte* blk = row + c / 32 * bb;
      __m256 wv[4];  // elements 0-7, 8-15, 16-23, 24-31
      if (w.type == quant_type::q4_1) {
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(blk)));
        const __m256 m = _mm256_set1_ps(_cvtsh_ss(load_u16(blk + 2)));
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
        const __m256i q0 = _mm256_cvtepu8_epi32(q), q1 = _mm256_cvtepu8_epi32(_mm_srli_si128(q, 8));
        const __m256i f = _mm256_set1_epi32(15);
        wv[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(q0, f)), m);
        wv[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(q1, f)), m);
        wv[2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), m);
        wv[3] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4)), m);
      } else {
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(blk)));
        for (int i = 0; i < 4; ++i) {
          const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * i));
          wv[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
        }
      }
      for (std::uint32_t t = 0; t < NT; ++t) {
        const float* xt = x + std::size_t{t} * cols + c;
        a[t] = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(xt), a[t]);
        b[t] = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(xt + 8), b[t]);
        a[t] = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(xt + 16), a[t]);
        b[t] = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(xt + 24), b[t]);
      }
    }
  } else {
    std::uint32_t c = 0;
    for (; c + 8 <= cols; c += 8) {
      const __m256 wv =
          w.type == quant_type::f32
              ? _mm256_loadu_ps(reinterpret_cast<const float*>(row) + c)
              : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * c)));
      for (std::uint32_t t = 0; t < NT; ++t) {
        a[t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + std::size_t{t} * cols + c), a[t]);
      }
    }
    for (; c < cols; ++c) {
      const float wv = w.type == quant_type::f32 ? reinterpret_cast<const float*>(row)[c]
                                                 : _cvtsh_ss(load_u16(row + 2 * c));
      for (std::uint32_t t = 0; t < NT; ++t) {
        tail[t] += wv * x[std::size_t{t} * cols + c];
      }
    }
  }
  for (std::uint32_t t = 0; t < NT; ++t) {
    y[std::size_t{t} * w.rows + r] = hsum256(_mm256_add_ps(a[t], b[t])) + tail[t];
  }
}

}  // namespace

OASISKV_TARGET_AVX2 void f32_matmul_avx2(const weight_matrix& w, const float* x, std::uint32_t n,
                                         float* y, std::uint32_t r0, std::uint32_t r1) {
  for (std::uint32_t r = r0; r < r1; ++r) {
    const std::byte* row = w.row(r);
    std::uint32_t t = 0;
    for (; t + 4 <= n; t += 4) {
      row_avx2<4>(w, row, x + std::size_t{t} * w.cols, y + std::size_t{t} * w.rows, r);
    }
    const std::uint32_t left = n - t;
    const float* xt = x + std::size_t{t} * w.cols;
    float* yt = y + std::size_t{t} * w.rows;
    if (left == 3)
      row_avx2<3>(w, row, xt, yt, r);
    if (left == 2)
      row_avx2<2>(w, row, xt, yt, r);
    if (left == 1)
      row_avx2<1>(w, row, xt, yt, r);
  }
}

}  // namespace mini_decoder

#include "oasiskv/cpu/kernel_end.hpp"
