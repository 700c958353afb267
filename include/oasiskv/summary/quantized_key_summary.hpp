// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `quantized_key_summary<Bits>` (`int8_key_summary`, `int4_key_summary`): a low-bit copy
//! of every key, scored exactly in the quantized domain, and the exact block softmax mass.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/layout.hpp"
#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/summary/cpu/qkey.hpp"
#include "oasiskv/summary/cpu/tiles.hpp"
#include "oasiskv/summary/summary_checks.hpp"

namespace oasiskv {

//! @brief A `Bits`-bit (8 or 4) copy of every key of every entry and KV head, with one f32
//! scale per token (symmetric: `scale = max_x |k_x| / (2^(Bits-1) - 1)`, codes
//! `round(k_x / scale)` in `[-127, 127]` or `[-7, 7]`). `score` is exact in the quantized
//! domain: `max_t dot(q, kq_t)` over the entry's tokens, `kq_t = code_t * scale_t` (up to f32
//! rounding of the dot product), not a bound. `score_log_mass` gives what softmax-mass
//! aggregation needs instead of a max: the block's exact softmax mass in the quantized domain.
//!
//! Why a scale per token rather than per block: each token is quantized on its own, so an
//! append never requantizes the tokens already folded in (a per-block scale that grows with a
//! larger new key would have to requantize them, from keys the update may no longer see, and
//! rounding twice would make one-token appends differ from a bulk update). Tokens are stored
//! independently: any order of updates, one token or a bulk prefill, gives the same bits, and
//! updating a token again replaces it. A key with a non-finite element makes every score of its
//! entry `+inf` (kept, never NaN); an entry with no tokens scores `-inf`.
//!
//! Models `block_summary`. Memory per entry: `num_kv_heads * tp * (head_dim * Bits / 8 + 4) + 2`
//! bytes, `tp` = `tokens_per_block` rounded up to 16: codes, scales, the token count. For
//! 16-token blocks and f16 K+V that is `(Bits / 8 + 4 / head_dim) / 4` of the block's bytes
//! (int8, head_dim 64: 26.6%; int4: 14.1%), against 6.25% for `minmax_summary<f16>`.
//! `cpu_isa::avx2` and `avx512` run an AVX2+FMA kernel (16 tokens x 4 rows per pass, in
//! registers; a vectorised epilogue with a polynomial `exp`, about 2 ulp); `scalar` a portable
//! one: same products, sums in another order, `std::exp`. Concurrent
//! `score` / `score_log_mass` calls are safe.
template <int Bits>
class quantized_key_summary {
  static_assert(Bits == 8 || Bits == 4, "quantized_key_summary stores int8 or int4 codes");
  static constexpr std::uint32_t lanes = cpu::detail::qkey_lanes;

 public:
  static constexpr int bits = Bits;
  //! @brief The largest code magnitude: 127 (int8) or 7 (int4).
  static constexpr float max_code = Bits == 8 ? 127.0f : 7.0f;
  static constexpr const char* name = Bits == 8 ? "int8_key_summary" : "int4_key_summary";

  quantized_key_summary(const kv_layout& layout, std::uint32_t capacity,
                        cpu_isa isa = cpu_isa::best)
      : layout_(layout), capacity_(capacity) {
    layout_.validate();
    if (capacity_ == 0) [[unlikely]] {
      detail::raise(errc::invalid_argument, name, " capacity is 0");
    }
    set_isa(isa);
    tp_ = (layout_.tokens_per_block + lanes - 1) / lanes * lanes;
    code_bytes_ = std::size_t{layout_.head_dim} * tp_ * Bits / 8;
    const std::size_t entries = std::size_t{layout_.num_kv_heads} * capacity_;
    codes_.assign(entries * code_bytes_, 0);
    scales_.assign(entries * tp_, cpu::detail::qkey_absent);
    tokens_.assign(capacity_, 0);
  }

  std::uint32_t capacity() const noexcept { return capacity_; }

  //! @brief Capacity becomes `capacity`: entries keep their codes, the new ones start empty
  //! (models `growable_summary`). `errc::invalid_argument` below the current capacity.
  void grow(std::uint32_t capacity) {
    detail::check_summary_grow(name, capacity_, capacity);
    const std::size_t heads = layout_.num_kv_heads;
    auto codes = detail::regrow_parts(codes_, heads, capacity_ * code_bytes_,
                                      capacity * code_bytes_, std::uint8_t{0});
    auto scales = detail::regrow_parts(scales_, heads, std::size_t{capacity_} * tp_,
                                       std::size_t{capacity} * tp_, cpu::detail::qkey_absent);
    auto tokens = detail::regrow(tokens_, capacity, std::uint16_t{0});
    codes_ = std::move(codes);
    scales_ = std::move(scales);
    tokens_ = std::move(tokens);
    capacity_ = capacity;
  }
  const kv_layout& layout() const noexcept { return layout_; }
  cpu_isa isa() const noexcept { return isa_; }
  //! @brief Chooses the scoring path; `errc::unsupported` if it cannot run.
  void set_isa(cpu_isa isa) { isa_ = resolve_isa(isa); }

