// SPDX-License-Identifier: Apache-2.0
// The mini-decoder's int8 products of Q4_1 and Q8_0 matrices
// (apps/mini_decoder/ops/int8_matmul.cpp): every code path this CPU runs against a double-precision
// model of the same quantized product, the activation quantization against its definition, the int8
// product against the f32 one within the bound that activation rounding allows, and per-token
// results that do not depend on how many tokens share a call.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <mini_decoder/io/error.hpp>
#include <mini_decoder/io/mapped_file.hpp>
#include <mini_decoder/ops/int8_matmul.hpp>
#include <mini_decoder/ops/int_dot_path.hpp>
#include <mini_decoder/ops/matmul.hpp>

#include "oasiskv/core/dtype.hpp"
#include "support.hpp"

using namespace mini_decoder;
using mini_decoder::test::error_of;

namespace {

std::uint16_t f16_bits(float v) {
  return oasiskv::f16::from_float(v).bits;
}

// A row-major matrix of random blocks: scales drawn from [lo, hi), random quant bytes.
struct test_matrix {
  std::vector<std::byte> bytes;
  weight_matrix w;
  test_matrix(quant_type t, std::uint32_t rows, std::uint32_t cols, std::mt19937& rng) {
    const std::size_t rb = row_bytes(t, cols);
    bytes.resize(rb * rows);
    std::uniform_real_distribution<float> scale(0.002f, 0.05f), offset(-0.2f, 0.2f);
    std::uniform_int_distribution<int> byte(0, 255);
    for (std::size_t i = 0; i < bytes.size(); ++i) {
      bytes[i] = std::byte(static_cast<unsigned char>(byte(rng)));
    }
    const std::size_t bb = block_bytes(t);
    for (std::size_t off = 0; off < bytes.size(); off += bb) {
      const std::uint16_t d = f16_bits(scale(rng)), m = f16_bits(offset(rng));
      std::memcpy(&bytes[off], &d, 2);
      if (t == quant_type::q4_1) {
        std::memcpy(&bytes[off + 2], &m, 2);
      }
    }
    w = weight_matrix{t, bytes.data(), rows, cols, rb};
  }
};

std::vector<float> random_activations(std::uint32_t n, std::uint32_t cols, std::mt19937& rng) {
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(std::size_t{n} * cols);
  for (float& v : x) {
    v = g(rng);
  }
  // One all-zero block and one block with a single large value: scale 0 and a coarse scale.
  if (cols >= 64) {
    std::fill(x.begin() + 32, x.begin() + 64, 0.0f);
    x[5] = 40.0f;
  }
  return x;
}

// The model: the quantized product in double, from dequantized weights and the activations'
// own d * q, summed in a plain loop.
double model_dot(const weight_matrix& w, std::uint32_t r, const q8_activations& a,
                 std::uint32_t t) {
  std::vector<float> wr(w.cols);
  dequantize_row(w, r, wr.data());
  double sum = 0.0;
  for (std::uint32_t c = 0; c < w.cols; ++c) {
    const double x = double{a.d[t * a.d_stride() + c / 32]} * a.q[t * a.q_stride() + c];
    sum += double{wr[c]} * x;
  }
  return sum;
}

double abs_dot(const weight_matrix& w, std::uint32_t r, const q8_activations& a, std::uint32_t t) {
  std::vector<float> wr(w.cols);
  dequantize_row(w, r, wr.data());
  double sum = 0.0;
  for (std::uint32_t c = 0; c < w.cols; ++c) {
    sum += std::abs(double{wr[c]} * a.d[t * a.d_stride() + c / 32] * a.q[t * a.q_stride() + c]);
  }
  return sum;
}

std::vector<oasiskv::cpu_isa> paths_here() {
  std::vector<oasiskv::cpu_isa> p;
  for (oasiskv::cpu_isa i :
       {oasiskv::cpu_isa::scalar, oasiskv::cpu_isa::avx2, oasiskv::cpu_isa::avx512_vnni}) {
    if (oasiskv::isa_supported(i)) {
      p.push_back(i);
    }
  }
  return p;
}

// Restores the process-wide matmul settings at scope exit.
struct matmul_settings_guard {
  matmul_activations a = get_matmul_activations();
  ~matmul_settings_guard() {
    set_matmul_activations(a);
    force_matmul_isa("best");
  }
};

}  // namespace

