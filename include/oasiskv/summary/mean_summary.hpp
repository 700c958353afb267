// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `mean_summary`: the mean key of each block and head, a cheap estimate (not a bound) of
//! how much a query attends to the block.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/layout.hpp"
#include "oasiskv/cpu/math.hpp"
#include "oasiskv/summary/summary_checks.hpp"

namespace oasiskv {

//! @brief Per entry and KV head, the f32 sum of the keys folded in and their count; `score`
//! returns `dot(q, sum) / count`, the query's dot product with the mean key.
//!
//! The sum, not the mean, is stored so that an entry is exact under incremental updates: the
//! keys are added one token at a time in token order whether they arrive one by one or in bulk,
//! so both give the same bits. It estimates the block's average attention logit rather than its
//! largest, so it misses a block whose one key matters (minmax_summary does not).
//!
//! Models `block_summary`. Memory: `num_kv_heads * head_dim * 4 + 2` bytes per entry. Tokens
//! must each be folded in once. Concurrent `score` calls are safe.
class mean_summary {
 public:
  mean_summary(const kv_layout& layout, std::uint32_t capacity, cpu_isa isa = cpu_isa::best)
      : layout_(layout), capacity_(capacity), isa_(resolve_isa(isa)) {
    layout_.validate();
    if (capacity_ == 0) [[unlikely]] {
      detail::raise(errc::invalid_argument, "mean_summary capacity is 0");
    }
    sums_.assign(std::size_t{layout_.num_kv_heads} * capacity_ * layout_.head_dim, 0.0f);
    tokens_.assign(capacity_, 0);
  }

  std::uint32_t capacity() const noexcept { return capacity_; }
  const kv_layout& layout() const noexcept { return layout_; }
  cpu_isa isa() const noexcept { return isa_; }
  void set_isa(cpu_isa isa) { isa_ = resolve_isa(isa); }

  //! @brief Capacity becomes `capacity`: entries keep their sums, the new ones start empty
  //! (models `growable_summary`). `errc::invalid_argument` below the current capacity.
  void grow(std::uint32_t capacity) {
    detail::check_summary_grow("mean_summary", capacity_, capacity);
    const std::size_t d = layout_.head_dim;
    auto sums =
        detail::regrow_parts(sums_, layout_.num_kv_heads, capacity_ * d, capacity * d, 0.0f);
    auto tokens = detail::regrow(tokens_, capacity, std::uint16_t{0});
    sums_ = std::move(sums);
    tokens_ = std::move(tokens);
    capacity_ = capacity;
  }

  std::size_t bytes_per_block() const noexcept {
    return std::size_t{layout_.num_kv_heads} * layout_.head_dim * sizeof(float) +
           sizeof(std::uint16_t);
  }

  std::uint32_t tokens(std::uint32_t b) const {
    check_entry(b);
    return tokens_[b];
  }

  void reset(std::uint32_t b) {
    check_entry(b);
    for (std::uint32_t h = 0; h < layout_.num_kv_heads; ++h) {
      float* e = entry(h, b);
      for (std::uint32_t x = 0; x < layout_.head_dim; ++x) {
        e[x] = 0.0f;
      }
    }
    tokens_[b] = 0;
  }

  //! @brief Adds the keys of tokens `[first, first + count)` of the slot at `block` to entry `b`.
  void update(std::uint32_t b, const std::byte* block, std::uint32_t first, std::uint32_t count) {
    check_entry(b);
    if (count == 0) {
      return;
    }
    detail::check_summary_update("mean_summary", layout_, block, first, count);
    if (tokens_[b] + count > layout_.tokens_per_block) [[unlikely]] {
      detail::raise(errc::out_of_range, "mean_summary::update: entry ", b, " would hold ",
                    tokens_[b] + count,
                    " tokens, more than tokens_per_block = ", layout_.tokens_per_block,
                    " (a token folded in twice?)");
    }
    const std::uint32_t d = layout_.head_dim;
    visit_dtype(layout_.kv_dtype, [&](auto elem) {
      using T = decltype(elem);
      for (std::uint32_t h = 0; h < layout_.num_kv_heads; ++h) {
        const T* keys = reinterpret_cast<const T*>(block + layout_.key_offset(h));
        float* e = entry(h, b);
        for (std::uint32_t t = first; t < first + count; ++t) {
          const T* k = keys + std::size_t{t} * d;
          for (std::uint32_t x = 0; x < d; ++x) {
            e[x] += to_float(k[x]);
          }
        }
      }
    });
    tokens_[b] = static_cast<std::uint16_t>(tokens_[b] + count);
  }

  //! @brief `out[i * n + r] = dot(q_r, mean key of entries[i], head h)`; `-inf` for an empty
  //! entry.
  void score(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
             std::uint32_t n, float* out) const {
    if (h >= layout_.num_kv_heads) [[unlikely]] {
      detail::raise(errc::out_of_range, "mean_summary::score: kv head ", h,
                    " >= num_kv_heads = ", layout_.num_kv_heads);
    }
    if (entries.empty() || n == 0) {
      return;
    }
    if (q == nullptr || out == nullptr) [[unlikely]] {
      detail::raise(errc::invalid_argument, "mean_summary::score: null query or output");
    }
    for (const std::uint32_t b : entries) {
      check_entry(b);
    }
    cpu::detail::dot_entries(isa_, entry(h, 0), layout_.head_dim, entries, q, n, layout_.head_dim,
                             out);
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const std::uint32_t c = tokens_[entries[i]];
      const float inv = c == 0 ? 0.0f : 1.0f / static_cast<float>(c);
      for (std::uint32_t r = 0; r < n; ++r) {
        out[i * n + r] = c == 0 ? -std::numeric_limits<float>::infinity() : out[i * n + r] * inv;
      }
    }
  }

  //! @brief The stored key sum of entry `b`, KV head `h` (`head_dim` floats).
  std::span<const float> sums(std::uint32_t h, std::uint32_t b) const {
    check_entry(b);
    if (h >= layout_.num_kv_heads) [[unlikely]] {
      detail::raise(errc::out_of_range, "mean_summary::sums: kv head ", h,
                    " >= num_kv_heads = ", layout_.num_kv_heads);
    }
    return {entry(h, b), layout_.head_dim};
  }

 private:
  // [num_kv_heads][capacity][head_dim]
  float* entry(std::uint32_t h, std::uint32_t b) noexcept {
    return sums_.data() + (std::size_t{h} * capacity_ + b) * layout_.head_dim;
  }
  const float* entry(std::uint32_t h, std::uint32_t b) const noexcept {
    return sums_.data() + (std::size_t{h} * capacity_ + b) * layout_.head_dim;
  }
  void check_entry(std::uint32_t b) const {
    if (b >= capacity_) [[unlikely]] {
      detail::raise(errc::out_of_range, "mean_summary: entry ", b, " >= capacity = ", capacity_);
    }
  }

  kv_layout layout_;
  std::uint32_t capacity_;
  cpu_isa isa_;
  std::vector<float> sums_;
  std::vector<std::uint16_t> tokens_;
};

}  // namespace oasiskv
