// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `minmax_summary`: Quest's per-block elementwise key bounds, an upper bound of every
//! query's largest dot product with the block's keys.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <type_traits>
#include <vector>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/layout.hpp"
#include "oasiskv/cpu/math.hpp"
#include "oasiskv/summary/cpu/minmax.hpp"
#include "oasiskv/summary/summary_checks.hpp"

namespace oasiskv {

//! @brief Per entry and KV head, the elementwise minimum and maximum of the keys folded in
//! (Quest, arXiv 2406.10774). `score` returns `sum_d max(q_d * min_d, q_d * max_d)`, which is
//! at least `dot(q, k)` for every key `k` of the block.
//!
//! `Storage` (f16 by default; bf16 or float) holds the bounds. Narrowing rounds the minimum down
//! and the maximum up, so the bound survives storage; f16 or bf16 keys in the same type are
//! stored exactly, and a one-token block's bound is then its exact dot product. A key beyond
//! `Storage`'s range stores an infinite bound, and a query meeting it scores `+inf` (the block is
//! always chosen) rather than NaN. An entry with no tokens scores `-inf`.
//!
//! Entries are stored in tiles of 16, interleaved per dimension (`cpu::detail::minmax_tile_at`), so
//! scoring multiplies one dimension of 16 entries per instruction and needs no horizontal sums.
//!
//! Models `block_summary`. Memory: `num_kv_heads * 2 * head_dim * sizeof(Storage) + 6` bytes per
//! entry, 1/16 of a 16-token f16 block; the capacity is
//! rounded up to a multiple of 16 entries. Not thread-safe for concurrent `update`; concurrent
//! `score` calls are safe.
template <class Storage = f16>
class minmax_summary {
  static_assert(std::is_same_v<Storage, f16> || std::is_same_v<Storage, bf16> ||
                    std::is_same_v<Storage, float>,
                "oasiskv: minmax_summary<Storage> needs Storage in {f16, bf16, float}");
  static constexpr std::uint32_t lanes = cpu::detail::minmax_tile_lanes;

 public:
  using storage_type = Storage;
  //! @brief Entries one pass over a tile scores (`summary_tile_entries`).
  static constexpr std::uint32_t entries_per_tile = lanes;

  minmax_summary(const kv_layout& layout, std::uint32_t capacity, cpu_isa isa = cpu_isa::best)
      : layout_(layout), capacity_(capacity), isa_(resolve(isa)) {
    layout_.validate();
    if (capacity_ == 0) [[unlikely]] {
      detail::raise(errc::invalid_argument, "minmax_summary capacity is 0");
    }
    tiles_ = (capacity_ + lanes - 1) / lanes;
    tile_elems_ = std::size_t{2} * layout_.head_dim * lanes;
    bounds_.resize(std::size_t{layout_.num_kv_heads} * tiles_ * tile_elems_);
    tokens_.resize(capacity_);
    // Every entry, and the padding lanes of the last tile, start empty: zero bounds, bias -inf.
    bias_.assign(std::size_t{tiles_} * lanes, -std::numeric_limits<float>::infinity());
  }

  std::uint32_t capacity() const noexcept { return capacity_; }
  const kv_layout& layout() const noexcept { return layout_; }
  cpu_isa isa() const noexcept { return isa_; }
  //! @brief Chooses the scoring path (tests compare them); `errc::unsupported` if it cannot run.
  void set_isa(cpu_isa isa) { isa_ = resolve(isa); }

  //! @brief Capacity becomes `capacity`: entries keep their bounds, the new ones start empty
  //! (models `growable_summary`). `errc::invalid_argument` below the current capacity.
  void grow(std::uint32_t capacity) {
    detail::check_summary_grow("minmax_summary", capacity_, capacity);
    const std::uint32_t tiles = (capacity + lanes - 1) / lanes;
    auto bounds = detail::regrow_parts(bounds_, layout_.num_kv_heads, tiles_ * tile_elems_,
                                       tiles * tile_elems_, Storage{});
    auto bias =
        detail::regrow(bias_, std::size_t{tiles} * lanes, -std::numeric_limits<float>::infinity());
    auto tokens = detail::regrow(tokens_, capacity, std::uint16_t{0});
    bounds_ = std::move(bounds);
    bias_ = std::move(bias);
    tokens_ = std::move(tokens);
    tiles_ = tiles;
    capacity_ = capacity;
  }

  //! @brief Fast-tier bytes of one entry: both bounds of every KV head, the empty-entry bias
  //! and the token count.
  std::size_t bytes_per_block() const noexcept {
    return std::size_t{layout_.num_kv_heads} * 2 * layout_.head_dim * sizeof(Storage) +
           sizeof(float) + sizeof(std::uint16_t);
  }

  //! @brief Tokens folded into entry `b`.
  std::uint32_t tokens(std::uint32_t b) const {
    check_entry(b);
    return tokens_[b];
  }

  //! @brief Empties entry `b`: its bounds become 0 and its score `-inf` (an additive bias, so
  //! that scoring needs no per-entry test).
  void reset(std::uint32_t b) {
    check_entry(b);
    fill_bounds(b, 0.0f, 0.0f);
    bias_[b] = -std::numeric_limits<float>::infinity();
    tokens_[b] = 0;
  }

