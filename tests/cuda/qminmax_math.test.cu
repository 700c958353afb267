// SPDX-License-Identifier: Apache-2.0
// The per-element math of cuda::device_quantized_minmax_summary (detail/qminmax_math.cuh), run on
// the HOST, needs no device: composed in the order qminmax_fold_kernel and the selector's scoring
// kernel use it, it must give the host quantized_minmax_summary's codes, scales, norms and
// overflow flags bit for bit (f16, bf16 and f32 keys, with infinities, NaNs, subnormals, signed
// zeros and keys that force the scale to grow), and scores equal to the host's `score` up to f32
// rounding that still bound every key's dot product.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "oasiskv/summary/cuda/detail/qminmax_math.cuh"
#pragma nv_diag_suppress 1675
#include "oasiskv/summary/quantized_minmax_summary.hpp"
#pragma nv_diag_default 1675

namespace {

namespace od = oasiskv::cuda::detail;
constexpr float inf = std::numeric_limits<float>::infinity();

// The device summary's state of one entry, kept on the host: [heads][d / 2] words, scales and
// norms per head, the bias.
struct emulated_entry {
  std::vector<std::uint32_t> words;
  std::vector<float> scale, norm;
  float bias = -inf;
  emulated_entry(std::uint32_t heads, std::uint32_t d)
      : words(std::size_t{heads} * d / 2, 0), scale(heads, 0.0f), norm(heads, 0.0f) {}
};

// qminmax_fold_kernel's steps, sequentially: keys (t, h, x) at keys[t * token_stride + h *
// head_stride + x].
template <class T>
void emulate_fold(emulated_entry& en, std::uint32_t heads, std::uint32_t d, const T* keys,
                  std::size_t token_stride, std::size_t head_stride, std::uint32_t count,
                  bool fresh_entry) {
  bool overflow = false;
  for (std::uint32_t h = 0; h < heads; ++h) {
    const T* k = keys + std::size_t{h} * head_stride;
    float mag = 0.0f;
    for (std::uint32_t x = 0; x < d; ++x) {
      float hi = -inf, lo = inf;
      for (std::uint32_t t = 0; t < count; ++t) {
        od::qminmax_take_key(oasiskv::to_float(k[std::size_t{t} * token_stride + x]), hi, lo, mag,
                             overflow);
      }
    }
    const bool fresh = fresh_entry || en.scale[h] == 0.0f;
    const int old_e = fresh ? od::qminmax_min_exponent : od::qminmax_exponent_of(en.scale[h]);
    const int e = od::qminmax_exponent(mag, old_e);
    const float s = od::qminmax_pow2f(e);
    const int shift = fresh || e <= old_e ? 0 : std::min(e - old_e, 31);
    std::uint64_t sq = 0;
    for (std::uint32_t p = 0; p < d / 2; ++p) {
      std::uint32_t& w = en.words[std::size_t{h} * (d / 2) + p];
      const std::uint32_t old = fresh ? 0u : w;
      std::int32_t c_hi[2], c_lo[2];
      for (int j = 0; j < 2; ++j) {
        c_hi[j] = fresh ? -127 : od::qminmax_rescale_max(od::qminmax_word_max(old, 2 * j), shift);
        c_lo[j] = fresh ? 127 : od::qminmax_rescale_min(od::qminmax_word_min(old, 2 * j), shift);
        float hi = -inf, lo = inf, unused = 0.0f;
        bool unused_flag = false;
        for (std::uint32_t t = 0; t < count; ++t) {
          od::qminmax_take_key(oasiskv::to_float(k[std::size_t{t} * token_stride + 2 * p + j]), hi,
                               lo, unused, unused_flag);
        }
        od::qminmax_quantize(hi, lo, s, c_hi[j], c_lo[j]);
        sq += od::qminmax_square(c_hi[j], c_lo[j]);
      }
      w = od::qminmax_pack(c_hi[0], c_lo[0], c_hi[1], c_lo[1]);
    }
    en.scale[h] = s;
    en.norm[h] = od::qminmax_norm(sq, e);
  }
  const bool was = !fresh_entry && en.bias == inf;
  en.bias = was || overflow ? inf : 0.0f;
}

void emulate_reset(emulated_entry& en) {
  std::fill(en.words.begin(), en.words.end(), 0u);
  std::fill(en.scale.begin(), en.scale.end(), 0.0f);
  std::fill(en.norm.begin(), en.norm.end(), 0.0f);
  en.bias = -inf;
}

std::uint32_t bits(float f) {
  return oasiskv::detail::bit_cast<std::uint32_t>(f);
}

// Entry b of the host summary against the emulation, bit for bit.
void check_same(const oasiskv::quantized_minmax_summary& hs, std::uint32_t b,
                const emulated_entry& en) {
  const oasiskv::kv_layout& l = hs.layout();
  std::vector<std::uint32_t> words(l.head_dim / 2);
  for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
    CAPTURE(h);
    const float s = hs.bound_words(h, b, words.data());
    CHECK(bits(s) == bits(en.scale[h]));
    CHECK(bits(hs.norm(h, b)) == bits(en.norm[h]));
    const std::vector<std::uint32_t> mine(en.words.begin() + std::size_t{h} * words.size(),
                                          en.words.begin() + std::size_t{h + 1} * words.size());
    CHECK(words == mine);
  }
  CHECK(hs.overflowed(b) == (en.bias == inf));
  CHECK((hs.tokens(b) == 0) == (en.bias == -inf));
}

