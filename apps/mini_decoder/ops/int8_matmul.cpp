// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/ops/int8_matmul.hpp>

// The intrinsics below: the false positives of the compilers are silenced in one place.
#include "oasiskv/cpu/kernel_begin.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <mini_decoder/io/error.hpp>

#include "oasiskv/cpu/isa.hpp"

namespace mini_decoder {

namespace {

constexpr std::size_t q4_1_bytes = 20;  // f16 d, f16 m, 16 bytes of nibbles
constexpr std::size_t q8_0_bytes = 34;  // f16 d, 32 int8

// The panel layout (int8_matmul.hpp, `panel_bytes`): per block of 16 rows, the scale bytes and
// the value bytes.
constexpr std::size_t q4_1_panel_scale = 64, q4_1_panel_values = 256;
constexpr std::size_t q8_0_panel_scale = 32, q8_0_panel_values = 512;

std::size_t round64(std::size_t n) {
  return (n + 63) / 64 * 64;
}

std::size_t panel_scale_area(quant_type t, std::uint32_t blocks) {
  return round64(blocks * (t == quant_type::q4_1 ? q4_1_panel_scale : q8_0_panel_scale));
}

std::size_t panel_stride(quant_type t, std::uint32_t blocks) {
  return panel_scale_area(t, blocks) +
         std::size_t{blocks} * (t == quant_type::q4_1 ? q4_1_panel_values : q8_0_panel_values);
}

std::uint16_t load_u16(const std::byte* p) {
  std::uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

float load_f16(const std::byte* p) {
  return f16_to_f32(load_u16(p));
}

// ---- scalar reference ---------------------------------------------------------------------

void q4_1_scalar(const weight_matrix& w, const q8_activations& a, float* y, std::uint32_t r0,
                 std::uint32_t r1) {
  for (std::uint32_t r = r0; r < r1; ++r) {
    const std::byte* row = w.row(r);
    for (std::uint32_t t = 0; t < a.n; ++t) {
      const std::int8_t* xq = a.q.data() + t * a.q_stride();
      const float* xd = a.d.data() + t * a.d_stride();
      const float* xs = a.s.data() + t * a.d_stride();
      float acc = 0.0f;
      for (std::uint32_t b = 0; b < a.blocks; ++b) {
        const std::byte* blk = row + b * q4_1_bytes;
        const auto* nib = reinterpret_cast<const std::uint8_t*>(blk + 4);
        const std::int8_t* x = xq + 32 * b;
        std::int32_t isum = 0;
        for (int j = 0; j < 16; ++j) {
          isum += (nib[j] & 0x0F) * x[j] + (nib[j] >> 4) * x[j + 16];
        }
        acc += load_f16(blk) * xd[b] * static_cast<float>(isum) + load_f16(blk + 2) * xs[b];
      }
      y[std::size_t{t} * w.rows + r] = acc;
    }
  }
}

void q8_0_scalar(const weight_matrix& w, const q8_activations& a, float* y, std::uint32_t r0,
                 std::uint32_t r1) {
  for (std::uint32_t r = r0; r < r1; ++r) {
    const std::byte* row = w.row(r);
    for (std::uint32_t t = 0; t < a.n; ++t) {
      const std::int8_t* xq = a.q.data() + t * a.q_stride();
      const float* xd = a.d.data() + t * a.d_stride();
      float acc = 0.0f;
      for (std::uint32_t b = 0; b < a.blocks; ++b) {
        const std::byte* blk = row + b * q8_0_bytes;
        const auto* wq = reinterpret_cast<const std::int8_t*>(blk + 2);
        const std::int8_t* x = xq + 32 * b;
        std::int32_t isum = 0;
        for (int j = 0; j < 32; ++j) {
          isum += wq[j] * x[j];
        }
        acc += load_f16(blk) * xd[b] * static_cast<float>(isum);
      }
      y[std::size_t{t} * w.rows + r] = acc;
    }
  }
}

#if OASISKV_X86_KERNELS

// One f16 scale through F16C (the portable `f16_to_f32` is a bit-manipulating function call).
OASISKV_TARGET_AVX2 inline float load_f16c(const std::byte* p) {
  return _cvtsh_ss(load_u16(p));
}

// Decode streams the weights once. The hardware prefetcher alone leaves a single-threaded
// product at about half of the read bandwidth; software prefetches of the lines this far ahead
// into L1 (the line-fill buffers bound how many are in flight), and of the lines 16 KiB ahead
// into L2 (whose queue holds more misses), keep more of them in flight: 1.2-1.35x on
// `matvec_bench` over the L1 prefetch alone. Prefetches past the end of the weights are harmless.
constexpr std::size_t prefetch_distance = 1280;
constexpr std::size_t prefetch_l2_distance = 16384;

OASISKV_TARGET_AVX2 inline void prefetch_ahead(const std::byte* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p) + prefetch_distance, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(p) + prefetch_distance + 64, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(p) + prefetch_l2_distance, _MM_HINT_T1);
  _mm_prefetch(reinterpret_cast<const char*>(p) + prefetch_l2_distance + 64, _MM_HINT_T1);
}

// ---- AVX2: maddubs (u8 x s8 -> s16 pairs), madd to s32 ------------------------------------

OASISKV_TARGET_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Up to 4 tokens share each weight block's unpacking; each token's sum is computed in the
// same order whatever NT is.
template <std::uint32_t NT, bool Q4>
OASISKV_TARGET_AVX2 void row_avx2(const std::byte* row, const q8_activations& a, std::uint32_t t0,
                                  float* y, std::size_t y_stride) {
  __m256 acc[NT];
  float macc[NT];
  for (std::uint32_t t = 0; t < NT; ++t) {
    acc[t] = _mm256_setzero_ps();
    macc[t] = 0.0f;
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (std::uint32_t b = 0; b < a.blocks; ++b) {
    __m256i wu;       // the unsigned operand: Q4_1's nibbles, or |Q8_0|
    __m256i wsign{};  // Q8_0: the signed weights, whose signs go onto x
    float wd = 0, wm = 0;
    _mm_prefetch(
        reinterpret_cast<const char*>(row + b * (Q4 ? q4_1_bytes : q8_0_bytes)) + prefetch_distance,
        _MM_HINT_T0);
    if constexpr (Q4) {
      const std::byte* blk = row + b * q4_1_bytes;
      wd = load_f16c(blk);
      wm = load_f16c(blk + 2);
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
      const __m128i f = _mm_set1_epi8(0x0F);
      wu = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), f), _mm_and_si128(v, f));
    } else {
      const std::byte* blk = row + b * q8_0_bytes;
      wd = load_f16c(blk);
      wsign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      wu = _mm256_abs_epi8(wsign);
    }
    for (std::uint32_t t = 0; t < NT; ++t) {
      const std::size_t tt = t0 + t;
      __m256i x = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(a.q.data() + tt * a.q_stride() + 32 * b));
      if constexpr (!Q4) {
        x = _mm256_sign_epi8(x, wsign);
      }
      const __m256i i32 = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, x), ones);
      const float xd = a.d[tt * a.d_stride() + b];
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), _mm256_set1_ps(wd * xd), acc[t]);
      if constexpr (Q4) {
        macc[t] += wm * a.s[tt * a.d_stride() + b];
      }
    }
  }
  for (std::uint32_t t = 0; t < NT; ++t) {
    y[t * y_stride] = hsum256(acc[t]) + macc[t];
  }
}

