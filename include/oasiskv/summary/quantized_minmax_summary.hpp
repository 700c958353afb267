// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `quantized_minmax_summary`: Quest's min/max bounds in int8 with a power-of-two scale
//! per (entry, KV head), scored with AVX512_VNNI integer dot products. Still an upper bound.
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
#include "oasiskv/summary/cpu/qminmax.hpp"
#include "oasiskv/summary/cpu/tiles.hpp"
#include "oasiskv/summary/summary_checks.hpp"

namespace oasiskv {

//! @brief `minmax_summary`'s bounds (elementwise max and min of the keys, Quest) stored as int8
//! codes with a power-of-two scale `s = 2^e` per (entry, KV head), the least with every
//! `|bound| <= 127 s`: the maximum is rounded up (`ceil(max / s)`), the minimum down, so the
//! codes still bound every key. Half the bytes of `minmax_summary<f16>` to scan.
//!
//! Scoring quantizes each query row to u8 magnitudes, `q_x ~ t u_x` with `t = max|q| / 255`, and
//! takes the integer dot product of the (q+, |q-|) codes with the (max, -min) codes
//! (`vpdpbusd` on AVX512_VNNI: 64 byte products per instruction, exact in int32). Rounding the
//! query moves the score by at most `sum_x |q_x - t u_x| A_x <= ||q - t u||_2 ||A||_2`, with
//! `A_x = s max(|max code|, |min code|)` the dequantized bound's magnitude; each entry keeps
//! `||A||_2` (rounded up) and each row's `||q - t u||_2` is computed exactly, so
//! `score = s t (integer dot) + ||q - t u||_2 ||A||_2` is still at least every key's dot
//! product (up to f32 rounding, as for `minmax_summary`). It is looser than the exact bound by
//! up to one code step per dimension and the query term: use it where the scan's time matters
//! more than the last bit of ranking (see docs/predictors.md for the measured agreement).
//!
//! Power-of-two scales make an update exact to redo: growing the scale from `2^e` to `2^e_new`
//! turns each code into `ceil` (max) or `floor` (min) of `code / 2^(e_new - e)`, which equals
//! quantizing the exact bound at the new scale, so one-token appends and a bulk update give the
//! same bits. A non-finite key makes its entry score `+inf`; an entry with no tokens, `-inf`.
//!
//! Models `block_summary`, `growable_summary` and `loadable_summary` (the f16 bounds a prefill
//! node ships, quantized on load). Memory: `num_kv_heads * (2 * head_dim + 8) + 6` bytes per entry
//! (codes, scale, norm; the empty/overflow bias and the token count); the capacity is rounded up to
//! a multiple of 16. `cpu_isa::avx512_vnni` (what `best` and `avx512` resolve to where the CPU
//! has AVX512_VNNI) runs the VNNI kernel; every other path runs the scalar one (same integers,
//! same result up to f32 rounding). Concurrent
//! `score` calls are safe.
class quantized_minmax_summary {
  static constexpr std::uint32_t lanes = cpu::detail::qminmax_lanes;
  static constexpr int min_exponent = -126;

 public:
  //! @brief Entries one pass over a tile scores (`summary_tile_entries`).
  static constexpr std::uint32_t entries_per_tile = lanes;

  quantized_minmax_summary(const kv_layout& layout, std::uint32_t capacity,
                           cpu_isa isa = cpu_isa::best)
      : layout_(layout), capacity_(capacity) {
    layout_.validate();
    if (capacity_ == 0) [[unlikely]] {
      detail::raise(errc::invalid_argument, "quantized_minmax_summary capacity is 0");
    }
    set_isa(isa);
    tiles_ = (capacity_ + lanes - 1) / lanes;
    tile_bytes_ = std::size_t{2} * layout_.head_dim * lanes;
    const std::size_t slots = std::size_t{layout_.num_kv_heads} * tiles_ * lanes;
    codes_.assign(std::size_t{layout_.num_kv_heads} * tiles_ * tile_bytes_, 0);
    scale_.assign(slots, 0.0f);
    norm_.assign(slots, 0.0f);
    bias_.assign(std::size_t{tiles_} * lanes, -std::numeric_limits<float>::infinity());
    tokens_.assign(capacity_, 0);
  }