// Keys mostly in [-3, 3), with values that stress the rules: infinities (left out, the entry
// scores +inf), NaN (ignored), large values (the scale grows and old codes are rescaled; beyond
// f16's range they become infinite f16 keys), subnormal and tiny values, signed zeros.
float key_value(std::mt19937& rng, bool specials) {
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  std::uniform_int_distribution<int> pick(0, 199);
  const int c = pick(rng);
  if (specials) {
    switch (c) {
      case 0:
        return inf;
      case 1:
        return -inf;
      case 2:
        return std::numeric_limits<float>::quiet_NaN();
      default:
        break;
    }
  }
  switch (c) {
    case 3:
      return 1.0e5f;
    case 4:
      return -7.0e4f;
    case 5:
      return 3.0e-9f;
    case 6:
      return -2.0e-41f;  // f32 subnormal
    case 7:
      return -0.0f;
    case 8:
      return 0.0f;
    case 9:
      return 300.0f;
    default:
      return u(rng) * (c < 40 ? 1.0e-3f : 1.0f);
  }
}

// Finite keys within every dtype's range, spread over magnitudes (the scales differ by head).
float tame_key(std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  std::uniform_int_distribution<int> pick(0, 99);
  const int c = pick(rng);
  return c == 0 ? 300.0f : c == 1 ? 3.0e-9f : u(rng) * (c < 20 ? 1.0e-3f : 1.0f);
}

}  // namespace

TEST_CASE("qminmax math on the host: the fold gives the host summary's bits") {
  std::mt19937 rng(4242);
  for (const auto dt : {oasiskv::dtype::f16, oasiskv::dtype::bf16, oasiskv::dtype::f32}) {
    for (const std::uint32_t d : {8u, 64u, 128u}) {
      for (const bool specials : {false, true}) {
        CAPTURE(static_cast<int>(dt));
        CAPTURE(d);
        CAPTURE(specials);
        const oasiskv::kv_layout l{1, 8, 2, d, 16, dt};
        const std::vector<std::uint32_t> fill{16, 5, 1, 16, 11, 0, 9, 3};
        const auto capacity = static_cast<std::uint32_t>(fill.size());
        oasiskv::quantized_minmax_summary hs(l, capacity);
        std::vector<emulated_entry> em(capacity, emulated_entry(l.num_kv_heads, d));
        std::vector<std::byte> slots(std::size_t{capacity} * l.block_bytes());
        oasiskv::visit_dtype(dt, [&](auto elem) {
          using T = decltype(elem);
          // Appends in chunks of 1-5 tokens, as rows [n][kv heads][d] (update's input).
          for (std::uint32_t e = 0; e < capacity; ++e) {
            CAPTURE(e);
            std::uniform_int_distribution<std::uint32_t> chunk(1, 5);
            std::byte* slot = slots.data() + std::size_t{e} * l.block_bytes();
            // Later chunks grow in magnitude now and then, so old codes get rescaled.
            float grow = 1.0f;
            for (std::uint32_t first = 0; first < fill[e];) {
              const std::uint32_t n = std::min(chunk(rng), fill[e] - first);
              std::vector<T> rows(std::size_t{n} * l.num_kv_heads * d);
              for (std::uint32_t t = 0; t < n; ++t) {
                for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
                  T* key =
                      reinterpret_cast<T*>(slot + l.key_offset(h)) + std::size_t{first + t} * d;
                  for (std::uint32_t x = 0; x < d; ++x) {
                    const T v = oasiskv::from_float<T>(key_value(rng, specials) * grow);
                    rows[(std::size_t{t} * l.num_kv_heads + h) * d + x] = v;
                    key[x] = v;
                  }
                }
              }
              hs.update(e, slot, first, n);
              emulate_fold(em[e], l.num_kv_heads, d, rows.data(), std::size_t{l.num_kv_heads} * d,
                           d, n, first == 0);
              check_same(hs, e, em[e]);
              first += n;
              grow = grow < 1024.0f ? grow * 4.0f : 1.0f;
            }
            check_same(hs, e, em[e]);
          }
          // Recompute from the slots (reset, then every token at once): the one-pass fold gives
          // the bits of the appends (the rescale is exact).
          for (std::uint32_t e = 0; e < capacity; ++e) {
            CAPTURE(e);
            emulated_entry again(l.num_kv_heads, d);
            if (fill[e] > 0) {
              const T* keys =
                  reinterpret_cast<const T*>(slots.data() + std::size_t{e} * l.block_bytes());
              emulate_fold(again, l.num_kv_heads, d, keys, d, std::size_t{l.tokens_per_block} * d,
                           fill[e], true);
            }
            CHECK(again.words == em[e].words);
            CHECK(again.norm == em[e].norm);
            CHECK(again.scale == em[e].scale);
            CHECK(bits(again.bias) == bits(em[e].bias));
          }
          // Reset then append: starts afresh.
          hs.reset(3);
          emulate_reset(em[3]);
          check_same(hs, 3, em[3]);
          hs.update(3, slots.data() + std::size_t{4} * l.block_bytes(), 0, 2);
          const T* keys4 =
              reinterpret_cast<const T*>(slots.data() + std::size_t{4} * l.block_bytes());
          emulate_fold(em[3], l.num_kv_heads, d, keys4, d, std::size_t{l.tokens_per_block} * d, 2,
                       true);
          check_same(hs, 3, em[3]);
        });
      }
    }
  }
}