template <bool Q4>
OASISKV_TARGET_AVX2 void matmul_avx2(const weight_matrix& w, const q8_activations& a, float* y,
                                     std::uint32_t r0, std::uint32_t r1) {
  for (std::uint32_t r = r0; r < r1; ++r) {
    const std::byte* row = w.row(r);
    std::uint32_t t = 0;
    for (; t + 4 <= a.n; t += 4) {
      row_avx2<4, Q4>(row, a, t, y + std::size_t{t} * w.rows + r, w.rows);
    }
    float* yt = y + std::size_t{t} * w.rows + r;
    switch (a.n - t) {
      case 3:
        row_avx2<3, Q4>(row, a, t, yt, w.rows);
        break;
      case 2:
        row_avx2<2, Q4>(row, a, t, yt, w.rows);
        break;
      case 1:
        row_avx2<1, Q4>(row, a, t, yt, w.rows);
        break;
      default:
        break;
    }
  }
}

// ---- AVX-512 VNNI: vpdpbusd (u8 x s8, four products per int32 lane) -------------------------

// Q4_1, four blocks (128 values) per step: the nibbles of the four blocks are gathered into one
// register, whose low nibbles (each block's first 16 values) and high nibbles (its last 16)
// meet the activations' q_split order; int32 lane group k holds block k's sum.
template <std::uint32_t NT>
OASISKV_TARGET_AVX512VNNI void q4_1_row_avx512(const std::byte* row, const q8_activations& a,
                                               std::uint32_t t0, float* y, std::size_t y_stride) {
  __m512 acc[NT];
  for (std::uint32_t t = 0; t < NT; ++t) {
    acc[t] = _mm512_setzero_ps();
  }
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  // 16-bit lanes: each block's d four times, then each block's m four times (bytes 0/20/40/60
  // and 2/22/42/62 of the group).
  const __m512i scale_idx =
      _mm512_set_epi16(31, 31, 31, 31, 21, 21, 21, 21, 11, 11, 11, 11, 1, 1, 1, 1,  //
                       30, 30, 30, 30, 20, 20, 20, 20, 10, 10, 10, 10, 0, 0, 0, 0);
  const std::size_t qs = a.q_stride(), ds = std::size_t{a.groups} * 16;
  for (std::uint32_t g = 0; g < a.groups; ++g) {
    const std::byte* p = row + std::size_t{g} * 4 * q4_1_bytes;
    prefetch_ahead(p);
    const std::uint32_t nb = std::min<std::uint32_t>(4, a.blocks - 4 * g);
    const auto nibbles = [p](std::uint32_t k) {
      return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k * q4_1_bytes + 4));
    };
    __m512i nib = _mm512_castsi128_si512(nibbles(0)), head;
    if (nb == 4) {
      head = _mm512_loadu_si512(p);
      nib = _mm512_inserti32x4(nib, nibbles(1), 1);
      nib = _mm512_inserti32x4(nib, nibbles(2), 2);
      nib = _mm512_inserti32x4(nib, nibbles(3), 3);
    } else {  // the row's last, partial group: only its own bytes are read
      head = _mm512_maskz_loadu_epi8((__mmask64{1} << (nb * q4_1_bytes)) - 1, p);
      nib = _mm512_inserti32x4(nib, nb > 1 ? nibbles(1) : _mm_setzero_si128(), 1);
      nib = _mm512_inserti32x4(nib, nb > 2 ? nibbles(2) : _mm_setzero_si128(), 2);
    }
    const __m512i wlo = _mm512_and_si512(nib, low4);
    const __m512i whi = _mm512_and_si512(_mm512_srli_epi16(nib, 4), low4);
    const __m512i sc = _mm512_permutexvar_epi16(scale_idx, head);
    const __m512 wd = _mm512_cvtph_ps(_mm512_castsi512_si256(sc));
    const __m512 wm = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(sc, 1));
    for (std::uint32_t t = 0; t < NT; ++t) {
      const std::size_t tt = t0 + t;
      const std::int8_t* x = a.q_split.data() + tt * qs + std::size_t{g} * 128;
      __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wlo, _mm512_loadu_si512(x));
      isum = _mm512_dpbusd_epi32(isum, whi, _mm512_loadu_si512(x + 64));
      const float* xd = a.d4.data() + tt * ds + std::size_t{g} * 16;
      const float* xs = a.s4.data() + tt * ds + std::size_t{g} * 16;
      acc[t] =
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(wd, _mm512_loadu_ps(xd)), acc[t]);
      acc[t] = _mm512_fmadd_ps(wm, _mm512_loadu_ps(xs), acc[t]);
    }
  }
  for (std::uint32_t t = 0; t < NT; ++t) {
    y[t * y_stride] = _mm512_reduce_add_ps(acc[t]);
  }
}