  std::uint32_t capacity() const noexcept { return capacity_; }

  //! @brief Capacity becomes `capacity`: entries keep their codes, the new ones start empty
  //! (models `growable_summary`). `errc::invalid_argument` below the current capacity.
  void grow(std::uint32_t capacity) {
    detail::check_summary_grow("quantized_minmax_summary", capacity_, capacity);
    const std::uint32_t tiles = (capacity + lanes - 1) / lanes;
    const std::size_t heads = layout_.num_kv_heads;
    auto codes = detail::regrow_parts(codes_, heads, tiles_ * tile_bytes_, tiles * tile_bytes_,
                                      std::int8_t{0});
    auto scale = detail::regrow_parts(scale_, heads, std::size_t{tiles_} * lanes,
                                      std::size_t{tiles} * lanes, 0.0f);
    auto norm = detail::regrow_parts(norm_, heads, std::size_t{tiles_} * lanes,
                                     std::size_t{tiles} * lanes, 0.0f);
    auto bias =
        detail::regrow(bias_, std::size_t{tiles} * lanes, -std::numeric_limits<float>::infinity());
    auto tokens = detail::regrow(tokens_, capacity, std::uint16_t{0});
    codes_ = std::move(codes);
    scale_ = std::move(scale);
    norm_ = std::move(norm);
    bias_ = std::move(bias);
    tokens_ = std::move(tokens);
    tiles_ = tiles;
    capacity_ = capacity;
  }
  const kv_layout& layout() const noexcept { return layout_; }
  cpu_isa isa() const noexcept { return isa_; }
  //! @brief Chooses the scoring path; `errc::unsupported` if it cannot run.
  void set_isa(cpu_isa isa) { isa_ = resolve_isa(isa, cpu_isa::avx512_vnni); }

  std::size_t bytes_per_block() const noexcept {
    // codes, scale and norm per KV head; the f32 bias and the u16 token count per entry
    return std::size_t{layout_.num_kv_heads} * (std::size_t{2} * layout_.head_dim + 8) +
           sizeof(float) + sizeof(std::uint16_t);
  }

  std::uint32_t tokens(std::uint32_t b) const {
    check_entry(b);
    return tokens_[b];
  }

  void reset(std::uint32_t b) {
    check_entry(b);
    for (std::uint32_t h = 0; h < layout_.num_kv_heads; ++h) {
      for (std::uint32_t x = 0; x < layout_.head_dim; ++x) {
        code(h, b, 0, x) = 0;
        code(h, b, 1, x) = 0;
      }
      scale_[slot(h, b)] = 0.0f;
      norm_[slot(h, b)] = 0.0f;
    }
    tokens_[b] = 0;
    bias_[b] = -std::numeric_limits<float>::infinity();
  }

  //! @brief Folds tokens `[first, first + count)` of the slot at `block` into entry `b`.
  void update(std::uint32_t b, const std::byte* block, std::uint32_t first, std::uint32_t count) {
    check_entry(b);
    if (count == 0) {
      return;
    }
    detail::check_summary_update("quantized_minmax_summary", layout_, block, first, count);
    const std::uint32_t d = layout_.head_dim;
    thread_local std::vector<float> hi, lo;
    hi.resize(d);
    lo.resize(d);
    bool overflow = bias_[b] == std::numeric_limits<float>::infinity();
    visit_dtype(layout_.kv_dtype, [&](auto elem) {
      using T = decltype(elem);
      for (std::uint32_t h = 0; h < layout_.num_kv_heads; ++h) {
        const T* keys = reinterpret_cast<const T*>(block + layout_.key_offset(h));
        float mag = 0.0f;
        std::fill(hi.begin(), hi.end(), -std::numeric_limits<float>::infinity());
        std::fill(lo.begin(), lo.end(), std::numeric_limits<float>::infinity());
        for (std::uint32_t t = first; t < first + count; ++t) {
          for (std::uint32_t x = 0; x < d; ++x) {
            const float v = to_float(keys[std::size_t{t} * d + x]);
            if (std::isinf(v)) [[unlikely]] {
              overflow = true;
              continue;
            }
            hi[x] = v > hi[x] ? v : hi[x];
            lo[x] = v < lo[x] ? v : lo[x];
            mag = std::max(mag, std::abs(v));
          }
        }
        fold(h, b, hi.data(), lo.data(), mag);
      }
    });
    bias_[b] = overflow ? std::numeric_limits<float>::infinity() : 0.0f;
    tokens_[b] = static_cast<std::uint16_t>(
        std::min<std::uint32_t>(tokens_[b] + count, layout_.tokens_per_block));
  }