TEST_CASE("quant int8: activations quantized per 32-value block as defined") {
  std::mt19937 rng(7);
  const std::uint32_t n = 3, cols = 160;
  const auto x = random_activations(n, cols, rng);
  q8_activations a;
  quantize_activations(x.data(), n, cols, a);
  REQUIRE(a.blocks == 5);
  REQUIRE(a.groups == 2);
  for (std::uint32_t t = 0; t < n; ++t) {
    for (std::uint32_t b = 0; b < a.blocks; ++b) {
      float amax = 0.0f;
      for (int j = 0; j < 32; ++j) {
        amax = std::max(amax, std::abs(x[t * cols + 32 * b + j]));
      }
      const float d = a.d[t * a.d_stride() + b];
      CHECK(d == amax / 127.0f);
      std::int32_t sum = 0;
      for (std::uint32_t j = 0; j < 32; ++j) {
        const std::uint32_t c = 32 * b + j;
        const std::int8_t q = a.q[t * a.q_stride() + c];
        sum += q;
        // Round to nearest: within half a step of the value, and never past +-127.
        CHECK(std::abs(x[t * cols + c] - d * q) <= 0.5f * d * (1.0f + 1e-6f));
        CHECK(std::abs(int{q}) <= 127);
        // The split copy holds the same values in the AVX-512 Q4_1 order.
        const std::uint32_t g = b / 4, k = b % 4;
        const std::size_t at = 128 * g + (j < 16 ? 16 * k + j : 64 + 16 * k + (j - 16));
        CHECK(a.q_split[t * a.q_stride() + at] == q);
      }
      CHECK(a.s[t * a.d_stride() + b] == d * static_cast<float>(sum));
    }
    // Padding to a whole 4-block group is zero.
    for (std::size_t c = a.blocks * 32; c < a.q_stride(); ++c) {
      CHECK(a.q[t * a.q_stride() + c] == 0);
    }
  }
}

TEST_CASE("quant int8: every path equals the double model of the quantized product") {
  std::mt19937 rng(11);
  const auto paths = paths_here();
  REQUIRE(!paths.empty());
  MESSAGE("int8 matmul paths on this CPU: " << paths.size());
  for (const quant_type t : {quant_type::q4_1, quant_type::q8_0}) {
    // 1-9 blocks cover every partial 4-block group (Q4_1) and odd block counts (Q8_0); 576 is
    // SmolLM2's width.
    for (const std::uint32_t cols : {32u, 64u, 96u, 128u, 160u, 224u, 288u, 576u}) {
      const std::uint32_t rows = 37, n = 5;
      test_matrix m(t, rows, cols, rng);
      const auto x = random_activations(n, cols, rng);
      q8_activations a;
      quantize_activations(x.data(), n, cols, a);
      for (const oasiskv::cpu_isa isa : paths) {
        CAPTURE(to_string(t));
        CAPTURE(cols);
        const std::string isa_name(to_string(isa));
        CAPTURE(isa_name);
        std::vector<float> y(std::size_t{n} * rows, std::nanf(""));
        // Two row ranges, as the threads split them.
        int8_matmul_kernel(t, isa)(m.w, a, y.data(), 0, 16);
        int8_matmul_kernel(t, isa)(m.w, a, y.data(), 16, rows);
        for (std::uint32_t tok = 0; tok < n; ++tok) {
          for (std::uint32_t r = 0; r < rows; ++r) {
            const double want = model_dot(m.w, r, a, tok);
            const double tol = 1e-5 * abs_dot(m.w, r, a, tok) + 1e-6;
            const double err = std::abs(double{y[tok * rows + r]} - want);
            CHECK(err <= tol);  // false for a NaN
          }
        }
      }
    }
  }
}