// Q8_0, two blocks (64 values) per step: |w| is the unsigned operand and w's signs go onto x.
template <std::uint32_t NT>
OASISKV_TARGET_AVX512VNNI void q8_0_row_avx512(const std::byte* row, const q8_activations& a,
                                               std::uint32_t t0, float* y, std::size_t y_stride) {
  __m512 acc[NT];
  for (std::uint32_t t = 0; t < NT; ++t) {
    acc[t] = _mm512_setzero_ps();
  }
  const std::size_t qs = a.q_stride(), ds = std::size_t{a.groups} * 32;
  for (std::uint32_t b = 0; b < a.blocks; b += 2) {
    const std::byte* p = row + std::size_t{b} * q8_0_bytes;
    prefetch_ahead(p);
    __m512i wv;
    __m512 wd;
    if (b + 1 < a.blocks) {
      wv = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + q8_0_bytes + 2)), 1);
      wd = _mm512_insertf32x8(_mm512_set1_ps(load_f16c(p)),
                              _mm256_set1_ps(load_f16c(p + q8_0_bytes)), 1);
    } else {  // an odd last block: the upper half stays zero
      wv = _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2)));
      wd = _mm512_zextps256_ps512(_mm256_set1_ps(load_f16c(p)));
    }
    const __m512i wu = _mm512_abs_epi8(wv);
    const __mmask64 neg = _mm512_movepi8_mask(wv);
    for (std::uint32_t t = 0; t < NT; ++t) {
      const std::size_t tt = t0 + t;
      const __m512i x = _mm512_loadu_si512(a.q.data() + tt * qs + std::size_t{b} * 32);
      const __m512i xs = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
      const __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, xs);
      const float* xd = a.d8.data() + tt * ds + std::size_t{b} * 8;
      acc[t] =
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(wd, _mm512_loadu_ps(xd)), acc[t]);
    }
  }
  for (std::uint32_t t = 0; t < NT; ++t) {
    y[t * y_stride] = _mm512_reduce_add_ps(acc[t]);
  }
}