  //! @brief Bytes `load` takes for one entry: `[num_kv_heads][2 (max, min)][head_dim]` f16, the
  //! format of `minmax_summary::load` (`disagg::summarize_block`).
  std::size_t wire_bytes() const noexcept {
    return std::size_t{layout_.num_kv_heads} * 2 * layout_.head_dim * sizeof(f16);
  }

  //! @brief Sets entry `b` from f16 bounds computed elsewhere, of a block holding `tokens` tokens
  //! (models `loadable_summary`): per KV head the elementwise maximum then minimum key, as
  //! `disagg::summarize_block` writes them. They are quantized as `update` quantizes the bounds
  //! of the keys it reads, so the bounds of f16 keys (which f16 holds exactly) give the codes
  //! `update` gives from the block itself, and looser ones still bound every key. A NaN or
  //! infinite bound makes the entry score `+inf`, as a non-finite key does. Later `update`s fold
  //! into the entry. Throws `errc::invalid_argument` unless `bytes` is exactly `wire_bytes()`
  //! long, or where a maximum is below its minimum (naming the head and dimension), and
  //! `errc::out_of_range` unless `tokens` is in [1, tokens_per_block]; the entry is then
  //! unchanged. O(bytes).
  void load(std::uint32_t b, std::span<const std::byte> bytes, std::uint32_t tokens) {
    check_entry(b);
    detail::check_summary_load("quantized_minmax_summary", layout_, b, bytes.size(), wire_bytes(),
                               tokens);
    const std::uint32_t d = layout_.head_dim, heads = layout_.num_kv_heads;
    constexpr float inf = std::numeric_limits<float>::infinity();
    // Every bound read and checked before the entry changes. A non-finite bound is left out of
    // the codes (as `update` leaves out a non-finite key) and marks the entry.
    thread_local std::vector<float> hi, lo, mag;
    hi.resize(std::size_t{heads} * d);
    lo.resize(hi.size());
    mag.assign(heads, 0.0f);
    bool overflow = false;
    for (std::uint32_t h = 0; h < heads; ++h) {
      for (std::uint32_t x = 0; x < d; ++x) {
        float v[2];
        for (std::uint32_t which = 0; which < 2; ++which) {
          f16 w;
          std::memcpy(&w, bytes.data() + ((std::size_t{h} * 2 + which) * d + x) * sizeof(f16),
                      sizeof(f16));
          v[which] = w.to_float();
        }
        const std::size_t i = std::size_t{h} * d + x;
        const bool finite_hi = std::isfinite(v[0]), finite_lo = std::isfinite(v[1]);
        if (finite_hi && finite_lo && v[0] < v[1]) [[unlikely]] {
          detail::raise(errc::invalid_argument, "quantized_minmax_summary::load: entry ", b,
                        ", kv head ", h, ", dimension ", x, ": maximum ", v[0],
                        " is below minimum ", v[1]);
        }
        overflow |= !finite_hi || !finite_lo;
        hi[i] = finite_hi ? v[0] : -inf;
        lo[i] = finite_lo ? v[1] : inf;
        mag[h] = std::max(
            {mag[h], finite_hi ? std::abs(v[0]) : 0.0f, finite_lo ? std::abs(v[1]) : 0.0f});
      }
    }
    for (std::uint32_t h = 0; h < heads; ++h) {
      scale_[slot(h, b)] = 0.0f;  // fresh: `fold` quantizes these bounds alone
      fold(h, b, hi.data() + std::size_t{h} * d, lo.data() + std::size_t{h} * d, mag[h]);
    }
    bias_[b] = overflow ? inf : 0.0f;
    tokens_[b] = static_cast<std::uint16_t>(tokens);
  }