  std::size_t bytes_per_block() const noexcept {
    return std::size_t{layout_.num_kv_heads} * (code_bytes_ + std::size_t{tp_} * sizeof(float)) +
           sizeof(std::uint16_t);
  }

  //! @brief How many distinct tokens entry `b` holds.
  std::uint32_t tokens(std::uint32_t b) const {
    check_entry(b);
    return tokens_[b];
  }

  void reset(std::uint32_t b) {
    check_entry(b);
    for (std::uint32_t h = 0; h < layout_.num_kv_heads; ++h) {
      std::memset(codes_of(h, b), 0, code_bytes_);
      std::fill_n(scales_of(h, b), tp_, cpu::detail::qkey_absent);
    }
    tokens_[b] = 0;
  }

  //! @brief Quantizes the keys of tokens `[first, first + count)` of the slot at `block` into
  //! entry `b`, replacing those tokens if they were folded in before.
  void update(std::uint32_t b, const std::byte* block, std::uint32_t first, std::uint32_t count) {
    check_entry(b);
    if (count == 0) {
      return;
    }
    detail::check_summary_update(name, layout_, block, first, count);
    const std::uint32_t d = layout_.head_dim;
    // Token presence is the same for every head: count new tokens from head 0's scales.
    const float* s0 = scales_of(0, b);
    std::uint32_t added = 0;
    for (std::uint32_t t = first; t < first + count; ++t) {
      added += s0[t] == cpu::detail::qkey_absent ? 1u : 0u;
    }
    visit_dtype(layout_.kv_dtype, [&](auto elem) {
      using T = decltype(elem);
      for (std::uint32_t h = 0; h < layout_.num_kv_heads; ++h) {
        const T* keys = reinterpret_cast<const T*>(block + layout_.key_offset(h));
        std::uint8_t* codes = codes_of(h, b);
        float* scales = scales_of(h, b);
        for (std::uint32_t t = first; t < first + count; ++t) {
          const T* k = keys + std::size_t{t} * d;
          float mag = 0.0f;
          bool finite = true;
          for (std::uint32_t x = 0; x < d; ++x) {
            const float v = to_float(k[x]);
            finite = finite && std::isfinite(v);
            mag = std::max(mag, std::abs(v));
          }
          const float s = finite ? mag / max_code : std::numeric_limits<float>::infinity();
          // Dividing by the scale, not multiplying by its inverse: the largest element maps to
          // exactly max_code, never past it.
          for (std::uint32_t x = 0; x < d; ++x) {
            const float v = to_float(k[x]);
            const float c =
                finite && s > 0.0f ? std::clamp(std::nearbyint(v / s), -max_code, max_code) : 0.0f;
            set_code(codes, x, t, static_cast<std::int32_t>(c));
          }
          scales[t] = s;
        }
      }
    });
    tokens_[b] = static_cast<std::uint16_t>(tokens_[b] + added);
  }

  //! @brief `out[i * n + r]` = `max_t dot(q_r, k'_t)` over the dequantized keys `k'_t` of KV
  //! head `h` in entry `entries[i]`; `-inf` for an empty entry, `+inf` for one holding a
  //! non-finite key.
  void score(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
             std::uint32_t n, float* out) const {
    run(h, entries, q, n, 0.0f, out, "score");
  }

  //! @brief `out[i * n + r]` = `log(sum_t exp(scale * dot(q_r, k'_t))) / scale`: the block's
  //! log-sum-exp of attention logits at logit scale `scale` (1/sqrt(head_dim) for attention),
  //! divided by that scale, so that it is in the units of `score` (at least the maximum, at most
  //! the maximum + log(tokens) / scale). A softmax over blocks of `scale * out` gives each block
  //! its exact share of the row's attention over the dequantized keys: what
  //! `softmax_mass_aggregation` computes when the summary provides this (see
  //! `predictor/aggregation.hpp`). `-inf` / `+inf` as `score`. `scale` must be finite and > 0.
  void score_log_mass(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
                      std::uint32_t n, float scale, float* out) const {
    if (!(scale > 0.0f) || !std::isfinite(scale)) [[unlikely]] {
      detail::raise(errc::invalid_argument, name, "::score_log_mass: scale = ", scale,
                    " must be finite and > 0");
    }
    run(h, entries, q, n, scale, out, "score_log_mass");
  }