TEST_CASE("quant int8: a token's result does not depend on how many tokens share the call") {
  std::mt19937 rng(13);
  for (const quant_type t : {quant_type::q4_1, quant_type::q8_0}) {
    const std::uint32_t rows = 19, cols = 288, n = 7;
    test_matrix m(t, rows, cols, rng);
    const auto x = random_activations(n, cols, rng);
    for (const oasiskv::cpu_isa isa : paths_here()) {
      CAPTURE(to_string(t));
      const std::string isa_name(to_string(isa));
      CAPTURE(isa_name);
      q8_activations all;
      quantize_activations(x.data(), n, cols, all);
      std::vector<float> y_all(std::size_t{n} * rows);
      int8_matmul_kernel(t, isa)(m.w, all, y_all.data(), 0, rows);
      for (std::uint32_t tok = 0; tok < n; ++tok) {
        q8_activations one;
        quantize_activations(x.data() + std::size_t{tok} * cols, 1, cols, one);
        std::vector<float> y_one(rows);
        int8_matmul_kernel(t, isa)(m.w, one, y_one.data(), 0, rows);
        for (std::uint32_t r = 0; r < rows; ++r) {
          CHECK(std::memcmp(&y_one[r], &y_all[tok * rows + r], sizeof(float)) == 0);
        }
      }
    }
  }
}

TEST_CASE("quant int8: matmul_quantized stays within activation rounding of the f32 product") {
  std::mt19937 rng(17);
  matmul_settings_guard guard;
  for (const quant_type t : {quant_type::q4_1, quant_type::q8_0}) {
    const std::uint32_t rows = 64, cols = 576, n = 3;
    test_matrix m(t, rows, cols, rng);
    const auto x = random_activations(n, cols, rng);
    std::vector<float> exact(std::size_t{n} * rows), int8(std::size_t{n} * rows);
    set_matmul_activations(matmul_activations::f32);
    matmul_quantized(m.w, x.data(), n, exact.data());
    set_matmul_activations(matmul_activations::int8);
    matmul_quantized(m.w, x.data(), n, int8.data());
    CHECK(matmul_isa().find("int8") != std::string::npos);
    q8_activations a;
    quantize_activations(x.data(), n, cols, a);
    std::vector<float> wr(cols);
    for (std::uint32_t tok = 0; tok < n; ++tok) {
      for (std::uint32_t r = 0; r < rows; ++r) {
        // |x - d q| <= d/2 per value, so the products differ by at most sum |w| d / 2, plus
        // the f32 rounding of both sums.
        dequantize_row(m.w, r, wr.data());
        double bound = 0.0, mag = 0.0;
        for (std::uint32_t c = 0; c < cols; ++c) {
          bound += std::abs(double{wr[c]}) * a.d[tok * a.d_stride() + c / 32] / 2;
          mag += std::abs(double{wr[c]} * x[tok * cols + c]);
        }
        const double err = std::abs(double{int8[tok * rows + r]} - exact[tok * rows + r]);
        CHECK(err <= bound + 1e-5 * mag);
      }
    }
  }
}

TEST_CASE("quant int8: settings and bad input") {
  matmul_settings_guard guard;
  CHECK(matmul_activations_from_string("f32") == matmul_activations::f32);
  CHECK(matmul_activations_from_string("int8") == matmul_activations::int8);
  CHECK(error_of([] { matmul_activations_from_string("int4"); }).find("'int4'") !=
        std::string::npos);
  CHECK(error_of([] { force_matmul_isa("neon"); }).find("'neon'") != std::string::npos);
  std::vector<float> x(48, 1.0f);
  q8_activations a;
  CHECK(error_of([&] { quantize_activations(x.data(), 1, 48, a); }).find("48 columns") !=
        std::string::npos);
  x.resize(64);
  x[40] = std::nanf("");
  CHECK(error_of([&] { quantize_activations(x.data(), 1, 64, a); }).find("columns 32-63") !=
        std::string::npos);
  CHECK(error_of([] {
          int8_matmul_kernel(quant_type::f16, oasiskv::cpu_isa::scalar);
        }).find("F16") != std::string::npos);
  force_matmul_isa("scalar");
  CHECK(matmul_isa() == "scalar int8");
  set_matmul_activations(matmul_activations::f32);
  CHECK(matmul_isa() == "scalar f32");
}