  //! @brief The dequantized bounds of entry `b`, KV head `h`, into `hi` and `lo` (`head_dim`
  //! floats each): `lo[x] <= k[x] <= hi[x]` for every finite key `k` folded in, each a multiple
  //! of the entry's power-of-two scale (both 0 for an empty entry). `errc::out_of_range` for an
  //! entry or head out of range.
  void bounds(std::uint32_t h, std::uint32_t b, float* hi, float* lo) const {
    check_entry(b);
    if (h >= layout_.num_kv_heads) [[unlikely]] {
      detail::raise(errc::out_of_range, "quantized_minmax_summary::bounds: kv head ", h,
                    " >= num_kv_heads = ", layout_.num_kv_heads);
    }
    const float s = scale_[slot(h, b)];
    const std::int8_t* tile = codes_.data() + (std::size_t{h} * tiles_ + b / lanes) * tile_bytes_;
    for (std::uint32_t x = 0; x < layout_.head_dim; ++x) {
      hi[x] = static_cast<float>(tile[cpu::detail::qminmax_at(x, 0, b % lanes)]) * s;
      lo[x] = -static_cast<float>(tile[cpu::detail::qminmax_at(x, 1, b % lanes)]) * s;
    }
  }

  //! @brief The bounds of entry `b`, KV head `h`, as stored: for each dimension pair `p` one
  //! 32-bit word of `words` (`head_dim / 2` of them) holding the int8 codes `hi_2p`, `-lo_2p`,
  //! `hi_2p+1`, `-lo_2p+1` in its bytes 0-3, in units of the returned power-of-two scale (0 for an
  //! empty entry). For integer kernels built on the bounds; `bounds` gives the same as floats.
  //! `errc::out_of_range` for an entry or head out of range.
  float bound_words(std::uint32_t h, std::uint32_t b, std::uint32_t* words) const {
    check_entry(b);
    if (h >= layout_.num_kv_heads) [[unlikely]] {
      detail::raise(errc::out_of_range, "quantized_minmax_summary::bound_words: kv head ", h,
                    " >= num_kv_heads = ", layout_.num_kv_heads);
    }
    const std::int8_t* tile = codes_.data() + (std::size_t{h} * tiles_ + b / lanes) * tile_bytes_;
    for (std::uint32_t p = 0; p < layout_.head_dim / 2; ++p) {
      std::memcpy(words + p, tile + cpu::detail::qminmax_at(2 * p, 0, b % lanes), 4);
    }
    return scale_[slot(h, b)];
  }

  //! @brief `||A||_2` of entry `b`, KV head `h`, as scoring uses it: the norm of the dequantized
  //! bounds' magnitudes `A_x = s max(|max code|, |min code|)`, rounded up to f32 (0 for an empty
  //! entry). A function of the codes and the scale alone. `errc::out_of_range` for an entry or head
  //! out of range.
  float norm(std::uint32_t h, std::uint32_t b) const {
    check_entry(b);
    if (h >= layout_.num_kv_heads) [[unlikely]] {
      detail::raise(errc::out_of_range, "quantized_minmax_summary::norm: kv head ", h,
                    " >= num_kv_heads = ", layout_.num_kv_heads);
    }
    return norm_[slot(h, b)];
  }

  //! @brief Whether entry `b` scores `+inf` (a non-finite key, or on `load` a non-finite bound,
  //! was folded in since its last `reset`). `errc::out_of_range` for an entry out of range.
  bool overflowed(std::uint32_t b) const {
    check_entry(b);
    return bias_[b] == std::numeric_limits<float>::infinity();
  }

