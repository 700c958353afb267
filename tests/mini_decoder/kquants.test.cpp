// SPDX-License-Identifier: Apache-2.0
// GGUF K-quants Q4_K / Q6_K: dequantization against the gguf package's own decoder
// (tools/kquants_reference.py), every integer dot path against a double-precision model and
// against each other, the Q8_K activation quantizer, the round-to-nearest quantizers, and bad
// input.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <mini_decoder/io/error.hpp>
#include <mini_decoder/ops/kquants.hpp>

#include "oasiskv/core/dtype.hpp"
#include "support/paths.hpp"

using namespace mini_decoder;

namespace {

struct reference_blocks {
  std::vector<std::byte> bytes;
  std::vector<float> values;
  std::size_t count = 0;
};

//! Reads the blocks of `type` ("q4_k" or "q6_k") from the committed reference file.
reference_blocks read_reference(const std::string& type, std::size_t block_bytes) {
  std::ifstream in(std::string(MINI_DECODER_TEST_DIR) + "/kquants_reference.txt");
  REQUIRE(in.good());
  reference_blocks r;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream s(line);
    std::string name, key;
    s >> name >> key;
    if (name != type) {
      continue;
    }
    if (key == "block") {
      std::string hex;
      s >> hex;
      REQUIRE(hex.size() == 2 * block_bytes);
      for (std::size_t i = 0; i < block_bytes; ++i) {
        r.bytes.push_back(static_cast<std::byte>(std::stoi(hex.substr(2 * i, 2), nullptr, 16)));
      }
      ++r.count;
    } else if (key == "values") {
      std::size_t got = 0;
      for (std::string v; s >> v; ++got) {
        r.values.push_back(std::strtof(v.c_str(), nullptr));
      }
      REQUIRE(got == qk_k);
    }
  }
  REQUIRE(r.count > 0);
  REQUIRE(r.values.size() == r.count * qk_k);
  return r;
}

void set_f16(std::byte* p, float v) {
  const oasiskv::f16 h = oasiskv::f16::from_float(v);
  std::memcpy(p, &h.bits, sizeof h.bits);
}

//! Random weight blocks: random bytes with f16 scales of magnitude in [1e-3, 1e-1].
std::vector<std::byte> random_blocks(std::mt19937& rng, bool q4, std::uint32_t nblocks) {
  const std::size_t bb = q4 ? q4_k_block_bytes : q6_k_block_bytes;
  std::vector<std::byte> w(bb * nblocks);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> logmag(std::log(1e-3f), std::log(1e-1f));
  std::bernoulli_distribution neg(0.3);
  auto scale = [&] {
    return (neg(rng) ? -1.0f : 1.0f) * std::exp(logmag(rng));
  };
  for (auto& b : w) {
    b = static_cast<std::byte>(byte(rng));
  }
  for (std::uint32_t b = 0; b < nblocks; ++b) {
    std::byte* blk = w.data() + b * bb;
    if (q4) {
      set_f16(blk, scale());
      set_f16(blk + 2, scale());
    } else {
      set_f16(blk + 208, scale());
    }
  }
  return w;
}

std::vector<q8k_block> random_activations(std::mt19937& rng, std::uint32_t nblocks) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> mag(0.01f, 10.0f);
  std::vector<float> x(nblocks * qk_k);
  for (std::uint32_t b = 0; b < nblocks; ++b) {
    const float m = mag(rng);
    for (std::uint32_t i = 0; i < qk_k; ++i) {
      x[b * qk_k + i] = m * nd(rng);
    }
  }
  std::vector<q8k_block> q(nblocks);
  quantize_q8_k(x.data(), static_cast<std::uint32_t>(x.size()), q.data());
  return q;
}

struct model_dot {
  double value = 0;  // sum of dequantize(w) * x_q.d * x_q.q
  double scale = 0;  // sum of |w * x|
};

model_dot model(const std::vector<float>& w, const q8k_block* x, std::uint32_t nblocks) {
  model_dot r;
  for (std::uint32_t b = 0; b < nblocks; ++b) {
    for (std::uint32_t i = 0; i < qk_k; ++i) {
      const double p = static_cast<double>(w[b * qk_k + i]) * static_cast<double>(x[b].d) *
                       static_cast<double>(x[b].q[i]);
      r.value += p;
      r.scale += std::fabs(p);
    }
  }
  return r;
}

