// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/ops/kquants.hpp>

// The intrinsics below: the false positives of the compilers are silenced in one place.
#include "oasiskv/cpu/kernel_begin.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <mini_decoder/io/error.hpp>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/cpu/isa.hpp"

namespace mini_decoder {

namespace {

// Q4_K block: f16 d at 0, f16 dmin at 2, 12 bytes of packed 6-bit scales/mins at 4, 128 bytes of
// nibbles at 16. Q6_K block: ql at 0, qh at 128, int8 scales at 192, f16 d at 208.
constexpr std::size_t q4k_scales_at = 4;
constexpr std::size_t q4k_qs_at = 16;
constexpr std::size_t q6k_qh_at = 128;
constexpr std::size_t q6k_scales_at = 192;
constexpr std::size_t q6k_d_at = 208;

const std::uint8_t* bytes(const std::byte* p) {
  return reinterpret_cast<const std::uint8_t*>(p);
}

float load_f16(const std::uint8_t* p) {
  std::uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return oasiskv::f16{bits}.to_float();
}

//! Stores `v` rounded to f16 and returns the stored value.
float store_f16(std::uint8_t* p, float v) {
  const oasiskv::f16 h = oasiskv::f16::from_float(v);
  std::memcpy(p, &h.bits, sizeof h.bits);
  return h.to_float();
}

void check_n(const char* what, std::uint32_t n) {
  if (n % qk_k != 0) {
    fail(what, ": n = ", n, " is not a multiple of ", qk_k,
         " (the number of elements of a K-quant super-block)");
  }
}

//! ggml's get_scale_min_k4 for all eight sub-blocks.
void q4k_scale_min(const std::uint8_t* s, std::uint8_t* sc, std::uint8_t* m) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    m[j] = s[j + 4] & 63;
  }
  for (int j = 4; j < 8; ++j) {
    sc[j] = static_cast<std::uint8_t>((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
    m[j] = static_cast<std::uint8_t>((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

// ---------------------------------------------------------------------------------------------
// Scalar reference dots: integer sums per super-block, one float step per super-block.

float q4k_dot_scalar_one(const std::uint8_t* row, const q8k_block* x, std::uint32_t nblocks) {
  float sum = 0.0f;
  for (std::uint32_t b = 0; b < nblocks; ++b) {
    const std::uint8_t* blk = row + b * q4_k_block_bytes;
    const q8k_block& xb = x[b];
    std::uint8_t sc[8], m[8];
    q4k_scale_min(blk + q4k_scales_at, sc, m);
    const std::uint8_t* qs = blk + q4k_qs_at;
    std::int32_t sumi = 0;
    for (int j = 0; j < 8; ++j) {
      const std::uint8_t* q = qs + 32 * (j / 2);
      const int shift = 4 * (j & 1);
      std::int32_t dot = 0;
      for (int l = 0; l < 32; ++l) {
        dot += ((q[l] >> shift) & 0xF) * xb.q[32 * j + l];
      }
      sumi += sc[j] * dot;
    }
    std::int32_t summ = 0;
    for (int j = 0; j < 8; ++j) {
      summ += m[j] * (xb.bsums[2 * j] + xb.bsums[2 * j + 1]);
    }
    const float d = load_f16(blk) * xb.d;
    const float dmin = load_f16(blk + 2) * xb.d;
    sum += d * static_cast<float>(sumi) - dmin * static_cast<float>(summ);
  }
  return sum;
}

float q6k_dot_scalar_one(const std::uint8_t* row, const q8k_block* x, std::uint32_t nblocks) {
  float sum = 0.0f;
  for (std::uint32_t b = 0; b < nblocks; ++b) {
    const std::uint8_t* blk = row + b * q6_k_block_bytes;
    const q8k_block& xb = x[b];
    std::int8_t q[256];
    for (int n = 0; n < 2; ++n) {
      const std::uint8_t* ql = blk + 64 * n;
      const std::uint8_t* qh = blk + q6k_qh_at + 32 * n;
      std::int8_t* y = q + 128 * n;
      for (int l = 0; l < 32; ++l) {
        y[l] = static_cast<std::int8_t>(((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
        y[l + 32] = static_cast<std::int8_t>(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
        y[l + 64] = static_cast<std::int8_t>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
        y[l + 96] = static_cast<std::int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
      }
    }
    std::int32_t sumi = 0;
    for (int g = 0; g < 16; ++g) {
      std::int32_t dot = 0;
      for (int u = 0; u < 16; ++u) {
        dot += q[16 * g + u] * xb.q[16 * g + u];
      }
      sumi += static_cast<std::int8_t>(blk[q6k_scales_at + g]) * dot;
    }
    const float d = load_f16(blk + q6k_d_at) * xb.d;
    sum += d * static_cast<float>(sumi);
  }
  return sum;
}

struct q4k_scalar {
  template <int NT>
  static void run(const std::uint8_t* row, const q8k_block* x, std::size_t xs, std::uint32_t nb,
                  float* out) {
    for (int t = 0; t < NT; ++t) {
      out[t] = q4k_dot_scalar_one(row, x + t * xs, nb);
    }
  }
};

struct q6k_scalar {
  template <int NT>
  static void run(const std::uint8_t* row, const q8k_block* x, std::size_t xs, std::uint32_t nb,
                  float* out) {
    for (int t = 0; t < NT; ++t) {
      out[t] = q6k_dot_scalar_one(row, x + t * xs, nb);
    }
  }
};

#if OASISKV_X86_KERNELS

OASISKV_TARGET_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

OASISKV_TARGET_AVX2 inline __m256i loadu256(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

OASISKV_TARGET_AVX2 inline float load_f16_hw(const std::uint8_t* p) {
  std::uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return _cvtsh_ss(bits);
}

//! get_scale_min_k4 for all eight sub-blocks on 32-bit words, straight into a register (no
//! round trip through memory): bytes 0..7 are the scales, bytes 8..15 the mins.
OASISKV_TARGET_AVX2 inline __m128i q4k_scale_min_vec(const std::uint8_t* s) {
  constexpr std::uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, bits45 = 0x30303030;
  std::uint32_t u0, u1, u2;
  std::memcpy(&u0, s, 4);
  std::memcpy(&u1, s + 4, 4);
  std::memcpy(&u2, s + 8, 4);
  const std::uint32_t sc_lo = u0 & low6;
  const std::uint32_t sc_hi = (u2 & low4) | ((u0 >> 2) & bits45);
  const std::uint32_t m_lo = u1 & low6;
  const std::uint32_t m_hi = ((u2 >> 4) & low4) | ((u1 >> 2) & bits45);
  return _mm_set_epi32(static_cast<int>(m_hi), static_cast<int>(m_lo), static_cast<int>(sc_hi),
                       static_cast<int>(sc_lo));
}

// ---------------------------------------------------------------------------------------------
// AVX2: maddubs (u8 weights x s8 activations -> s16 pairs, which cannot saturate: 2*63*128 <
// 32768), then madd with the 16-bit sub-block scales -> s32.

struct q4k_avx2 {
  template <int NT>
  OASISKV_TARGET_AVX2 static void run(const std::uint8_t* row, const q8k_block* x, std::size_t xs,
                                      std::uint32_t nb, float* out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    // Word j of a broadcast 8-word vector, in every word.
    __m256i pick[8];
    for (int j = 0; j < 8; ++j) {
      pick[j] = _mm256_set1_epi16(static_cast<short>((2 * j) | ((2 * j + 1) << 8)));
    }
    __m256 acc[NT], accm[NT];
    for (int t = 0; t < NT; ++t) {
      acc[t] = _mm256_setzero_ps();
      accm[t] = _mm256_setzero_ps();
    }
    for (std::uint32_t b = 0; b < nb; ++b) {
      const std::uint8_t* blk = row + b * q4_k_block_bytes;
      const __m128i sm = q4k_scale_min_vec(blk + q4k_scales_at);
      const __m256i scales16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
      const __m256i mn = _mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8));
      const __m256i mins_pairs = _mm256_or_si256(mn, _mm256_slli_epi32(mn, 16));
      __m256i s[NT];
      for (int t = 0; t < NT; ++t) {
        s[t] = _mm256_setzero_si256();
      }
      for (int i = 0; i < 4; ++i) {
        const __m256i c = loadu256(blk + q4k_qs_at + 32 * i);
        const __m256i wl = _mm256_and_si256(c, m4);
        const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(c, 4), m4);
        const __m256i sl = _mm256_shuffle_epi8(scales16, pick[2 * i]);
        const __m256i sh = _mm256_shuffle_epi8(scales16, pick[2 * i + 1]);
        for (int t = 0; t < NT; ++t) {
          const std::int8_t* xq = x[t * xs + b].q + 64 * i;
          const __m256i pl = _mm256_maddubs_epi16(wl, loadu256(xq));
          const __m256i ph = _mm256_maddubs_epi16(wh, loadu256(xq + 32));
          s[t] = _mm256_add_epi32(
              s[t], _mm256_add_epi32(_mm256_madd_epi16(pl, sl), _mm256_madd_epi16(ph, sh)));
        }
      }
      const float d = load_f16_hw(blk);
      const float dmin = load_f16_hw(blk + 2);
      for (int t = 0; t < NT; ++t) {
        const q8k_block& xb = x[t * xs + b];
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t]), _mm256_set1_ps(d * xb.d), acc[t]);
        const __m256i summ = _mm256_madd_epi16(loadu256(xb.bsums), mins_pairs);
        accm[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(summ), _mm256_set1_ps(dmin * xb.d), accm[t]);
      }
    }
    for (int t = 0; t < NT; ++t) {
      out[t] = hsum256(acc[t]) - hsum256(accm[t]);
    }
  }
};

struct q6k_avx2 {
  template <int NT>
  OASISKV_TARGET_AVX2 static void run(const std::uint8_t* row, const q8k_block* x, std::size_t xs,
                                      std::uint32_t nb, float* out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i m30 = _mm256_set1_epi8(0x30);
    // Word 2m of a broadcast 8-word vector into the low lane, word 2m + 1 into the high lane.
    __m256i pick[4];
    for (int m = 0; m < 4; ++m) {
      const __m128i lo = _mm_set1_epi16(static_cast<short>((4 * m) | ((4 * m + 1) << 8)));
      const __m128i hi = _mm_set1_epi16(static_cast<short>((4 * m + 2) | ((4 * m + 3) << 8)));
      pick[m] = _mm256_set_m128i(hi, lo);
    }
    __m256 acc[NT];
    for (int t = 0; t < NT; ++t) {
      acc[t] = _mm256_setzero_ps();
    }
    for (std::uint32_t b = 0; b < nb; ++b) {
      const std::uint8_t* blk = row + b * q6_k_block_bytes;
      const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + q6k_scales_at));
      __m256i s[NT];
      for (int t = 0; t < NT; ++t) {
        s[t] = _mm256_setzero_si256();
      }
      for (int n = 0; n < 2; ++n) {
        const __m256i sc16 =
            _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(n == 0 ? sc8 : _mm_srli_si128(sc8, 8)));
        const __m256i ql0 = loadu256(blk + 64 * n);
        const __m256i ql1 = loadu256(blk + 64 * n + 32);
        const __m256i qh = loadu256(blk + q6k_qh_at + 32 * n);
        __m256i w[4];
        w[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4),
                               _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
        w[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4),
                               _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
        w[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                               _mm256_and_si256(qh, m30));
        w[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                               _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
        for (int m = 0; m < 4; ++m) {
          const __m256i scale = _mm256_shuffle_epi8(sc16, pick[m]);
          for (int t = 0; t < NT; ++t) {
            const std::int8_t* xq = x[t * xs + b].q + 128 * n + 32 * m;
            const __m256i p = _mm256_maddubs_epi16(w[m], loadu256(xq));
            s[t] = _mm256_add_epi32(s[t], _mm256_madd_epi16(p, scale));
          }
        }
      }
      // The stored values are q + 32: subtract 32 * sum_g scale_g * bsum_g.
      const __m256i scales16 = _mm256_cvtepi8_epi16(sc8);
      const float d = load_f16_hw(blk + q6k_d_at);
      for (int t = 0; t < NT; ++t) {
        const q8k_block& xb = x[t * xs + b];
        const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(loadu256(xb.bsums), scales16), 5);
        const __m256i sum = _mm256_sub_epi32(s[t], corr);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d * xb.d), acc[t]);
      }
    }
    for (int t = 0; t < NT; ++t) {
      out[t] = hsum256(acc[t]);
    }
  }
};

// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI: vpdpbusd (u8 weights x s8 activations, four products per s32 lane; a lane is
// at most 4*63*128 < 32768 in magnitude), then vpdpwssd with the sub-block scale in the low
// 16 bits of each lane (high 16 bits zero) applies the scale and accumulates.

struct q4k_vnni {
  template <int NT>
  OASISKV_TARGET_AVX512VNNI static void run(const std::uint8_t* row, const q8k_block* x,
                                            std::size_t xs, std::uint32_t nb, float* out) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    // Shift counts: 0 for the low 256 bits (low nibbles), 4 for the high 256 bits.
    const __m512i nibble_shift = _mm512_set_epi64(
        0x0004000400040004, 0x0004000400040004, 0x0004000400040004, 0x0004000400040004, 0, 0, 0, 0);
    __m512i pick[4];
    for (int i = 0; i < 4; ++i) {
      const int lo = 2 * i, hi = 2 * i + 1;
      pick[i] = _mm512_set_epi32(hi, hi, hi, hi, hi, hi, hi, hi, lo, lo, lo, lo, lo, lo, lo, lo);
    }
    __m512 acc[NT];
    __m256 accm[NT];
    for (int t = 0; t < NT; ++t) {
      acc[t] = _mm512_setzero_ps();
      accm[t] = _mm256_setzero_ps();
    }
    for (std::uint32_t b = 0; b < nb; ++b) {
      const std::uint8_t* blk = row + b * q4_k_block_bytes;
      const __m512i sm32 = _mm512_cvtepu8_epi32(q4k_scale_min_vec(blk + q4k_scales_at));
      const __m256i mn = _mm512_extracti32x8_epi32(sm32, 1);
      const __m256i mins_pairs = _mm256_or_si256(mn, _mm256_slli_epi32(mn, 16));
      __m512i w[4], scale[4];
      for (int i = 0; i < 4; ++i) {
        // Chunk i (32 bytes) holds elements 64i..64i+31 (low nibbles) and 64i+32..64i+63 (high).
        const __m512i c = _mm512_broadcast_i64x4(loadu256(blk + q4k_qs_at + 32 * i));
        w[i] = _mm512_and_si512(_mm512_srlv_epi16(c, nibble_shift), m4);
        scale[i] = _mm512_permutexvar_epi32(pick[i], sm32);
      }
      const float d = load_f16_hw(blk);
      const float dmin = load_f16_hw(blk + 2);
      for (int t = 0; t < NT; ++t) {
        const q8k_block& xb = x[t * xs + b];
        __m512i s = _mm512_setzero_si512();
        for (int i = 0; i < 4; ++i) {
          const __m512i p =
              _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[i], _mm512_loadu_si512(xb.q + 64 * i));
          s = _mm512_dpwssd_epi32(s, p, scale[i]);
        }
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(d * xb.d), acc[t]);
        const __m256i summ = _mm256_madd_epi16(loadu256(xb.bsums), mins_pairs);
        accm[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(summ), _mm256_set1_ps(dmin * xb.d), accm[t]);
      }
    }
    for (int t = 0; t < NT; ++t) {
      out[t] = _mm512_reduce_add_ps(acc[t]) - hsum256(accm[t]);
    }
  }
};