  //! @brief `out[i * n + r]` = the bound of query row `r` (of `q`, `[n][head_dim]`) over entry
  //! `entries[i]` of KV head `h`.
  void score(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
             std::uint32_t n, float* out) const {
    score_into(h, entries, q, n, cpu::detail::score_sink::entry_major(out, n));
  }

  //! @brief `score` transposed: `out[r * entries.size() + i]` (see `row_scoring_summary`).
  void score_rows(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
                  std::uint32_t n, float* out) const {
    score_into(h, entries, q, n, cpu::detail::score_sink::row_major(out, entries.size()));
  }

 private:
  void score_into(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
                  std::uint32_t n, const cpu::detail::score_sink& sink) const {
    if (h >= layout_.num_kv_heads) [[unlikely]] {
      detail::raise(errc::out_of_range, "quantized_minmax_summary::score: kv head ", h,
                    " >= num_kv_heads = ", layout_.num_kv_heads);
    }
    if (entries.empty() || n == 0) {
      return;
    }
    if (q == nullptr || sink.out == nullptr) [[unlikely]] {
      detail::raise(errc::invalid_argument,
                    "quantized_minmax_summary::score: null query or output");
    }
    const bool contiguous =
        cpu::detail::check_entry_ids(entries, capacity_, "quantized_minmax_summary");
    const std::uint32_t d = layout_.head_dim, pairs = d / 2;
    thread_local std::vector<std::uint32_t> qw;
    thread_local std::vector<float> row;  // [t (n)][slack (n)]
    qw.resize(std::size_t{n} * pairs);
    row.resize(std::size_t{2} * n);
    for (std::uint32_t r = 0; r < n; ++r) {
      const float* qr = q + std::size_t{r} * d;
      float m = 0.0f;
      for (std::uint32_t x = 0; x < d; ++x) {
        m = std::max(m, std::abs(qr[x]));
      }
      const float t = m / 255.0f;
      const float inv = m > 0.0f ? 255.0f / m : 0.0f;
      double err = 0.0;
      for (std::uint32_t p = 0; p < pairs; ++p) {
        std::uint32_t w = 0;
        for (std::uint32_t k = 0; k < 2; ++k) {
          const float v = qr[2 * p + k];
          // |v| * inv is in [0, 255]: adding 1/2 and truncating rounds it (ties up) without
          // the library call nearbyint is on a baseline x86-64 build (this runs per call).
          const auto u = static_cast<std::uint32_t>(std::min(255.0f, std::abs(v) * inv + 0.5f));
          const double e = std::abs(double{v}) - double{t} * u;
          err += e * e;
          w |= (v > 0.0f ? u : u << 8) << (16 * k);
        }
        qw[std::size_t{r} * pairs + p] = w;
      }
      row[r] = t;
      row[n + r] = round_up(std::sqrt(err) * (1.0 + 0x1p-40));
    }
    thread_local std::vector<float> all;  // one whole tile's scores, [lane][row]
    std::size_t i = 0;
    while (i < entries.size()) {
      const std::uint32_t b = entries[i], lane0 = b % lanes;
      const std::uint32_t m = cpu::detail::tile_run(entries, i, contiguous, lanes);
      const std::size_t tile = std::size_t{h} * tiles_ + b / lanes;
      const std::int8_t* codes = codes_.data() + tile * tile_bytes_;
      const float* sc = scale_.data() + tile * lanes;
      const float* nm = norm_.data() + tile * lanes;
      const float* bs = bias_.data() + std::size_t{b / lanes} * lanes;
      // Ids sharing this tile without being consecutive: one pass over the whole tile.
      const std::size_t j = contiguous ? 0 : cpu::detail::same_tile_end(entries, i, m, lanes);
      auto run = [&](std::uint32_t from, std::uint32_t count, const cpu::detail::score_sink& to,
                     std::size_t i0) {
        cpu::detail::qminmax_run(isa_, codes, sc, nm, bs, d, from, count, qw.data(), row.data(),
                                 row.data() + n, n, to, i0);
      };
      if (j != 0) {
        all.resize(std::size_t{lanes} * n);
        run(0, lanes, cpu::detail::score_sink::entry_major(all.data(), n), 0);
        cpu::detail::pick_lanes(all.data(), entries, i, j, lanes, n, sink);
        i = j;
        continue;
      }
      run(lane0, m, sink, i);
      i += m;
    }
  }