std::vector<oasiskv::cpu_isa> supported_isas() {
  std::vector<oasiskv::cpu_isa> out;
  for (oasiskv::cpu_isa i :
       {oasiskv::cpu_isa::scalar, oasiskv::cpu_isa::avx2, oasiskv::cpu_isa::avx512_vnni}) {
    if (oasiskv::isa_supported(i)) {
      out.push_back(i);
    } else {
      MESSAGE("dot path ", std::string(to_string(i)), " is not supported on this CPU: not tested");
    }
  }
  return out;
}

//! Every supported path against the double model and the scalar path, for ntok 1..4 and
//! several row lengths; and each token's result bit-identical whatever ntok is.
void check_dots(bool q4, std::mt19937& rng,
                std::vector<std::byte> (*make)(std::mt19937&, bool, std::uint32_t)) {
  const std::vector<oasiskv::cpu_isa> isas = supported_isas();
  for (std::uint32_t nblocks : {1u, 2u, 6u}) {
    const std::vector<std::byte> w = make(rng, q4, nblocks);
    std::vector<float> wf(nblocks * qk_k);
    (q4 ? dequantize_q4_k : dequantize_q6_k)(w.data(), nblocks * qk_k, wf.data());
    const std::size_t stride = nblocks + 1;  // tokens' activations need not be contiguous
    const std::vector<q8k_block> x =
        random_activations(rng, static_cast<std::uint32_t>(4 * stride));
    float scalar[4];
    (q4 ? kdot_q4_k : kdot_q6_k)(oasiskv::cpu_isa::scalar)(w.data(), x.data(), stride, 4, nblocks,
                                                           scalar);
    for (oasiskv::cpu_isa isa : isas) {
      const kdot_fn f = (q4 ? kdot_q4_k : kdot_q6_k)(isa);
      const std::string isa_name(to_string(isa));
      oasiskv::testing::note_path(std::string("mini_decoder K-quant dots: ") + isa_name);
      float all[4];
      f(w.data(), x.data(), stride, 4, nblocks, all);
      for (std::uint32_t ntok = 1; ntok <= 4; ++ntok) {
        for (std::uint32_t first = 0; first + ntok <= 4; ++first) {
          float out[4] = {NAN, NAN, NAN, NAN};
          f(w.data(), x.data() + first * stride, stride, ntok, nblocks, out);
          for (std::uint32_t t = 0; t < ntok; ++t) {
            CAPTURE(isa_name);
            CAPTURE(nblocks);
            CAPTURE(ntok);
            CAPTURE(first);
            CAPTURE(t);
            const model_dot m = model(wf, x.data() + (first + t) * stride, nblocks);
            const double tol = 1e-5 * m.scale + 1e-30;
            CHECK(std::fabs(static_cast<double>(out[t]) - m.value) <= tol);
            CHECK(std::fabs(static_cast<double>(out[t]) - scalar[first + t]) <= tol);
            // Bit-identical to the same token computed in a group of four.
            CHECK(std::memcmp(&out[t], &all[first + t], sizeof(float)) == 0);
          }
        }
      }
    }
  }
}

//! Extreme blocks: every weight at its largest magnitude and scale.
std::vector<std::byte> extreme_blocks(std::mt19937& rng, bool q4, std::uint32_t nblocks) {
  std::vector<std::byte> w = random_blocks(rng, q4, nblocks);
  const std::size_t bb = q4 ? q4_k_block_bytes : q6_k_block_bytes;
  for (std::uint32_t b = 0; b < nblocks; ++b) {
    std::byte* blk = w.data() + b * bb;
    if (q4) {
      std::memset(blk + 4, 0xFF, 12);                   // scales and mins 63
      std::memset(blk + 16, b % 2 ? 0xFF : 0x00, 128);  // values 15 or 0
    } else {
      std::memset(blk, b % 2 ? 0xFF : 0x00, 192);  // values 31 or -32
      for (int g = 0; g < 16; ++g) {
        blk[192 + g] = static_cast<std::byte>(g % 2 ? 0x80 : 0x7F);  // -128 / 127
      }
    }
  }
  return w;
}