struct q6k_vnni {
  template <int NT>
  OASISKV_TARGET_AVX512VNNI static void run(const std::uint8_t* row, const q8k_block* x,
                                            std::size_t xs, std::uint32_t nb, float* out) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i m30 = _mm512_set1_epi8(0x30);
    const __m512i low16 = _mm512_set1_epi32(0xFFFF);
    // qh is broadcast to both 256-bit halves; these counts bring the right 2-bit field of each
    // byte to bits 4..5: left by 4 / 2 for elements 0..31 / 32..63 of a half, right by 0 / 2 for
    // elements 64..95 / 96..127.
    const __m512i left = _mm512_set_epi64(
        0x0002000200020002, 0x0002000200020002, 0x0002000200020002, 0x0002000200020002,
        0x0004000400040004, 0x0004000400040004, 0x0004000400040004, 0x0004000400040004);
    const __m512i right = _mm512_set_epi64(0x0002000200020002, 0x0002000200020002,
                                           0x0002000200020002, 0x0002000200020002, 0, 0, 0, 0);
    __m512i pick[4];
    for (int k = 0; k < 4; ++k) {
      const int g = 4 * k;
      pick[k] = _mm512_set_epi32(g + 3, g + 3, g + 3, g + 3, g + 2, g + 2, g + 2, g + 2, g + 1,
                                 g + 1, g + 1, g + 1, g, g, g, g);
    }
    __m512 acc[NT];
    for (int t = 0; t < NT; ++t) {
      acc[t] = _mm512_setzero_ps();
    }
    for (std::uint32_t b = 0; b < nb; ++b) {
      const std::uint8_t* blk = row + b * q6_k_block_bytes;
      const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + q6k_scales_at));
      const __m512i sc32 = _mm512_and_si512(_mm512_cvtepi8_epi32(sc8), low16);
      const __m256i scales16 = _mm256_cvtepi8_epi16(sc8);
      __m512i w[4], scale[4];
      for (int n = 0; n < 2; ++n) {
        const __m512i ql = _mm512_loadu_si512(blk + 64 * n);
        const __m512i qh = _mm512_broadcast_i64x4(loadu256(blk + q6k_qh_at + 32 * n));
        w[2 * n] = _mm512_or_si512(_mm512_and_si512(ql, m4),
                                   _mm512_and_si512(_mm512_sllv_epi16(qh, left), m30));
        w[2 * n + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                       _mm512_and_si512(_mm512_srlv_epi16(qh, right), m30));
      }
      for (int k = 0; k < 4; ++k) {
        scale[k] = _mm512_permutexvar_epi32(pick[k], sc32);
      }
      const float d = load_f16_hw(blk + q6k_d_at);
      for (int t = 0; t < NT; ++t) {
        const q8k_block& xb = x[t * xs + b];
        __m512i s = _mm512_setzero_si512();
        for (int k = 0; k < 4; ++k) {
          const __m512i p =
              _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[k], _mm512_loadu_si512(xb.q + 64 * k));
          s = _mm512_dpwssd_epi32(s, p, scale[k]);
        }
        // The stored values are q + 32: subtract 32 * sum_g scale_g * bsum_g.
        const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(loadu256(xb.bsums), scales16), 5);
        s = _mm512_sub_epi32(s, _mm512_zextsi256_si512(corr));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(d * xb.d), acc[t]);
      }
    }
    for (int t = 0; t < NT; ++t) {
      out[t] = _mm512_reduce_add_ps(acc[t]);
    }
  }
};