  //! @brief Folds tokens `[first, first + count)` of the slot at `block` into entry `b`.
  //! Order-independent, so one-token appends and a bulk prefill give the same entry.
  void update(std::uint32_t b, const std::byte* block, std::uint32_t first, std::uint32_t count) {
    check_entry(b);
    if (count == 0) {
      return;
    }
    detail::check_summary_update("minmax_summary", layout_, block, first, count);
    const std::uint32_t d = layout_.head_dim;
    if (tokens_[b] == 0) {  // empty: fold into the identity of max / min
      fill_bounds(b, -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::infinity());
      bias_[b] = 0.0f;
    }
    visit_dtype(layout_.kv_dtype, [&](auto elem) {
      using T = decltype(elem);
      for (std::uint32_t h = 0; h < layout_.num_kv_heads; ++h) {
        const T* keys = reinterpret_cast<const T*>(block + layout_.key_offset(h));
        for (std::uint32_t x = 0; x < d; ++x) {
          Storage& hi = at(h, b, 0, x);
          Storage& lo = at(h, b, 1, x);
          for (std::uint32_t t = first; t < first + count; ++t) {
            const float v = to_float(keys[std::size_t{t} * d + x]);
            if (v > cpu::detail::widen(hi)) {
              hi = cpu::detail::round_up<Storage>(v);
              saturated_ |= cpu::detail::widen(hi) == std::numeric_limits<float>::infinity();
            }
            if (v < cpu::detail::widen(lo)) {
              lo = cpu::detail::round_down<Storage>(v);
              saturated_ |= cpu::detail::widen(lo) == -std::numeric_limits<float>::infinity();
            }
          }
        }
      }
    });
    // Folding a token twice leaves the bounds unchanged, so the count saturates rather than throws.
    tokens_[b] = static_cast<std::uint16_t>(
        std::min<std::uint32_t>(tokens_[b] + count, layout_.tokens_per_block));
  }

  //! @brief Bytes `load` takes for one entry: `[num_kv_heads][2 (max, min)][head_dim]` f16.
  std::size_t wire_bytes() const noexcept {
    return std::size_t{layout_.num_kv_heads} * 2 * layout_.head_dim * sizeof(f16);
  }

  //! @brief Sets entry `b` from a summary computed elsewhere, of a block holding `tokens`
  //! tokens: per KV head, the elementwise maximum then minimum key as f16 (little-endian, the
  //! layout of `disagg::summarize_block`, whose outward rounding this keeps: f16 storage takes
  //! the bits as they are, bf16 storage rounds the maximum up and the minimum down again).
  //! A NaN bound is taken as unbounded. Later `update`s fold into it as into any entry.
  //! Throws `errc::invalid_argument` unless `bytes` is exactly `wire_bytes()` long, and
  //! `errc::out_of_range` unless `tokens` is in [1, tokens_per_block]; the entry is then
  //! unchanged. O(bytes).
  void load(std::uint32_t b, std::span<const std::byte> bytes, std::uint32_t tokens) {
    check_entry(b);
    detail::check_summary_load("minmax_summary", layout_, b, bytes.size(), wire_bytes(), tokens);
    const std::uint32_t d = layout_.head_dim;
    constexpr float inf = std::numeric_limits<float>::infinity();
    for (std::uint32_t h = 0; h < layout_.num_kv_heads; ++h) {
      for (std::uint32_t which = 0; which < 2; ++which) {
        for (std::uint32_t x = 0; x < d; ++x) {
          f16 w;
          std::memcpy(&w, bytes.data() + ((std::size_t{h} * 2 + which) * d + x) * sizeof(f16),
                      sizeof(f16));
          float v = w.to_float();
          if (v != v) {
            v = which == 0 ? inf : -inf;
          }
          Storage& out = at(h, b, which, x);
          if constexpr (std::is_same_v<Storage, f16>) {
            out = w.to_float() == v ? w : from_float<f16>(v);
          } else {
            out = which == 0 ? cpu::detail::round_up<Storage>(v)
                             : cpu::detail::round_down<Storage>(v);
          }
          saturated_ |= cpu::detail::widen(out) == inf || cpu::detail::widen(out) == -inf;
        }
      }
    }
    bias_[b] = 0.0f;
    tokens_[b] = static_cast<std::uint16_t>(tokens);
  }

  //! @brief `out[i * n + r]` = the bound of query row `r` (of `q`, `[n][head_dim]`) over entry
  //! `entries[i]` of KV head `h`. One pass over the entries serves all `n` rows.
  void score(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
             std::uint32_t n, float* out) const {
    score_into(h, entries, q, n, cpu::detail::score_sink::entry_major(out, n));
  }

  //! @brief `score` transposed: `out[r * entries.size() + i]`, the layout the predictor's
  //! aggregations read (see `row_scoring_summary`), written straight from the kernel's tiles.
  void score_rows(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
                  std::uint32_t n, float* out) const {
    score_into(h, entries, q, n, cpu::detail::score_sink::row_major(out, entries.size()));
  }