  //! @brief The dequantized key of token `t` of entry `b`, KV head `h` (`head_dim` floats; zeros
  //! for a token not folded in).
  std::vector<float> dequantized(std::uint32_t h, std::uint32_t b, std::uint32_t t) const {
    check_entry(b);
    if (h >= layout_.num_kv_heads || t >= layout_.tokens_per_block) [[unlikely]] {
      detail::raise(errc::out_of_range, name, "::dequantized: kv head ", h, " or token ", t,
                    " out of range");
    }
    std::vector<float> k(layout_.head_dim, 0.0f);
    const float s = scales_of(h, b)[t];
    if (s == cpu::detail::qkey_absent) {
      return k;
    }
    for (std::uint32_t x = 0; x < layout_.head_dim; ++x) {
      k[x] = static_cast<float>(cpu::detail::qkey_code<Bits>(codes_of(h, b), tp_, x, t)) * s;
    }
    return k;
  }

 private:
  // scale == 0: the max of dot products; > 0: the scaled log-sum-exp (see score_log_mass).
  void run(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q, std::uint32_t n,
           float scale, float* out, const char* what) const {
    if (h >= layout_.num_kv_heads) [[unlikely]] {
      detail::raise(errc::out_of_range, name, "::", what, ": kv head ", h,
                    " >= num_kv_heads = ", layout_.num_kv_heads);
    }
    if (entries.empty() || n == 0) {
      return;
    }
    if (q == nullptr || out == nullptr) [[unlikely]] {
      detail::raise(errc::invalid_argument, name, "::", what, ": null query or output");
    }
    cpu::detail::check_entry_ids(entries, capacity_, name);
    const std::uint32_t d = layout_.head_dim;
    constexpr float inf = std::numeric_limits<float>::infinity();
    thread_local std::vector<float> dots;  // [n][tp]
    dots.resize(std::size_t{n} * tp_);
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const std::uint32_t b = entries[i];
      float* o = out + i * n;
      if (tokens_[b] == 0) {
        std::fill(o, o + n, -inf);
        continue;
      }
      cpu::detail::qkey_score_entry<Bits>(isa_, codes_of(h, b), scales_of(h, b), d, tp_, q, n,
                                          scale, dots.data(), o);
    }
  }

  void set_code(std::uint8_t* codes, std::uint32_t x, std::uint32_t t, std::int32_t c) const {
    if constexpr (Bits == 8) {
      codes[std::size_t{x} * tp_ + t] = static_cast<std::uint8_t>(c);
    } else {
      std::uint8_t& byte = codes[std::size_t{x} * (tp_ / 2) + t / 2];
      const auto nib = static_cast<std::uint8_t>(static_cast<std::uint32_t>(c) & 0xfu);
      byte = t % 2 == 0 ? static_cast<std::uint8_t>((byte & 0xf0u) | nib)
                        : static_cast<std::uint8_t>((byte & 0x0fu) | (nib << 4));
    }
  }

  std::uint8_t* codes_of(std::uint32_t h, std::uint32_t b) noexcept {
    return codes_.data() + (std::size_t{h} * capacity_ + b) * code_bytes_;
  }
  const std::uint8_t* codes_of(std::uint32_t h, std::uint32_t b) const noexcept {
    return codes_.data() + (std::size_t{h} * capacity_ + b) * code_bytes_;
  }
  float* scales_of(std::uint32_t h, std::uint32_t b) noexcept {
    return scales_.data() + (std::size_t{h} * capacity_ + b) * tp_;
  }
  const float* scales_of(std::uint32_t h, std::uint32_t b) const noexcept {
    return scales_.data() + (std::size_t{h} * capacity_ + b) * tp_;
  }
  void check_entry(std::uint32_t b) const {
    if (b >= capacity_) [[unlikely]] {
      detail::raise(errc::out_of_range, name, ": entry ", b, " >= capacity = ", capacity_);
    }
  }

  kv_layout layout_;
  std::uint32_t capacity_;
  cpu_isa isa_ = cpu_isa::scalar;
  std::uint32_t tp_ = 0;               // tokens_per_block rounded up to 16
  std::size_t code_bytes_ = 0;         // per (entry, KV head)
  std::vector<std::uint8_t> codes_;    // [kv heads][capacity][head_dim][tp] codes (int4: tp / 2)
  std::vector<float> scales_;          // [kv heads][capacity][tp]: scale, -1 absent, +inf bad
  std::vector<std::uint16_t> tokens_;  // [capacity]
};

//! @brief An int8 copy of every key (1 byte per element + a 4-byte scale per token).
using int8_key_summary = quantized_key_summary<8>;
//! @brief An int4 copy of every key (half a byte per element + a 4-byte scale per token).
using int4_key_summary = quantized_key_summary<4>;

}  // namespace oasiskv