#endif  // OASISKV_X86_KERNELS

//! Runs kernel K on any number of tokens, four at a time: each token's arithmetic is the same
//! whatever group it falls in.
template <class K>
void kdot(const std::byte* row, const q8k_block* x, std::size_t xs, std::uint32_t ntok,
          std::uint32_t nb, float* out) {
  const std::uint8_t* r = bytes(row);
  for (; ntok >= 4; ntok -= 4, x += 4 * xs, out += 4) {
    K::template run<4>(r, x, xs, nb, out);
  }
  switch (ntok) {
    case 3:
      K::template run<3>(r, x, xs, nb, out);
      break;
    case 2:
      K::template run<2>(r, x, xs, nb, out);
      break;
    case 1:
      K::template run<1>(r, x, xs, nb, out);
      break;
    default:
      break;
  }
}

}  // namespace

void quantize_q8_k(const float* x, std::uint32_t n, q8k_block* out) {
  check_n("quantize_q8_k", n);
  for (std::uint32_t b = 0; b < n / qk_k; ++b) {
    const float* xb = x + b * qk_k;
    q8k_block& y = out[b];
    float amax = 0.0f;
    for (std::uint32_t i = 0; i < qk_k; ++i) {
      amax = std::max(amax, std::fabs(xb[i]));
    }
    y.d = amax / 127.0f;
    for (std::uint32_t i = 0; i < qk_k; ++i) {
      const float q = y.d > 0.0f ? std::round(xb[i] / y.d) : 0.0f;
      y.q[i] = static_cast<std::int8_t>(std::clamp(q, -127.0f, 127.0f));
    }
    for (int g = 0; g < 16; ++g) {
      int s = 0;
      for (int u = 0; u < 16; ++u) {
        s += y.q[16 * g + u];
      }
      y.bsums[g] = static_cast<std::int16_t>(s);
    }
  }
}