  //! @brief The stored bounds of entry `b`, KV head `h`: `[max (head_dim)][min (head_dim)]`, a
  //! copy (entries are stored interleaved); zeros for an empty entry.
  std::vector<Storage> bounds(std::uint32_t h, std::uint32_t b) const {
    check_entry(b);
    if (h >= layout_.num_kv_heads) [[unlikely]] {
      detail::raise(errc::out_of_range, "minmax_summary::bounds: kv head ", h,
                    " >= num_kv_heads = ", layout_.num_kv_heads);
    }
    std::vector<Storage> v(std::size_t{2} * layout_.head_dim);
    for (std::uint32_t x = 0; x < layout_.head_dim; ++x) {
      v[x] = at(h, b, 0, x);
      v[layout_.head_dim + x] = at(h, b, 1, x);
    }
    return v;
  }

 private:
  void score_into(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
                  std::uint32_t n, const cpu::detail::score_sink& sink) const {
    if (h >= layout_.num_kv_heads) [[unlikely]] {
      detail::raise(errc::out_of_range, "minmax_summary::score: kv head ", h,
                    " >= num_kv_heads = ", layout_.num_kv_heads);
    }
    if (entries.empty() || n == 0) {
      return;
    }
    if (q == nullptr || sink.out == nullptr) [[unlikely]] {
      detail::raise(errc::invalid_argument, "minmax_summary::score: null query or output");
    }
    const bool contiguous = cpu::detail::check_entry_ids(entries, capacity_, "minmax_summary");
    const std::uint32_t d = layout_.head_dim;
    const Storage* tiles = bounds_.data() + std::size_t{h} * tiles_ * tile_elems_;
    // The bound is q+ . max + q- . min, one of whose terms is zero per dimension: split once
    // per call, the kernels take the nonzero one with a multiply-add (no product and max per
    // element).
    thread_local std::vector<float> split;
    split.resize(std::size_t{n} * 2 * d);
    for (std::uint32_t r = 0; r < n; ++r) {
      const float* qr = q + std::size_t{r} * d;
      float* sr = split.data() + std::size_t{r} * 2 * d;
      for (std::uint32_t x = 0; x < d; ++x) {
        sr[x] = qr[x] > 0.0f ? qr[x] : 0.0f;
        sr[d + x] = qr[x] < 0.0f ? qr[x] : 0.0f;
      }
    }
    cpu::detail::minmax_score_tiles(isa_, tiles, bias_.data(), d, entries, contiguous, split.data(),
                                    n, sink);
    if (saturated_) {  // only then can 0 * inf make NaN: an overflowed bound, keep it
      for (std::size_t i = 0; i < entries.size(); ++i) {
        for (std::uint32_t r = 0; r < n; ++r) {
          float& v = sink.at(i, r);
          v = v != v ? std::numeric_limits<float>::infinity() : v;
        }
      }
    }
  }

  static cpu_isa resolve(cpu_isa isa) { return resolve_isa(isa); }

  // [num_kv_heads][tiles][tile]: one head's entries are contiguous, so scoring a head streams
  // through memory.
  Storage& at(std::uint32_t h, std::uint32_t b, std::uint32_t which, std::uint32_t x) noexcept {
    return bounds_[(std::size_t{h} * tiles_ + b / lanes) * tile_elems_ +
                   cpu::detail::minmax_tile_at<Storage>(x, which, b % lanes)];
  }
  const Storage& at(std::uint32_t h, std::uint32_t b, std::uint32_t which,
                    std::uint32_t x) const noexcept {
    return bounds_[(std::size_t{h} * tiles_ + b / lanes) * tile_elems_ +
                   cpu::detail::minmax_tile_at<Storage>(x, which, b % lanes)];
  }
  void check_entry(std::uint32_t b) const {
    if (b >= capacity_) [[unlikely]] {
      detail::raise(errc::out_of_range, "minmax_summary: entry ", b, " >= capacity = ", capacity_);
    }
  }

  void fill_bounds(std::uint32_t b, float hi, float lo) {
    const Storage h16 = from_float<Storage>(hi), l16 = from_float<Storage>(lo);
    for (std::uint32_t h = 0; h < layout_.num_kv_heads; ++h) {
      for (std::uint32_t x = 0; x < layout_.head_dim; ++x) {
        at(h, b, 0, x) = h16;
        at(h, b, 1, x) = l16;
      }
    }
  }

  kv_layout layout_;
  std::uint32_t capacity_;
  cpu_isa isa_;
  std::uint32_t tiles_ = 0;
  std::size_t tile_elems_ = 0;
  std::vector<Storage> bounds_;        // [num_kv_heads][tiles][2 * head_dim * 16], see at()
  std::vector<float> bias_;            // [tiles * 16]: 0, or -inf for an empty entry
  std::vector<std::uint16_t> tokens_;  // tokens_per_block <= 1024 fits
  bool saturated_ = false;             // some key overflowed Storage: scores may need NaN fixing
};

}  // namespace oasiskv