template <bool Q4>
OASISKV_TARGET_AVX512VNNI void matmul_avx512(const weight_matrix& w, const q8_activations& a,
                                             float* y, std::uint32_t r0, std::uint32_t r1) {
  constexpr auto row1 = Q4 ? q4_1_row_avx512<1> : q8_0_row_avx512<1>;
  constexpr auto row2 = Q4 ? q4_1_row_avx512<2> : q8_0_row_avx512<2>;
  constexpr auto row3 = Q4 ? q4_1_row_avx512<3> : q8_0_row_avx512<3>;
  constexpr auto row4 = Q4 ? q4_1_row_avx512<4> : q8_0_row_avx512<4>;
  for (std::uint32_t r = r0; r < r1; ++r) {
    const std::byte* row = w.row(r);
    std::uint32_t t = 0;
    for (; t + 4 <= a.n; t += 4) {
      row4(row, a, t, y + std::size_t{t} * w.rows + r, w.rows);
    }
    float* yt = y + std::size_t{t} * w.rows + r;
    switch (a.n - t) {
      case 3:
        row3(row, a, t, yt, w.rows);
        break;
      case 2:
        row2(row, a, t, yt, w.rows);
        break;
      case 1:
        row1(row, a, t, yt, w.rows);
        break;
      default:
        break;
    }
  }
}

// ---- AVX-512 VNNI over panels of 16 rows (pack_panels) -----------------------------------