// The dequantizers do ggml's f32 operations in ggml's order. Compiled without FMA (this file has
// no -march flag, and these functions no target attribute), d1 * q - m1 rounds twice as in
// ggml's reference C and gguf-py; every product here is exact, so only that subtraction rounds.
void dequantize_q4_k(const std::byte* blocks, std::uint32_t n, float* out) {
  check_n("dequantize_q4_k", n);
  for (std::uint32_t b = 0; b < n / qk_k; ++b) {
    const std::uint8_t* blk = bytes(blocks) + b * q4_k_block_bytes;
    const float d = load_f16(blk);
    const float dmin = load_f16(blk + 2);
    std::uint8_t sc[8], m[8];
    q4k_scale_min(blk + q4k_scales_at, sc, m);
    const std::uint8_t* qs = blk + q4k_qs_at;
    float* y = out + b * qk_k;
    for (int i = 0; i < 4; ++i) {
      const float d1 = d * sc[2 * i], m1 = dmin * m[2 * i];
      const float d2 = d * sc[2 * i + 1], m2 = dmin * m[2 * i + 1];
      for (int l = 0; l < 32; ++l) {
        y[64 * i + l] = d1 * static_cast<float>(qs[32 * i + l] & 0xF) - m1;
        y[64 * i + 32 + l] = d2 * static_cast<float>(qs[32 * i + l] >> 4) - m2;
      }
    }
  }
}