void check_extreme_activations(bool q4) {
  // Activations at -128 and 127 (Q8_K's full int8 range): no int16 saturation in any path.
  std::mt19937 rng(7);
  const std::uint32_t nblocks = 2;
  const std::vector<std::byte> w = extreme_blocks(rng, q4, nblocks);
  std::vector<float> wf(nblocks * qk_k);
  (q4 ? dequantize_q4_k : dequantize_q6_k)(w.data(), nblocks * qk_k, wf.data());
  std::vector<q8k_block> x(4 * nblocks);
  for (std::size_t b = 0; b < x.size(); ++b) {
    x[b].d = 0.01f;
    for (int i = 0; i < 256; ++i) {
      const int t = static_cast<int>(b / nblocks);
      x[b].q[i] = static_cast<std::int8_t>(t == 0 ? -128 : t == 1 ? 127 : (i % 2 ? 127 : -128));
      if (t == 3) {
        x[b].q[i] = static_cast<std::int8_t>(i % 32 < 16 ? 127 : -128);
      }
    }
    for (int g = 0; g < 16; ++g) {
      int s = 0;
      for (int u = 0; u < 16; ++u) {
        s += x[b].q[16 * g + u];
      }
      x[b].bsums[g] = static_cast<std::int16_t>(s);
    }
  }
  for (oasiskv::cpu_isa isa : supported_isas()) {
    float out[4] = {NAN, NAN, NAN, NAN};
    (q4 ? kdot_q4_k : kdot_q6_k)(isa)(w.data(), x.data(), nblocks, 4, nblocks, out);
    const std::string isa_name(to_string(isa));
    for (std::uint32_t t = 0; t < 4; ++t) {
      CAPTURE(isa_name);
      CAPTURE(t);
      const model_dot m = model(wf, x.data() + t * nblocks, nblocks);
      CHECK(std::fabs(static_cast<double>(out[t]) - m.value) <= 1e-5 * m.scale + 1e-30);
    }
  }
}

std::vector<float> random_floats(std::mt19937& rng, std::uint32_t n) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> mag(0.01f, 3.0f);
  std::vector<float> x(n);
  float m = 1.0f;
  for (std::uint32_t i = 0; i < n; ++i) {
    if (i % 32 == 0) {
      m = mag(rng);  // sub-blocks of very different ranges
    }
    x[i] = m * nd(rng);
  }
  return x;
}

float read_f16(const std::byte* p) {
  std::uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return oasiskv::f16{bits}.to_float();
}

}  // namespace

TEST_CASE("kquants: dequantize_q4_k and dequantize_q6_k equal the gguf package's decoder") {
  for (const bool q4 : {true, false}) {
    CAPTURE(q4);
    const reference_blocks r =
        read_reference(q4 ? "q4_k" : "q6_k", q4 ? q4_k_block_bytes : q6_k_block_bytes);
    std::vector<float> out(r.values.size(), NAN);
    (q4 ? dequantize_q4_k : dequantize_q6_k)(
        r.bytes.data(), static_cast<std::uint32_t>(r.values.size()), out.data());
    std::size_t mismatches = 0;
    for (std::size_t i = 0; i < out.size(); ++i) {
      // Bit-exact: the same f32 operations in the same order as ggml and gguf-py.
      if (std::memcmp(&out[i], &r.values[i], sizeof(float)) != 0) {
        if (++mismatches <= 5) {
          MESSAGE("element ", i, " (block ", i / qk_k, "): got ", out[i], ", reference ",
                  r.values[i]);
        }
      }
    }
    CHECK(mismatches == 0);
  }
}

TEST_CASE("kquants: Q4_K integer dots match a double model on every path, whatever ntok") {
  std::mt19937 rng(1234);
  check_dots(true, rng, random_blocks);
  check_dots(true, rng, extreme_blocks);
  check_extreme_activations(true);
}

TEST_CASE("kquants: Q6_K integer dots match a double model on every path, whatever ntok") {
  std::mt19937 rng(5678);
  check_dots(false, rng, random_blocks);
  check_dots(false, rng, extreme_blocks);
  check_extreme_activations(false);
}