// Four bytes of activations, broadcast to every int32 lane (an embedded broadcast operand).
OASISKV_TARGET_AVX512 inline __m512i broadcast4(const std::int8_t* x) {
  std::int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_set1_epi32(v);
}

// `prefetch_ahead` for every line of a block's values.
template <std::size_t Lines>
OASISKV_TARGET_AVX512 inline void prefetch_panel(const std::byte* p) {
  const char* c = reinterpret_cast<const char*>(p);
  for (std::size_t i = 0; i < Lines; ++i) {
    _mm_prefetch(c + prefetch_distance + 64 * i, _MM_HINT_T0);
    _mm_prefetch(c + prefetch_l2_distance + 64 * i, _MM_HINT_T1);
  }
}

// Q4_1: per block, the 16 rows' nibbles are unpacked once into 8 registers and each token
// takes 8 `vpdpbusd` (two chains of 4) against its broadcast activations; then
// acc += isum * (d_w * d_x) and off += m_w * s_x, lane i being row i.
template <std::uint32_t NT>
OASISKV_TARGET_AVX512VNNI void q4_1_panel_avx512(const std::byte* panel, std::uint32_t blocks,
                                                 const q8_activations& a, std::uint32_t t0,
                                                 float* y, std::size_t y_stride) {
  __m512 acc[NT], off[NT];
  for (std::uint32_t t = 0; t < NT; ++t) {
    acc[t] = _mm512_setzero_ps();
    off[t] = _mm512_setzero_ps();
  }
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const std::byte* values = panel + panel_scale_area(quant_type::q4_1, blocks);
  const std::size_t qs = a.q_stride(), ds = a.d_stride();
  for (std::uint32_t b = 0; b < blocks; ++b) {
    const std::byte* v = values + std::size_t{b} * q4_1_panel_values;
    prefetch_panel<4>(v);
    const __m512i sc = _mm512_load_si512(panel + std::size_t{b} * q4_1_panel_scale);
    const __m512 wd = _mm512_cvtph_ps(_mm512_castsi512_si256(sc));
    const __m512 wm = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(sc, 1));
    __m512i w[8];
    for (int k = 0; k < 4; ++k) {
      const __m512i c = _mm512_load_si512(v + 64 * k);
      w[k] = _mm512_and_si512(c, low4);
      w[k + 4] = _mm512_and_si512(_mm512_srli_epi16(c, 4), low4);
    }
    for (std::uint32_t t = 0; t < NT; ++t) {
      const std::size_t tt = t0 + t;
      const std::int8_t* x = a.q.data() + tt * qs + std::size_t{b} * 32;
      __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], broadcast4(x));
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[4], broadcast4(x + 16));
      for (int k = 1; k < 4; ++k) {
        s0 = _mm512_dpbusd_epi32(s0, w[k], broadcast4(x + 4 * k));
        s1 = _mm512_dpbusd_epi32(s1, w[k + 4], broadcast4(x + 16 + 4 * k));
      }
      const std::size_t di = tt * ds + b;
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)),
                               _mm512_mul_ps(wd, _mm512_set1_ps(a.d[di])), acc[t]);
      off[t] = _mm512_fmadd_ps(wm, _mm512_set1_ps(a.s[di]), off[t]);
    }
  }
  for (std::uint32_t t = 0; t < NT; ++t) {
    _mm512_storeu_ps(y + t * y_stride, _mm512_add_ps(acc[t], off[t]));
  }
}