void dequantize_q6_k(const std::byte* blocks, std::uint32_t n, float* out) {
  check_n("dequantize_q6_k", n);
  for (std::uint32_t b = 0; b < n / qk_k; ++b) {
    const std::uint8_t* blk = bytes(blocks) + b * q6_k_block_bytes;
    const float d = load_f16(blk + q6k_d_at);
    for (int n2 = 0; n2 < 2; ++n2) {
      const std::uint8_t* ql = blk + 64 * n2;
      const std::uint8_t* qh = blk + q6k_qh_at + 32 * n2;
      const auto* sc = reinterpret_cast<const std::int8_t*>(blk + q6k_scales_at + 8 * n2);
      float* y = out + b * qk_k + 128 * n2;
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * static_cast<float>(sc[is + 0]) * static_cast<float>(q1);
        y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
        y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
        y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
      }
    }
  }
}

void quantize_q4_k(const float* x, std::uint32_t n, std::byte* out) {
  check_n("quantize_q4_k", n);
  for (std::uint32_t b = 0; b < n / qk_k; ++b) {
    const float* xb = x + b * qk_k;
    auto* blk = reinterpret_cast<std::uint8_t*>(out) + b * q4_k_block_bytes;
    // Sub-block j covers [-mn_j, 15 * scale_j - mn_j]; its minimum is never above zero (the
    // format subtracts a non-negative dmin * m).
    float scale[8], mn[8], max_scale = 0.0f, max_mn = 0.0f;
    for (int j = 0; j < 8; ++j) {
      float lo = 0.0f, hi = xb[32 * j];
      for (int l = 0; l < 32; ++l) {
        lo = std::min(lo, xb[32 * j + l]);
        hi = std::max(hi, xb[32 * j + l]);
      }
      scale[j] = (hi - lo) / 15.0f;
      mn[j] = -lo;
      max_scale = std::max(max_scale, scale[j]);
      max_mn = std::max(max_mn, mn[j]);
    }
    const float d = store_f16(blk, max_scale / 63.0f);
    const float dmin = store_f16(blk + 2, max_mn / 63.0f);
    std::uint8_t sc[8], m[8];
    for (int j = 0; j < 8; ++j) {
      sc[j] = d > 0.0f
                  ? static_cast<std::uint8_t>(std::clamp(std::round(scale[j] / d), 0.0f, 63.0f))
                  : 0;
      m[j] = dmin > 0.0f
                 ? static_cast<std::uint8_t>(std::clamp(std::round(mn[j] / dmin), 0.0f, 63.0f))
                 : 0;
    }
    std::uint8_t* s = blk + q4k_scales_at;
    for (int j = 0; j < 4; ++j) {
      s[j] = static_cast<std::uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
      s[j + 4] = static_cast<std::uint8_t>(m[j] | ((m[j + 4] >> 4) << 6));
      s[j + 8] = static_cast<std::uint8_t>((sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4));
    }
    std::uint8_t q[256];
    for (int j = 0; j < 8; ++j) {
      const float step = d * sc[j], offset = dmin * m[j];
      for (int l = 0; l < 32; ++l) {
        const float v = step > 0.0f ? std::round((xb[32 * j + l] + offset) / step) : 0.0f;
        q[32 * j + l] = static_cast<std::uint8_t>(std::clamp(v, 0.0f, 15.0f));
      }
    }
    std::uint8_t* qs = blk + q4k_qs_at;
    for (int i = 0; i < 4; ++i) {
      for (int l = 0; l < 32; ++l) {
        qs[32 * i + l] = static_cast<std::uint8_t>(q[64 * i + l] | (q[64 * i + 32 + l] << 4));
      }
    }
  }
}