TEST_CASE("kquants: quantize_q8_k values and bsums") {
  std::mt19937 rng(42);
  std::vector<float> x = random_floats(rng, 3 * qk_k);
  std::fill(x.begin() + qk_k, x.begin() + 2 * qk_k, 0.0f);  // an all-zero block
  x[2 * qk_k + 5] = -40.0f;                                 // the extreme is negative
  std::vector<q8k_block> q(3);
  quantize_q8_k(x.data(), static_cast<std::uint32_t>(x.size()), q.data());
  for (std::uint32_t b = 0; b < 3; ++b) {
    CAPTURE(b);
    float amax = 0.0f;
    for (std::uint32_t i = 0; i < qk_k; ++i) {
      amax = std::fmax(amax, std::fabs(x[b * qk_k + i]));
    }
    CHECK(q[b].d == amax / 127.0f);
    int bad_values = 0, bad_error = 0, bad_sums = 0;
    for (std::uint32_t i = 0; i < qk_k; ++i) {
      const float v = x[b * qk_k + i];
      const long expect = q[b].d > 0.0f ? std::lround(v / q[b].d) : 0;
      bad_values += static_cast<long>(q[b].q[i]) != expect;
      const float err = std::fabs(v - q[b].d * static_cast<float>(q[b].q[i]));
      bad_error += !(err <= 0.5f * q[b].d * (1.0f + 1e-5f));
    }
    for (int g = 0; g < 16; ++g) {
      int s = 0;
      for (int u = 0; u < 16; ++u) {
        s += q[b].q[16 * g + u];
      }
      bad_sums += q[b].bsums[g] != s;
    }
    CHECK(bad_values == 0);
    CHECK(bad_error == 0);
    CHECK(bad_sums == 0);
  }
  CHECK(q[1].d == 0.0f);
  CHECK(q[2].q[5] == -127);
}

TEST_CASE("kquants: quantize_q4_k round trip stays within the format's step") {
  // Bound per sub-block j of step S_j = d*sc_j and offset M_j = dmin*m_j: within the range,
  // rounding gives S_j/2; at the clamps the error is what rounding sc_j and m_j to integers
  // left uncovered, at most 15*d/2 + dmin/2.
  std::mt19937 rng(99);
  const std::uint32_t nblocks = 8;
  std::vector<float> x = random_floats(rng, nblocks * qk_k);
  for (std::uint32_t i = 0; i < qk_k; ++i) {
    x[i] = 0.0f;                                                    // all zero
    x[qk_k + i] = 0.5f + 0.001f * static_cast<float>(i);            // all positive
    x[2 * qk_k + i] = -2.0f + 0.003f * static_cast<float>(i % 32);  // all negative
  }
  std::vector<std::byte> blocks(nblocks * q4_k_block_bytes);
  quantize_q4_k(x.data(), nblocks * qk_k, blocks.data());
  std::vector<float> y(x.size(), NAN);
  dequantize_q4_k(blocks.data(), nblocks * qk_k, y.data());
  double sq_err = 0, sq_x = 0;
  for (std::uint32_t b = 0; b < nblocks; ++b) {
    const std::byte* blk = blocks.data() + b * q4_k_block_bytes;
    const float d = read_f16(blk), dmin = read_f16(blk + 2);
    CHECK(d >= 0.0f);
    CHECK(dmin >= 0.0f);
    for (int j = 0; j < 8; ++j) {
      std::uint8_t s[12];
      std::memcpy(s, blk + 4, 12);
      const int sc = j < 4 ? (s[j] & 63) : ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
      const float step = d * static_cast<float>(sc);
      const float bound = std::fmax(0.5f * step, 7.5f * d + 0.5f * dmin) * (1.0f + 1e-4f) + 1e-6f;
      int bad = 0;
      for (int l = 0; l < 32; ++l) {
        const std::size_t i = b * qk_k + 32 * j + l;
        const float err = std::fabs(y[i] - x[i]);
        bad += !(err <= bound);
        sq_err += static_cast<double>(err) * err;
        sq_x += static_cast<double>(x[i]) * x[i];
      }
      CAPTURE(b);
      CAPTURE(j);
      CHECK(bad == 0);
    }
  }
  for (std::uint32_t i = 0; i < qk_k; ++i) {
    CHECK(y[i] == 0.0f);
  }
  // Sanity: 4 bits per value leaves a few percent of relative RMS error.
  CHECK(std::sqrt(sq_err / sq_x) <= 0.1);
}

