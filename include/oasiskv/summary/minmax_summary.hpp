//! @file
//! @brief `minmax_summary`: Quest's per-block elementwise key bounds, an upper bound of every
//! query's largest dot product with the block's keys.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>
#include <vector>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/layout.hpp"
#include "oasiskv/summary/score_kernels.hpp"

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
//! Models `block_summary`. Memory: `num_kv_heads * 2 * head_dim * sizeof(Storage) + 2` bytes per
//! entry, 1/16 of a 16-token f16 block. Not thread-safe for concurrent `update`; concurrent
//! `score` calls are safe.
template <class Storage = f16>
class minmax_summary {
  static_assert(std::is_same_v<Storage, f16> || std::is_same_v<Storage, bf16> ||
                    std::is_same_v<Storage, float>,
                "oasiskv: minmax_summary<Storage> needs Storage in {f16, bf16, float}");

 public:
  using storage_type = Storage;

  minmax_summary(const kv_layout& layout, std::uint32_t capacity, score_isa isa = score_isa::best)
      : layout_(layout), capacity_(capacity), isa_(resolve_score_isa(isa)) {
    layout_.validate();
    if (capacity_ == 0) [[unlikely]] {
      detail::raise(errc::invalid_argument, "minmax_summary capacity is 0");
    }
    stride_ = 2 * std::size_t{layout_.head_dim};
    bounds_.resize(std::size_t{layout_.num_kv_heads} * capacity_ * stride_);
    tokens_.resize(capacity_);
    for (std::uint32_t b = 0; b < capacity_; ++b) {
      reset(b);
    }
  }

  std::uint32_t capacity() const noexcept { return capacity_; }
  const kv_layout& layout() const noexcept { return layout_; }
  score_isa isa() const noexcept { return isa_; }
  //! @brief Chooses the scoring path (tests compare them); `errc::unsupported` if it cannot run.
  void set_isa(score_isa isa) { isa_ = resolve_score_isa(isa); }

  //! @brief Fast-tier bytes of one entry: both bounds of every KV head, and the token count.
  std::size_t bytes_per_block() const noexcept {
    return std::size_t{layout_.num_kv_heads} * stride_ * sizeof(Storage) + sizeof(std::uint16_t);
  }

  //! @brief Tokens folded into entry `b`.
  std::uint32_t tokens(std::uint32_t b) const {
    check_entry(b);
    return tokens_[b];
  }

  void reset(std::uint32_t b) {
    check_entry(b);
    const Storage neg_inf = from_float<Storage>(-std::numeric_limits<float>::infinity());
    const Storage pos_inf = from_float<Storage>(std::numeric_limits<float>::infinity());
    const std::uint32_t d = layout_.head_dim;
    for (std::uint32_t h = 0; h < layout_.num_kv_heads; ++h) {
      Storage* e = entry(h, b);
      for (std::uint32_t x = 0; x < d; ++x) {
        e[x] = neg_inf;      // maximum
        e[d + x] = pos_inf;  // minimum
      }
    }
    tokens_[b] = 0;
  }

  //! @brief Folds tokens `[first, first + count)` of the slot at `block` into entry `b`.
  //! Order-independent, so one-token appends and a bulk prefill give the same entry.
  void update(std::uint32_t b, const std::byte* block, std::uint32_t first, std::uint32_t count) {
    check_entry(b);
    if (count == 0) {
      return;
    }
    if (block == nullptr) [[unlikely]] {
      detail::raise(errc::invalid_argument, "minmax_summary::update: block is null");
    }
    if (first >= layout_.tokens_per_block || count > layout_.tokens_per_block - first)
        [[unlikely]] {
      detail::raise(errc::out_of_range, "minmax_summary::update: tokens [", first, ", ",
                    std::uint64_t{first} + count,
                    ") exceed tokens_per_block = ", layout_.tokens_per_block);
    }
    const std::uint32_t d = layout_.head_dim;
    visit_dtype(layout_.kv_dtype, [&](auto elem) {
      using T = decltype(elem);
      for (std::uint32_t h = 0; h < layout_.num_kv_heads; ++h) {
        const T* keys = reinterpret_cast<const T*>(block + layout_.key_offset(h));
        Storage* e = entry(h, b);
        for (std::uint32_t t = first; t < first + count; ++t) {
          const T* k = keys + std::size_t{t} * d;
          for (std::uint32_t x = 0; x < d; ++x) {
            const float v = to_float(k[x]);
            if (v > detail::widen(e[x])) {
              e[x] = detail::round_up<Storage>(v);
              saturated_ |= detail::widen(e[x]) == std::numeric_limits<float>::infinity();
            }
            if (v < detail::widen(e[d + x])) {
              e[d + x] = detail::round_down<Storage>(v);
              saturated_ |= detail::widen(e[d + x]) == -std::numeric_limits<float>::infinity();
            }
          }
        }
      }
    });
    // Folding a token twice leaves the bounds unchanged, so the count saturates rather than throws.
    tokens_[b] = static_cast<std::uint16_t>(
        std::min<std::uint32_t>(tokens_[b] + count, layout_.tokens_per_block));
  }