TEST_CASE("qminmax math on the host: helpers match the host's scalar rules") {
  // round_up: nearest, one ulp up if below; zero steps to the least subnormal.
  CHECK(bits(od::qminmax_round_up(1.0)) == bits(1.0f));
  CHECK(od::qminmax_round_up(1.0 + 0x1p-30) == std::nextafter(1.0f, inf));
  CHECK(bits(od::qminmax_round_up(0x1p-160)) == 1u);
  CHECK(od::qminmax_round_up(1.0e300) == inf);
  // The exponent covers mag with 127 codes, from the entry's exponent up.
  CHECK(od::qminmax_exponent(0.0f, od::qminmax_min_exponent) == -126);
  CHECK(od::qminmax_exponent(127.0f, -126) == 0);
  CHECK(od::qminmax_exponent(127.5f, -126) == 1);
  CHECK(od::qminmax_exponent(1.0f, 3) == 3);
  CHECK(od::qminmax_exponent(std::numeric_limits<float>::max(), -126) == 122);
  CHECK(od::qminmax_pow2f(-126) == std::ldexp(1.0f, -126));
  CHECK(od::qminmax_pow2f(122) == std::ldexp(1.0f, 122));
  CHECK(od::qminmax_pow2f(128) == inf);
  CHECK(od::qminmax_exponent_of(std::ldexp(1.0f, -126)) == -126);
  CHECK(od::qminmax_exponent_of(std::ldexp(1.0f, 37)) == 37);
  // Rescale: ceil and floor of c / 2^k, for every code and shift.
  for (std::int32_t c = -127; c <= 127; ++c) {
    for (int k = 0; k <= 31; ++k) {
      CAPTURE(c);
      CAPTURE(k);
      const double q = std::ldexp(static_cast<double>(c), -k);
      CHECK(od::qminmax_rescale_max(c, k) == static_cast<std::int32_t>(std::ceil(q)));
      CHECK(od::qminmax_rescale_min(c, k) == static_cast<std::int32_t>(std::floor(q)));
    }
  }
  // A code word round-trips its four codes.
  const std::uint32_t w = od::qminmax_pack(-127, 5, 127, -127);
  CHECK(od::qminmax_word_max(w, 0) == -127);
  CHECK(od::qminmax_word_min(w, 0) == 5);
  CHECK(od::qminmax_word_max(w, 2) == 127);
  CHECK(od::qminmax_word_min(w, 2) == -127);
  // dp4a's integers: u8 by s8.
  CHECK(od::qminmax_dot4(0xff01ff02u, od::qminmax_pack(-127, 3, 2, -1), 10) ==
        10 + 2 * -127 + 255 * -3 + 1 * 2 + 255 * 1);
}

