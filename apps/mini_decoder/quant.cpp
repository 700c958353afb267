// SPDX-License-Identifier: Apache-2.0
#include "quant.hpp"

// GCC 12 reports the `_mm512_undefined_*` placeholders inside its own AVX-512 headers as
// maybe-uninitialized (a known false positive); silence it for this file's intrinsics only.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <cblas.h>

#include <cstring>
#include <memory>
#include <vector>

#include "common.hpp"
#include "kquants.hpp"
#include "oasiskv/attention/cpu/thread_pool.hpp"
#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/isa.hpp"
#include "quant_int8.hpp"

extern "C" void openblas_set_num_threads(int);  // OpenBLAS's own; not in cblas.h everywhere

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

namespace {

std::uint16_t load_u16(const std::byte* p) {
  std::uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// ---- scalar path: the definition the vector paths must match closely ----------------------

void dequant_block_scalar(quant_type t, const std::byte* b, float* out) {
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

void matmul_scalar(const weight_matrix& w, const float* x, std::uint32_t n, float* y,
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
          dequant_block_scalar(w.type, row + c / 32 * block_bytes(w.type), tmp);
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

OASISKV_TARGET_AVX512 void matmul_avx512(const weight_matrix& w, const float* x, std::uint32_t n,
                                         float* y, std::uint32_t r0, std::uint32_t r1) {
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

OASISKV_TARGET_AVX2 void matmul_avx2(const weight_matrix& w, const float* x, std::uint32_t n,
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

using matmul_fn = void (*)(const weight_matrix&, const float*, std::uint32_t, float*, std::uint32_t,
                           std::uint32_t);

// The f32 product of a K-quant matrix: each row expanded to f32, then dotted with f32
// activations (the reference for the K-quants' int8 path, not a fast one).
void matmul_dequantized(const weight_matrix& w, const float* x, std::uint32_t n, float* y,
                        std::uint32_t r0, std::uint32_t r1) {
  thread_local std::vector<float> row;
  row.resize(w.cols);
  for (std::uint32_t r = r0; r < r1; ++r) {
    dequantize_row(w, r, row.data());
    for (std::uint32_t t = 0; t < n; ++t) {
      const float* xt = x + std::size_t{t} * w.cols;
      float acc = 0.0f;
      for (std::uint32_t c = 0; c < w.cols; ++c) {
        acc += row[c] * xt[c];
      }
      y[std::size_t{t} * w.rows + r] = acc;
    }
  }
}

struct isa_choice {
  matmul_fn fn;      // the f32-activation path
  dot_isa dot;       // the int8-activation path
  const char* name;  // of the f32 path
};

dot_isa best_dot_isa(oasiskv::cpu_isa isa) {
  if (isa == oasiskv::cpu_isa::avx512 && dot_isa_supported(dot_isa::avx512_vnni)) {
    return dot_isa::avx512_vnni;
  }
  if (isa != oasiskv::cpu_isa::scalar && dot_isa_supported(dot_isa::avx2)) {
    return dot_isa::avx2;
  }
  return dot_isa::scalar;
}

isa_choice choice_for(oasiskv::cpu_isa isa) {
  switch (isa) {
    case oasiskv::cpu_isa::avx512:
      return {matmul_avx512, best_dot_isa(isa), "avx512"};
    case oasiskv::cpu_isa::avx2:
      return {matmul_avx2, best_dot_isa(isa), "avx2"};
    default:
      return {matmul_scalar, dot_isa::scalar, "scalar"};
  }
}

isa_choice best_isa() {
  return choice_for(oasiskv::resolve_isa(oasiskv::cpu_isa::best));
}

isa_choice& current_isa() {
  static isa_choice c = best_isa();
  return c;
}

matmul_activations& current_activations() {
  static matmul_activations a = matmul_activations::int8;
  return a;
}

std::shared_ptr<oasiskv::cpu::thread_pool>& pool_slot() {
  static std::shared_ptr<oasiskv::cpu::thread_pool> p =
      std::make_shared<oasiskv::cpu::thread_pool>(1);
  return p;
}

// Chunks of 16 rows: enough work per item, and whole cache lines of y per thread. The pool
// hands chunks out one at a time, so a thread that falls behind (another job on its core)
// takes fewer of them.
template <typename F>
void for_row_chunks(std::uint32_t rows, F&& f) {
  const std::size_t chunks = (rows + 15) / 16;
  engine_pool().parallel_for(chunks, [&](std::size_t ch) {
    const auto r0 = static_cast<std::uint32_t>(ch * 16);
    f(r0, std::min(rows, r0 + 16));
  });
}

void matmul_k_int8(const weight_matrix& w, const float* x, std::uint32_t n, float* y, dot_isa isa) {
  const kdot_fn fn = w.type == quant_type::q4_k ? kdot_q4_k(isa) : kdot_q6_k(isa);
  const std::uint32_t nb = w.cols / qk_k;
  thread_local std::vector<q8k_block> xq;
  xq.resize(std::size_t{n} * nb);
  for (std::uint32_t t = 0; t < n; ++t) {
    quantize_q8_k(x + std::size_t{t} * w.cols, w.cols, xq.data() + std::size_t{t} * nb);
  }
  const q8k_block* xs = xq.data();
  for_row_chunks(w.rows, [&](std::uint32_t r0, std::uint32_t r1) {
    float out[4];
    for (std::uint32_t r = r0; r < r1; ++r) {
      for (std::uint32_t t = 0; t < n; t += 4) {
        const std::uint32_t nt = std::min<std::uint32_t>(4, n - t);
        fn(w.row(r), xs + std::size_t{t} * nb, nb, nt, nb, out);
        for (std::uint32_t i = 0; i < nt; ++i) {
          y[std::size_t{t + i} * w.rows + r] = out[i];
        }
      }
    }
  });
}

}  // namespace

const char* to_string(matmul_activations a) {
  return a == matmul_activations::int8 ? "int8" : "f32";
}

matmul_activations matmul_activations_from_string(const std::string& s) {
  if (s == "int8") {
    return matmul_activations::int8;
  }
  if (s == "f32") {
    return matmul_activations::f32;
  }
  fail("matmul activations '", s, "' is unknown (int8 or f32)");
}

void set_matmul_activations(matmul_activations a) {
  current_activations() = a;
}

matmul_activations get_matmul_activations() {
  return current_activations();
}

std::string matmul_isa() {
  const isa_choice& c = current_isa();
  return current_activations() == matmul_activations::int8 ? std::string(to_string(c.dot)) + " int8"
                                                           : std::string(c.name) + " f32";
}

void force_matmul_isa(const std::string& isa) {
  const isa_choice best = best_isa();
  if (isa == "best") {
    current_isa() = best;
  } else if (isa == "scalar") {
    current_isa() = choice_for(oasiskv::cpu_isa::scalar);
  } else if (isa == "avx2" && best.fn != matmul_scalar) {
    current_isa() = choice_for(oasiskv::cpu_isa::avx2);
  } else if (isa == "avx512" && best.fn == matmul_avx512) {
    current_isa() = best;
  } else {
    fail("matmul path '", isa, "' is unknown or unsupported on this CPU (best: ", best.name, ")");
  }
}

void dequantize_row(const weight_matrix& w, std::uint32_t r, float* out) {
  const std::byte* row = w.row(r);
  switch (w.type) {
    case quant_type::f32:
      std::memcpy(out, row, std::size_t{w.cols} * 4);
      break;
    case quant_type::f16:
      for (std::uint32_t c = 0; c < w.cols; ++c) {
        out[c] = f16_to_f32(load_u16(row + 2 * c));
      }
      break;
    case quant_type::q4_k:
      dequantize_q4_k(row, w.cols, out);
      break;
    case quant_type::q6_k:
      dequantize_q6_k(row, w.cols, out);
      break;
    default:
      for (std::uint32_t c = 0; c < w.cols; c += 32) {
        dequant_block_scalar(w.type, row + c / 32 * block_bytes(w.type), out + c);
      }
  }
}

void dequantize(const weight_matrix& w, std::vector<float>& out) {
  out.resize(std::size_t{w.rows} * w.cols);
  for_row_chunks(w.rows, [&](std::uint32_t r0, std::uint32_t r1) {
    for (std::uint32_t r = r0; r < r1; ++r) {
      dequantize_row(w, r, out.data() + std::size_t{r} * w.cols);
    }
  });
}

void matmul_quantized(const weight_matrix& w, const float* x, std::uint32_t n, float* y) {
  if (n == 0) {
    return;
  }
  const isa_choice& c = current_isa();
  const bool k_quant = w.type == quant_type::q4_k || w.type == quant_type::q6_k;
  if (current_activations() == matmul_activations::int8) {
    if (w.type == quant_type::q4_1 || w.type == quant_type::q8_0) {
      thread_local q8_activations buffer;
      q8_activations& a = buffer;  // the workers read the calling thread's buffer
      quantize_activations(x, n, w.cols, a);
      const int8_matmul_fn fn = int8_matmul_kernel(w.type, c.dot);
      const panel_matmul_fn pf = w.panels != nullptr && c.dot == dot_isa::avx512_vnni
                                     ? panel_matmul_kernel(w.type)
                                     : nullptr;
      const std::uint32_t panels = pf != nullptr ? w.rows / panel_rows : 0;
      static_assert(panel_rows == 16, "for_row_chunks hands out 16-row chunks: one panel each");
      for_row_chunks(w.rows, [&](std::uint32_t r0, std::uint32_t r1) {
        if (r0 / panel_rows < panels) {
          pf(w, a, y, r0 / panel_rows);
        } else {
          fn(w, a, y, r0, r1);
        }
      });
      return;
    }
    if (k_quant) {
      matmul_k_int8(w, x, n, y, c.dot);
      return;
    }
  }
  const matmul_fn fn = k_quant ? matmul_dequantized : c.fn;
  for_row_chunks(w.rows, [&](std::uint32_t r0, std::uint32_t r1) { fn(w, x, n, y, r0, r1); });
}

void matmul_prefill(const weight_matrix& w, const float* x, std::uint32_t n, float* y,
                    std::vector<float>& scratch) {
  const float* wf = nullptr;
  if (w.type == quant_type::f32) {
    wf = reinterpret_cast<const float*>(w.data);
  } else {
    dequantize(w, scratch);
    wf = scratch.data();
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(n),
              static_cast<int>(w.rows), static_cast<int>(w.cols), 1.0f, x, static_cast<int>(w.cols),
              wf, static_cast<int>(w.cols), 0.0f, y, static_cast<int>(w.rows));
}

void set_num_threads(int n) {
  if (n < 1) {
    fail("--threads = ", n, " must be at least 1");
  }
  if (engine_pool().size() != static_cast<unsigned>(n)) {
    pool_slot() = std::make_shared<oasiskv::cpu::thread_pool>(static_cast<unsigned>(n));
  }
  openblas_set_num_threads(n);
}

int num_threads() {
  return static_cast<int>(engine_pool().size());
}

oasiskv::cpu::thread_pool& engine_pool() {
  return *pool_slot();
}

std::shared_ptr<oasiskv::cpu::thread_pool> shared_engine_pool() {
  return pool_slot();
}

}  // namespace mini_decoder