// Q8_0: the stored values are w + 128 (unsigned), so each block's sum is corrected by
// 128 * sum(x_q): d_w * (d_x * isum - 128 * s_x), with s_x = d_x * sum(x_q).
template <std::uint32_t NT>
OASISKV_TARGET_AVX512VNNI void q8_0_panel_avx512(const std::byte* panel, std::uint32_t blocks,
                                                 const q8_activations& a, std::uint32_t t0,
                                                 float* y, std::size_t y_stride) {
  __m512 acc[NT];
  for (std::uint32_t t = 0; t < NT; ++t) {
    acc[t] = _mm512_setzero_ps();
  }
  const std::byte* values = panel + panel_scale_area(quant_type::q8_0, blocks);
  const std::size_t qs = a.q_stride(), ds = a.d_stride();
  for (std::uint32_t b = 0; b < blocks; ++b) {
    const std::byte* v = values + std::size_t{b} * q8_0_panel_values;
    prefetch_panel<8>(v);
    const __m512 wd = _mm512_cvtph_ps(
        _mm256_load_si256(reinterpret_cast<const __m256i*>(panel + b * q8_0_panel_scale)));
    for (std::uint32_t t = 0; t < NT; ++t) {
      const std::size_t tt = t0 + t;
      const std::int8_t* x = a.q.data() + tt * qs + std::size_t{b} * 32;
      __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_load_si512(v), broadcast4(x));
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_load_si512(v + 64 * 4),
                                       broadcast4(x + 16));
      for (int k = 1; k < 4; ++k) {
        s0 = _mm512_dpbusd_epi32(s0, _mm512_load_si512(v + 64 * k), broadcast4(x + 4 * k));
        s1 = _mm512_dpbusd_epi32(s1, _mm512_load_si512(v + 64 * (k + 4)),
                                 broadcast4(x + 16 + 4 * k));
      }
      const std::size_t di = tt * ds + b;
      const __m512 sum = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)),
                                         _mm512_set1_ps(a.d[di]), _mm512_set1_ps(128.0f * a.s[di]));
      acc[t] = _mm512_fmadd_ps(wd, sum, acc[t]);
    }
  }
  for (std::uint32_t t = 0; t < NT; ++t) {
    _mm512_storeu_ps(y + t * y_stride, acc[t]);
  }
}

template <bool Q4>
OASISKV_TARGET_AVX512VNNI void panel_avx512(const weight_matrix& w, const q8_activations& a,
                                            float* y, std::uint32_t p) {
  constexpr auto tile1 = Q4 ? q4_1_panel_avx512<1> : q8_0_panel_avx512<1>;
  constexpr auto tile2 = Q4 ? q4_1_panel_avx512<2> : q8_0_panel_avx512<2>;
  constexpr auto tile3 = Q4 ? q4_1_panel_avx512<3> : q8_0_panel_avx512<3>;
  constexpr auto tile4 = Q4 ? q4_1_panel_avx512<4> : q8_0_panel_avx512<4>;
  const std::uint32_t blocks = w.cols / 32;
  const std::byte* panel = w.panels + std::size_t{p} * panel_stride(w.type, blocks);
  float* yp = y + std::size_t{p} * panel_rows;
  std::uint32_t t = 0;
  for (; t + 4 <= a.n; t += 4) {
    tile4(panel, blocks, a, t, yp + std::size_t{t} * w.rows, w.rows);
  }
  float* yt = yp + std::size_t{t} * w.rows;
  switch (a.n - t) {
    case 3:
      tile3(panel, blocks, a, t, yt, w.rows);
      break;
    case 2:
      tile2(panel, blocks, a, t, yt, w.rows);
      break;
    case 1:
      tile1(panel, blocks, a, t, yt, w.rows);
      break;
    default:
      break;
  }
}

#endif  // OASISKV_X86_KERNELS

}  // namespace