TEST_CASE("kquants: quantize_q6_k round trip stays within the format's step") {
  // Bound per group g of step S_g = d*sc_g: S_g/2 within the range, and at the clamps what
  // rounding sc_g left uncovered, at most 31*d/2.
  std::mt19937 rng(77);
  const std::uint32_t nblocks = 8;
  std::vector<float> x = random_floats(rng, nblocks * qk_k);
  for (std::uint32_t i = 0; i < qk_k; ++i) {
    x[i] = 0.0f;
    x[qk_k + i] = -1.0f + 0.001f * static_cast<float>(i);
  }
  std::vector<std::byte> blocks(nblocks * q6_k_block_bytes);
  quantize_q6_k(x.data(), nblocks * qk_k, blocks.data());
  std::vector<float> y(x.size(), NAN);
  dequantize_q6_k(blocks.data(), nblocks * qk_k, y.data());
  double sq_err = 0, sq_x = 0;
  for (std::uint32_t b = 0; b < nblocks; ++b) {
    const std::byte* blk = blocks.data() + b * q6_k_block_bytes;
    const float d = read_f16(blk + 208);
    for (int g = 0; g < 16; ++g) {
      const auto sc = static_cast<std::int8_t>(blk[192 + g]);
      CHECK(sc >= 0);
      const float step = d * static_cast<float>(sc);
      const float bound = std::fmax(0.5f * step, 15.5f * d) * (1.0f + 1e-4f) + 1e-6f;
      int bad = 0;
      for (int u = 0; u < 16; ++u) {
        const std::size_t i = b * qk_k + 16 * g + u;
        const float err = std::fabs(y[i] - x[i]);
        bad += !(err <= bound);
        sq_err += static_cast<double>(err) * err;
        sq_x += static_cast<double>(x[i]) * x[i];
      }
      CAPTURE(b);
      CAPTURE(g);
      CHECK(bad == 0);
    }
  }
  for (std::uint32_t i = 0; i < qk_k; ++i) {
    CHECK(y[i] == 0.0f);
  }
  CHECK(std::sqrt(sq_err / sq_x) <= 0.03);
}

TEST_CASE("kquants: bad input is a clear error") {
  std::vector<float> x(300, 1.0f);
  std::vector<q8k_block> q(2);
  std::vector<std::byte> blocks(2 * q6_k_block_bytes);
  auto message_of = [](auto&& f) {
    try {
      f();
    } catch (const decoder_error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  const std::string m1 = message_of([&] { quantize_q8_k(x.data(), 300, q.data()); });
  CHECK(m1.find("quantize_q8_k") != std::string::npos);
  CHECK(m1.find("300") != std::string::npos);
  const std::string m2 = message_of([&] { dequantize_q4_k(blocks.data(), 257, x.data()); });
  CHECK(m2.find("257") != std::string::npos);
  const std::string m3 = message_of([&] { dequantize_q6_k(blocks.data(), 100, x.data()); });
  CHECK(m3.find("100") != std::string::npos);
  const std::string m4 = message_of([&] { quantize_q4_k(x.data(), 255, blocks.data()); });
  CHECK(m4.find("255") != std::string::npos);
  const std::string m5 = message_of([&] { quantize_q6_k(x.data(), 511, blocks.data()); });
  CHECK(m5.find("511") != std::string::npos);
  for (oasiskv::cpu_isa isa :
       {oasiskv::cpu_isa::scalar, oasiskv::cpu_isa::avx2, oasiskv::cpu_isa::avx512_vnni}) {
    const std::string isa_name(to_string(isa));
    CAPTURE(isa_name);
    if (oasiskv::isa_supported(isa)) {
      CHECK_NOTHROW(kdot_q4_k(isa));
      CHECK_NOTHROW(kdot_q6_k(isa));
    } else {
      CHECK_THROWS_AS(kdot_q4_k(isa), decoder_error);
      CHECK_THROWS_AS(kdot_q6_k(isa), decoder_error);
    }
  }
  // An enumerator outside the known paths is unsupported too.
  const auto bogus = static_cast<oasiskv::cpu_isa>(7);
  CHECK_FALSE(oasiskv::isa_supported(bogus));
  CHECK_THROWS_AS(kdot_q4_k(bogus), decoder_error);
  CHECK_THROWS_AS(kdot_q6_k(bogus), decoder_error);
  CHECK(std::string(to_string(oasiskv::cpu_isa::avx512_vnni)) == "avx512_vnni");
}