void quantize_q6_k(const float* x, std::uint32_t n, std::byte* out) {
  check_n("quantize_q6_k", n);
  for (std::uint32_t b = 0; b < n / qk_k; ++b) {
    const float* xb = x + b * qk_k;
    auto* blk = reinterpret_cast<std::uint8_t*>(out) + b * q6_k_block_bytes;
    float scale[16], max_scale = 0.0f;
    for (int g = 0; g < 16; ++g) {
      float amax = 0.0f;
      for (int u = 0; u < 16; ++u) {
        amax = std::max(amax, std::fabs(xb[16 * g + u]));
      }
      scale[g] = amax / 31.0f;
      max_scale = std::max(max_scale, scale[g]);
    }
    const float d = store_f16(blk + q6k_d_at, max_scale / 127.0f);
    std::uint8_t u8[256];  // q + 32, in 0..63
    for (int g = 0; g < 16; ++g) {
      const float sc = d > 0.0f ? std::clamp(std::round(scale[g] / d), 0.0f, 127.0f) : 0.0f;
      blk[q6k_scales_at + g] = static_cast<std::uint8_t>(static_cast<std::int8_t>(sc));
      const float step = d * sc;
      for (int u = 0; u < 16; ++u) {
        const float v = step > 0.0f ? std::round(xb[16 * g + u] / step) : 0.0f;
        u8[16 * g + u] = static_cast<std::uint8_t>(std::clamp(v, -32.0f, 31.0f) + 32.0f);
      }
    }
    for (int n2 = 0; n2 < 2; ++n2) {
      std::uint8_t* ql = blk + 64 * n2;
      std::uint8_t* qh = blk + q6k_qh_at + 32 * n2;
      const std::uint8_t* y = u8 + 128 * n2;
      for (int l = 0; l < 32; ++l) {
        ql[l] = static_cast<std::uint8_t>((y[l] & 0xF) | ((y[l + 64] & 0xF) << 4));
        ql[l + 32] = static_cast<std::uint8_t>((y[l + 32] & 0xF) | ((y[l + 96] & 0xF) << 4));
        qh[l] = static_cast<std::uint8_t>((y[l] >> 4) | ((y[l + 32] >> 4) << 2) |
                                          ((y[l + 64] >> 4) << 4) | ((y[l + 96] >> 4) << 6));
      }
    }
  }
}

kdot_fn kdot_q4_k(oasiskv::cpu_isa isa) {
  switch (int_dot_path(isa)) {
#if OASISKV_X86_KERNELS
    case oasiskv::cpu_isa::avx2:
      return &kdot<q4k_avx2>;
    case oasiskv::cpu_isa::avx512_vnni:
      return &kdot<q4k_vnni>;
#endif
    default:
      return &kdot<q4k_scalar>;
  }
}

kdot_fn kdot_q6_k(oasiskv::cpu_isa isa) {
  switch (int_dot_path(isa)) {
#if OASISKV_X86_KERNELS
    case oasiskv::cpu_isa::avx2:
      return &kdot<q6k_avx2>;
    case oasiskv::cpu_isa::avx512_vnni:
      return &kdot<q6k_vnni>;
#endif
    default:
      return &kdot<q6k_scalar>;
  }
}

}  // namespace mini_decoder

#include "oasiskv/cpu/kernel_end.hpp"