  static float round_up(double v) noexcept {
    const float f = static_cast<float>(v);
    return static_cast<double>(f) < v ? std::nextafter(f, std::numeric_limits<float>::infinity())
                                      : f;
  }

  // Merges the new keys' exact bounds (`hi`, `lo`; largest finite magnitude `mag`) into entry
  // b's codes for head h.
  void fold(std::uint32_t h, std::uint32_t b, const float* hi, const float* lo, float mag) {
    const std::uint32_t d = layout_.head_dim;
    float& s = scale_[slot(h, b)];
    const bool fresh = s == 0.0f;
    const int old_e = fresh ? min_exponent : std::ilogb(s);
    int e = old_e;
    while (mag > 127.0f * std::ldexp(1.0f, e)) {
      ++e;
    }
    if (!fresh && e > old_e) {  // rescale the old codes: exact, see the class comment
      const int k = std::min(e - old_e, 31);
      for (std::uint32_t x = 0; x < d; ++x) {
        const std::int32_t c_hi = code(h, b, 0, x), c_lo = -code(h, b, 1, x);
        code(h, b, 0, x) = static_cast<std::int8_t>(-((-c_hi) >> k));  // ceil(c / 2^k)
        code(h, b, 1, x) = static_cast<std::int8_t>(-(c_lo >> k));     // -floor(c / 2^k)
      }
    }
    s = std::ldexp(1.0f, e);
    double sq = 0.0;
    for (std::uint32_t x = 0; x < d; ++x) {
      std::int32_t c_hi = fresh ? -127 : code(h, b, 0, x);
      std::int32_t c_lo = fresh ? 127 : -code(h, b, 1, x);
      if (hi[x] >= lo[x]) {  // some finite key: s is exact, so the quotients are too
        c_hi = std::max(c_hi, static_cast<std::int32_t>(std::ceil(hi[x] / s)));
        c_lo = std::min(c_lo, static_cast<std::int32_t>(std::floor(lo[x] / s)));
      }
      code(h, b, 0, x) = static_cast<std::int8_t>(c_hi);
      code(h, b, 1, x) = static_cast<std::int8_t>(-c_lo);
      const double a = std::ldexp(static_cast<double>(std::max(std::abs(c_hi), std::abs(c_lo))), e);
      sq += a * a;
    }
    norm_[slot(h, b)] = round_up(std::sqrt(sq) * (1.0 + 0x1p-40));
  }

  std::int8_t& code(std::uint32_t h, std::uint32_t b, std::uint32_t which, std::uint32_t x) {
    return codes_[(std::size_t{h} * tiles_ + b / lanes) * tile_bytes_ +
                  cpu::detail::qminmax_at(x, which, b % lanes)];
  }
  std::size_t slot(std::uint32_t h, std::uint32_t b) const noexcept {
    return std::size_t{h} * tiles_ * lanes + b;
  }
  void check_entry(std::uint32_t b) const {
    if (b >= capacity_) [[unlikely]] {
      detail::raise(errc::out_of_range, "quantized_minmax_summary: entry ", b,
                    " >= capacity = ", capacity_);
    }
  }

  kv_layout layout_;
  std::uint32_t capacity_;
  cpu_isa isa_ = cpu_isa::scalar;
  std::uint32_t tiles_ = 0;
  std::size_t tile_bytes_ = 0;
  std::vector<std::int8_t> codes_;     // [kv heads][tiles][d / 2][16][4], see qminmax_at
  std::vector<float> scale_, norm_;    // [kv heads][tiles * 16]: 2^e, ||A||_2 rounded up
  std::vector<float> bias_;            // [tiles * 16]: 0; -inf empty; +inf a non-finite key
  std::vector<std::uint16_t> tokens_;  // [capacity]
};

}  // namespace oasiskv