namespace {

struct block_scale {
  float d;
  std::int32_t sum;
  bool finite;
};

// One block of 32: d = max|x| / 127, q = x / d rounded to nearest (ties to even).
block_scale quantize_block_scalar(const float* x, std::int8_t* q) {
  float amax = 0.0f;
  bool finite = true;
  for (int j = 0; j < 32; ++j) {
    const float v = std::fabs(x[j]);
    finite = finite && v <= std::numeric_limits<float>::max();  // false for NaN and inf
    amax = v > amax ? v : amax;
  }
  const float d = amax / 127.0f;
  const float inv = d > 0.0f ? 1.0f / d : 0.0f;
  std::int32_t sum = 0;
  for (int j = 0; j < 32; ++j) {
    q[j] = static_cast<std::int8_t>(std::nearbyint(x[j] * inv));
    sum += q[j];
  }
  return {d, sum, finite};
}

#if OASISKV_X86_KERNELS
// The same values as the scalar path: the same max, the same products, and cvtps2dq rounds to
// nearest even as nearbyint does in the default rounding mode.
OASISKV_TARGET_AVX512 block_scale quantize_block_avx512(const float* x, std::int8_t* q) {
  const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
  const __m512 a0 = _mm512_abs_ps(x0), a1 = _mm512_abs_ps(x1);
  const __m512 lim = _mm512_set1_ps(std::numeric_limits<float>::max());
  // Ordered compares: false for NaN, so a NaN or an infinity clears its bit.
  const bool finite =
      (_mm512_cmp_ps_mask(a0, lim, _CMP_LE_OQ) & _mm512_cmp_ps_mask(a1, lim, _CMP_LE_OQ)) == 0xFFFF;
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
  const float d = amax / 127.0f;
  const __m512 inv = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
  const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv));
  const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(i0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(i1));
  const std::int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
  return {d, sum, finite};
}
#endif

block_scale quantize_block(const float* x, std::int8_t* q) {
#if OASISKV_X86_KERNELS
  static const bool avx512 = oasiskv::isa_supported(oasiskv::cpu_isa::avx512);
  if (avx512) {
    return quantize_block_avx512(x, q);
  }
#endif
  return quantize_block_scalar(x, q);
}

}  // namespace

void quantize_activations(const float* x, std::uint32_t n, std::uint32_t cols, q8_activations& a) {
  if (cols == 0 || cols % 32 != 0) {
    fail("quantize_activations: ", cols, " columns is not a positive multiple of 32");
  }
  a.n = n;
  a.cols = cols;
  a.blocks = cols / 32;
  a.groups = (a.blocks + 3) / 4;
  a.q.assign(n * a.q_stride(), 0);
  a.q_split.assign(n * a.q_stride(), 0);
  a.d.assign(n * a.d_stride(), 0.0f);
  a.s.assign(n * a.d_stride(), 0.0f);
  a.d4.assign(n * a.d_stride() * 4, 0.0f);
  a.s4.assign(n * a.d_stride() * 4, 0.0f);
  a.d8.assign(n * a.d_stride() * 8, 0.0f);
  for (std::uint32_t t = 0; t < n; ++t) {
    const float* xt = x + std::size_t{t} * cols;
    std::int8_t* q = a.q.data() + t * a.q_stride();
    std::int8_t* qsplit = a.q_split.data() + t * a.q_stride();
    for (std::uint32_t b = 0; b < a.blocks; ++b) {
      const block_scale bs = quantize_block(xt + 32 * b, q + 32 * b);
      if (!bs.finite) {
        fail("quantize_activations: token ", t, " has a non-finite value in columns ", 32 * b, "-",
             32 * b + 31);
      }
      const float d = bs.d;
      const std::int32_t sum = bs.sum;
      // Q4_1 order: per 4-block group, the blocks' first halves, then their second halves.
      const std::uint32_t g = b / 4, k = b % 4;
      std::memcpy(qsplit + 128 * g + 16 * k, q + 32 * b, 16);
      std::memcpy(qsplit + 128 * g + 64 + 16 * k, q + 32 * b + 16, 16);
      const std::size_t di = t * a.d_stride() + b;
      a.d[di] = d;
      a.s[di] = d * static_cast<float>(sum);
      for (int j = 0; j < 4; ++j) {
        a.d4[4 * di + j] = d;
      }
      a.s4[4 * di] = a.s[di];
      for (int j = 0; j < 8; ++j) {
        a.d8[8 * di + j] = d;
      }
    }
  }
}