  //! @brief `out[i * n + r]` = the bound of query row `r` (of `q`, `[n][head_dim]`) over entry
  //! `entries[i]` of KV head `h`. One pass over the entries serves all `n` rows.
  void score(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
             std::uint32_t n, float* out) const {
    if (h >= layout_.num_kv_heads) [[unlikely]] {
      detail::raise(errc::out_of_range, "minmax_summary::score: kv head ", h,
                    " >= num_kv_heads = ", layout_.num_kv_heads);
    }
    if (entries.empty() || n == 0) {
      return;
    }
    if (q == nullptr || out == nullptr) [[unlikely]] {
      detail::raise(errc::invalid_argument, "minmax_summary::score: null query or output");
    }
    for (const std::uint32_t b : entries) {
      check_entry(b);
    }
    // The bound is q+ . max + q- . min: split once per call so the kernel is two plain dot
    // products (fused multiply-adds) instead of two products and a max per element.
    const std::uint32_t d = layout_.head_dim;
    thread_local std::vector<float> split;
    split.resize(std::size_t{n} * stride_);
    for (std::uint32_t r = 0; r < n; ++r) {
      const float* qr = q + std::size_t{r} * d;
      float* sr = split.data() + std::size_t{r} * stride_;
      for (std::uint32_t x = 0; x < d; ++x) {
        sr[x] = qr[x] > 0.0f ? qr[x] : 0.0f;
        sr[d + x] = qr[x] < 0.0f ? qr[x] : 0.0f;
      }
    }
    detail::dot_entries(isa_, entry(h, 0), stride_, entries, split.data(), n,
                        static_cast<std::uint32_t>(stride_), out);
    for (std::size_t i = 0; i < entries.size(); ++i) {
      float* o = out + i * n;
      if (tokens_[entries[i]] == 0) {
        std::fill(o, o + n, -std::numeric_limits<float>::infinity());
      } else if (saturated_) {  // only then can 0 * inf make NaN: an overflowed bound, keep it
        for (std::uint32_t r = 0; r < n; ++r) {
          o[r] = o[r] != o[r] ? std::numeric_limits<float>::infinity() : o[r];
        }
      }
    }
  }

  //! @brief The stored bounds of entry `b`, KV head `h`: `[max (head_dim)][min (head_dim)]`.
  std::span<const Storage> bounds(std::uint32_t h, std::uint32_t b) const {
    check_entry(b);
    if (h >= layout_.num_kv_heads) [[unlikely]] {
      detail::raise(errc::out_of_range, "minmax_summary::bounds: kv head ", h,
                    " >= num_kv_heads = ", layout_.num_kv_heads);
    }
    return {entry(h, b), stride_};
  }

 private:
  // [num_kv_heads][capacity][2][head_dim]: one head's entries are contiguous, so scoring a head
  // streams through memory.
  Storage* entry(std::uint32_t h, std::uint32_t b) noexcept {
    return bounds_.data() + (std::size_t{h} * capacity_ + b) * stride_;
  }
  const Storage* entry(std::uint32_t h, std::uint32_t b) const noexcept {
    return bounds_.data() + (std::size_t{h} * capacity_ + b) * stride_;
  }
  void check_entry(std::uint32_t b) const {
    if (b >= capacity_) [[unlikely]] {
      detail::raise(errc::out_of_range, "minmax_summary: entry ", b, " >= capacity = ", capacity_);
    }
  }

  kv_layout layout_;
  std::uint32_t capacity_;
  score_isa isa_;
  std::size_t stride_ = 0;
  std::vector<Storage> bounds_;
  std::vector<std::uint16_t> tokens_;  // tokens_per_block <= 1024 fits
  bool saturated_ = false;             // some key overflowed Storage: scores may need NaN fixing
};

}  // namespace oasiskv