namespace {

// A matrix's panel copy in page-aligned memory, as the model loader makes it.
struct panel_copy {
  page_buffer mem;
  panel_copy(weight_matrix& w) : mem(panel_bytes(w)) {
    pack_panels(w, mem.data());
    w.panels = mem.data();
  }
};

// Reads row r's value c back out of the panel layout (ops/int8_matmul.hpp), independently of the
// kernels: the stored quant byte (Q8_0: the signed value; Q4_1: the nibble) and the block's d
// (and m) bits.
struct panel_value {
  int q;
  std::uint16_t d, m;
};
panel_value read_panel(const weight_matrix& w, std::uint32_t r, std::uint32_t c) {
  const bool q4 = w.type == quant_type::q4_1;
  const std::uint32_t blocks = w.cols / 32, b = c / 32, e = c % 32, i = r % 16;
  const std::size_t scale = q4 ? 64 : 32, values = q4 ? 256 : 512;
  const std::size_t scale_area = (blocks * scale + 63) / 64 * 64;
  const std::byte* panel = w.panels + std::size_t{r / 16} * (scale_area + blocks * values);
  panel_value v{};
  std::memcpy(&v.d, panel + b * scale + 2 * i, 2);
  const auto* vals = reinterpret_cast<const std::uint8_t*>(panel + scale_area + b * values);
  if (q4) {
    std::memcpy(&v.m, panel + b * scale + 32 + 2 * i, 2);
    const std::uint32_t k = (e % 16) / 4, j = e % 4;
    const std::uint8_t byte = vals[64 * k + 4 * i + j];
    v.q = e < 16 ? byte & 0x0F : byte >> 4;
  } else {
    v.q = int{vals[64 * (e / 4) + 4 * i + e % 4]} - 128;
  }
  return v;
}

}  // namespace

TEST_CASE("quant int8: the panel copy holds every whole panel's values and scales") {
  std::mt19937 rng(19);
  for (const quant_type t : {quant_type::q4_1, quant_type::q8_0}) {
    for (const std::uint32_t cols : {32u, 64u, 96u, 576u}) {
      test_matrix m(t, 37, cols, rng);
      CAPTURE(to_string(t));
      CAPTURE(cols);
      const std::size_t scale = t == quant_type::q4_1 ? 64 : 32,
                        per = t == quant_type::q4_1 ? 256 : 512;
      CHECK(panel_bytes(m.w) == 2 * ((cols / 32 * scale + 63) / 64 * 64 + cols / 32 * per));
      panel_copy pc(m.w);
      for (std::uint32_t r = 0; r < 32; ++r) {  // rows 32-36 are no whole panel
        const std::byte* row = m.w.row(r);
        for (std::uint32_t c = 0; c < cols; ++c) {
          const panel_value v = read_panel(m.w, r, c);
          const std::byte* blk = row + (c / 32) * block_bytes(t);
          std::uint16_t d, mm = 0;
          std::memcpy(&d, blk, 2);
          int q;
          if (t == quant_type::q4_1) {
            std::memcpy(&mm, blk + 2, 2);
            const auto nib = static_cast<std::uint8_t>(blk[4 + c % 16]);
            q = c % 32 < 16 ? nib & 0x0F : nib >> 4;
          } else {
            q = static_cast<std::int8_t>(blk[2 + c % 32]);
          }
          CHECK(v.q == q);
          CHECK(v.d == d);
          CHECK(v.m == mm);
        }
      }
    }
  }
  std::vector<std::byte> f16(64 * 32 * 2);
  const weight_matrix h{quant_type::f16, f16.data(), 32, 32, 64};
  CHECK(panel_bytes(h) == 0);
  CHECK(error_of([&] { pack_panels(h, nullptr); }).find("F16") != std::string::npos);
  test_matrix q(quant_type::q8_0, 16, 64, rng);
  page_buffer mem(panel_bytes(q.w) + 64);
  CHECK(error_of([&] { pack_panels(q.w, mem.data() + 8); }).find("aligned") != std::string::npos);
}

