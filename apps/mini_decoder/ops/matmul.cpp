// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/ops/matmul.hpp>

#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include <mini_decoder/io/error.hpp>
#include <mini_decoder/ops/f32_matmul.hpp>
#include <mini_decoder/ops/int8_matmul.hpp>
#include <mini_decoder/ops/int_dot_path.hpp>
#include <mini_decoder/ops/kquants.hpp>
#include <mini_decoder/ops/threads.hpp>

#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/cpu/thread_pool.hpp"

namespace mini_decoder {

namespace {

std::uint16_t load_u16(const std::byte* p) {
  std::uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

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
  f32_matmul_fn fn;      // the f32-activation path
  oasiskv::cpu_isa dot;  // the int8-activation path: scalar, avx2 or avx512_vnni
  const char* name;      // of the f32 path
};

isa_choice choice_for(oasiskv::cpu_isa isa) {
  switch (isa) {
    case oasiskv::cpu_isa::avx512:
      return {f32_matmul_avx512, int_dot_path(isa), "avx512"};
    case oasiskv::cpu_isa::avx2:
      return {f32_matmul_avx2, int_dot_path(isa), "avx2"};
    default:
      return {f32_matmul_scalar, oasiskv::cpu_isa::scalar, "scalar"};
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

void matmul_k_int8(const weight_matrix& w, const float* x, std::uint32_t n, float* y,
                   oasiskv::cpu_isa isa) {
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
  } else if (isa == "avx2" && best.fn != f32_matmul_scalar) {
    current_isa() = choice_for(oasiskv::cpu_isa::avx2);
  } else if (isa == "avx512" && best.fn == f32_matmul_avx512) {
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
        dequantize_block(w.type, row + c / 32 * block_bytes(w.type), out + c);
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
      const panel_matmul_fn pf = w.panels != nullptr && c.dot == oasiskv::cpu_isa::avx512_vnni
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
  const f32_matmul_fn fn = k_quant ? matmul_dequantized : c.fn;
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

}  // namespace mini_decoder