TEST_CASE("qminmax math on the host: scores equal the host summary's and bound every key") {
  std::mt19937 rng(77);
  for (const auto dt : {oasiskv::dtype::f16, oasiskv::dtype::bf16, oasiskv::dtype::f32}) {
    for (const std::uint32_t d : {64u, 128u}) {
      CAPTURE(static_cast<int>(dt));
      CAPTURE(d);
      const oasiskv::kv_layout l{1, 8, 2, d, 16, dt};
      const std::vector<std::uint32_t> fill{16, 5, 1, 16, 0, 9, 3, 12};
      const auto capacity = static_cast<std::uint32_t>(fill.size());
      oasiskv::quantized_minmax_summary hs(l, capacity);
      std::vector<emulated_entry> em(capacity, emulated_entry(l.num_kv_heads, d));
      std::vector<float> keys_f(std::size_t{capacity} * l.num_kv_heads * 16 * d);  // widened
      std::vector<std::byte> slots(std::size_t{capacity} * l.block_bytes());
      oasiskv::visit_dtype(dt, [&](auto elem) {
        using T = decltype(elem);
        for (std::uint32_t e = 0; e < capacity; ++e) {
          std::byte* slot = slots.data() + std::size_t{e} * l.block_bytes();
          for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
            T* key = reinterpret_cast<T*>(slot + l.key_offset(h));
            for (std::uint32_t i = 0; i < fill[e] * d; ++i) {
              // Entry 7 holds an infinite key: it scores +inf.
              const float v = e == 7 && h == 1 && i == 5 ? -inf : tame_key(rng);
              key[i] = oasiskv::from_float<T>(v);
              keys_f[((std::size_t{e} * l.num_kv_heads + h) * 16) * d + i] =
                  oasiskv::to_float(key[i]);
            }
          }
          if (fill[e] > 0) {
            hs.update(e, slot, 0, fill[e]);
            emulate_fold(em[e], l.num_kv_heads, d, reinterpret_cast<const T*>(slot), d,
                         std::size_t{l.tokens_per_block} * d, fill[e], true);
          }
        }
      });
      constexpr std::uint32_t rows = 5;
      std::vector<float> q(rows * d);
      std::uniform_real_distribution<float> uq(-1.0f, 1.0f);
      for (float& v : q) {
        v = uq(rng);
      }
      q[3] = 0.0f;
      q[d + 7] = -q[d + 7] * 40.0f;  // one large element: coarse codes for that row
      std::vector<std::uint32_t> ids(capacity);
      for (std::uint32_t e = 0; e < capacity; ++e) {
        ids[e] = e;
      }
      std::vector<float> host(std::size_t{capacity} * rows);
      std::vector<std::uint32_t> words(d / 2);
      for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
        CAPTURE(h);
        hs.score(h, ids, q.data(), rows, host.data());
        for (std::uint32_t r = 0; r < rows; ++r) {
          CAPTURE(r);
          float t = 0.0f, slack = 0.0f;
          od::qminmax_quantize_query(q.data() + std::size_t{r} * d, d, words.data(), t, slack);
          for (std::uint32_t e = 0; e < capacity; ++e) {
            CAPTURE(e);
            const std::uint32_t* cw = em[e].words.data() + std::size_t{h} * (d / 2);
            std::int32_t dot = 0;
            for (std::uint32_t p = 0; p < d / 2; ++p) {
              dot = od::qminmax_dot4(words[p], cw[p], dot);
            }
            const float mine =
                od::qminmax_score(dot, em[e].scale[h], t, em[e].norm[h], slack, em[e].bias);
            const float theirs = host[std::size_t{e} * rows + r];
            REQUIRE(!std::isnan(mine));
            REQUIRE(!std::isnan(theirs));
            if (fill[e] == 0) {
              CHECK(mine == -inf);
              CHECK(theirs == -inf);
              continue;
            }
            if (e == 7) {
              CHECK(mine == inf);
              CHECK(theirs == inf);
              continue;
            }
            // f32 rounding: the two sums' terms are rounded once each; 16 ulps of their size.
            const float size =
                std::abs(static_cast<float>(dot) * (em[e].scale[h] * t)) + em[e].norm[h] * slack;
            CHECK(!(std::abs(mine - theirs) > 0x1p-20f * size));
            // Still an upper bound on every key's dot product (the keys as the summary read them).
            float best = -inf;
            for (std::uint32_t tk = 0; tk < fill[e]; ++tk) {
              double dotk = 0.0;
              for (std::uint32_t x = 0; x < d; ++x) {
                dotk += static_cast<double>(q[std::size_t{r} * d + x]) *
                        keys_f[((std::size_t{e} * l.num_kv_heads + h) * 16 + tk) * d + x];
              }
              best = std::max(best, static_cast<float>(dotk));
            }
            CHECK(!(mine < best - 0x1p-20f * size));
          }
        }
      }
    }
  }
}