TEST_CASE("quant int8: the panel kernels equal the double model, whatever the token count") {
  std::mt19937 rng(23);
  if (panel_matmul_kernel(quant_type::q4_1) == nullptr) {
    MESSAGE("no AVX-512 VNNI on this CPU: the panel kernels do not run here");
    CHECK((panel_matmul_kernel(quant_type::q8_0) == nullptr));
    return;
  }
  for (const quant_type t : {quant_type::q4_1, quant_type::q8_0}) {
    for (const std::uint32_t cols : {32u, 64u, 160u, 576u}) {
      const std::uint32_t rows = 48, n = 7;  // 4 + 3 tokens: two tiles
      test_matrix m(t, rows, cols, rng);
      panel_copy pc(m.w);
      const auto x = random_activations(n, cols, rng);
      q8_activations a;
      quantize_activations(x.data(), n, cols, a);
      CAPTURE(to_string(t));
      CAPTURE(cols);
      std::vector<float> y(std::size_t{n} * rows, std::nanf(""));
      for (std::uint32_t p = 0; p < rows / 16; ++p) {
        panel_matmul_kernel(t)(m.w, a, y.data(), p);
      }
      for (std::uint32_t tok = 0; tok < n; ++tok) {
        for (std::uint32_t r = 0; r < rows; ++r) {
          const double want = model_dot(m.w, r, a, tok);
          const double tol = 1e-5 * abs_dot(m.w, r, a, tok) + 1e-6;
          CHECK(std::abs(double{y[tok * rows + r]} - want) <= tol);  // false for a NaN
        }
      }
      // One token at a time: bit-identical sums.
      for (std::uint32_t tok = 0; tok < n; ++tok) {
        q8_activations one;
        quantize_activations(x.data() + std::size_t{tok} * cols, 1, cols, one);
        std::vector<float> y_one(rows);
        for (std::uint32_t p = 0; p < rows / 16; ++p) {
          panel_matmul_kernel(t)(m.w, one, y_one.data(), p);
        }
        CHECK(std::memcmp(y_one.data(), y.data() + std::size_t{tok} * rows, rows * sizeof(float)) ==
              0);
      }
    }
  }
}

TEST_CASE("quant int8: matmul_quantized over panels and a tail of rows equals the model") {
  std::mt19937 rng(29);
  matmul_settings_guard guard;
  set_matmul_activations(matmul_activations::int8);
  for (const quant_type t : {quant_type::q4_1, quant_type::q8_0}) {
    const std::uint32_t rows = 53, cols = 576, n = 2;  // 3 panels, then 5 rows read by row
    test_matrix m(t, rows, cols, rng);
    panel_copy pc(m.w);
    const auto x = random_activations(n, cols, rng);
    q8_activations a;
    quantize_activations(x.data(), n, cols, a);
    for (const oasiskv::cpu_isa isa :
         paths_here()) {  // the panels serve only the AVX-512 VNNI path
      CAPTURE(to_string(t));
      const std::string isa_name(to_string(isa));
      CAPTURE(isa_name);
      force_matmul_isa(isa == oasiskv::cpu_isa::scalar ? "scalar"
                       : isa == oasiskv::cpu_isa::avx2 ? "avx2"
                                                       : "avx512");
      std::vector<float> y(std::size_t{n} * rows, std::nanf(""));
      matmul_quantized(m.w, x.data(), n, y.data());
      for (std::uint32_t tok = 0; tok < n; ++tok) {
        for (std::uint32_t r = 0; r < rows; ++r) {
          const double want = model_dot(m.w, r, a, tok);
          const double tol = 1e-5 * abs_dot(m.w, r, a, tok) + 1e-6;
          CHECK(std::abs(double{y[tok * rows + r]} - want) <= tol);
        }
      }
    }
  }
}