int8_matmul_fn int8_matmul_kernel(quant_type t, oasiskv::cpu_isa isa) {
  if (t != quant_type::q4_1 && t != quant_type::q8_0) {
    fail("int8_matmul_kernel: ", to_string(t), " has no 32-element int8 kernel");
  }
  const bool q4 = t == quant_type::q4_1;
  switch (int_dot_path(isa)) {
#if OASISKV_X86_KERNELS
    case oasiskv::cpu_isa::avx512_vnni:
      return q4 ? matmul_avx512<true> : matmul_avx512<false>;
    case oasiskv::cpu_isa::avx2:
      return q4 ? matmul_avx2<true> : matmul_avx2<false>;
#endif
    default:
      return q4 ? q4_1_scalar : q8_0_scalar;
  }
}

std::size_t panel_bytes(const weight_matrix& w) {
  if ((w.type != quant_type::q4_1 && w.type != quant_type::q8_0) || w.cols % 32 != 0) {
    return 0;
  }
  return std::size_t{w.rows / panel_rows} * panel_stride(w.type, w.cols / 32);
}

void pack_panels(const weight_matrix& w, std::byte* out) {
  const std::size_t bytes = panel_bytes(w);
  if (bytes == 0) {
    fail("pack_panels: ", to_string(w.type), " matrix of ", w.rows, " x ", w.cols,
         " has no panel layout");
  }
  if (reinterpret_cast<std::uintptr_t>(out) % 64 != 0) {
    fail("pack_panels: the output is not 64-byte aligned");
  }
  const bool q4 = w.type == quant_type::q4_1;
  const std::uint32_t blocks = w.cols / 32;
  const std::size_t stride = panel_stride(w.type, blocks),
                    scale_area = panel_scale_area(w.type, blocks);
  const std::size_t bb = q4 ? q4_1_bytes : q8_0_bytes;
  const std::size_t per_scale = q4 ? q4_1_panel_scale : q8_0_panel_scale;
  const std::size_t per_values = q4 ? q4_1_panel_values : q8_0_panel_values;
  std::memset(out, 0, bytes);
  for (std::uint32_t p = 0; p < w.rows / panel_rows; ++p) {
    std::byte* panel = out + std::size_t{p} * stride;
    for (std::uint32_t b = 0; b < blocks; ++b) {
      std::byte* sc = panel + std::size_t{b} * per_scale;
      auto* v = reinterpret_cast<std::uint8_t*>(panel + scale_area + std::size_t{b} * per_values);
      for (std::uint32_t i = 0; i < panel_rows; ++i) {
        const std::byte* blk = w.row(p * panel_rows + i) + std::size_t{b} * bb;
        std::memcpy(sc + 2 * i, blk, 2);  // d
        if (q4) {
          std::memcpy(sc + 32 + 2 * i, blk + 2, 2);  // m
          const auto* nib = reinterpret_cast<const std::uint8_t*>(blk + 4);
          for (std::uint32_t e = 0; e < 16; ++e) {  // value e (low nibble), 16 + e (high)
            const std::uint32_t k = e / 4, j = e % 4;
            v[64 * k + 4 * i + j] = nib[e];  // Q4_1 stores exactly this pairing
          }
        } else {
          const auto* q = reinterpret_cast<const std::int8_t*>(blk + 2);
          for (std::uint32_t e = 0; e < 32; ++e) {
            v[64 * (e / 4) + 4 * i + e % 4] = static_cast<std::uint8_t>(q[e] + 128);
          }
        }
      }
    }
  }
}

panel_matmul_fn panel_matmul_kernel(quant_type t) {
#if OASISKV_X86_KERNELS
  if (oasiskv::isa_supported(oasiskv::cpu_isa::avx512_vnni)) {
    if (t == quant_type::q4_1) {
      return panel_avx512<true>;
    }
    if (t == quant_type::q8_0) {
      return panel_avx512<false>;
    }
  }
#endif
  (void)t;
  return nullptr;
}

}  // namespace mini_decoder

#include "oasiskv/cpu/kernel_end.hpp"
