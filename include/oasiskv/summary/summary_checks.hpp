// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Argument checks shared by the `block_summary` models.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "oasiskv/core/error.hpp"
#include "oasiskv/core/layout.hpp"

namespace oasiskv::detail {

//! @brief Throws unless `block` is non-null and `[first, first + count)` lies inside one block;
//! `who` names the summary in the message.
inline void check_summary_update(const char* who, const kv_layout& layout, const std::byte* block,
                                 std::uint32_t first, std::uint32_t count) {
  if (block == nullptr) [[unlikely]] {
    raise(errc::invalid_argument, who, "::update: block is null");
  }
  if (first >= layout.tokens_per_block || count > layout.tokens_per_block - first) [[unlikely]] {
    raise(errc::out_of_range, who, "::update: tokens [", first, ", ", std::uint64_t{first} + count,
          ") exceed tokens_per_block = ", layout.tokens_per_block);
  }
}

//! @brief Throws unless `bytes` is the `wire` bytes of one shipped entry
//! (`[num_kv_heads][2][head_dim]` f16) and `tokens` a block's token count, for entry `b` of
//! `who::load`.
inline void check_summary_load(const char* who, const kv_layout& layout, std::uint32_t b,
                               std::size_t bytes, std::size_t wire, std::uint32_t tokens) {
  if (bytes != wire) [[unlikely]] {
    raise(errc::invalid_argument, who, "::load: entry ", b, " got ", bytes, " bytes, expected ",
          wire, " (", layout.num_kv_heads, " kv heads x 2 x head_dim ", layout.head_dim, " x f16)");
  }
  if (tokens == 0 || tokens > layout.tokens_per_block) [[unlikely]] {
    raise(errc::out_of_range, who, "::load: entry ", b, " of ", tokens,
          " tokens; a block holds 1 to ", layout.tokens_per_block);
  }
}

//! @brief Throws unless `capacity` may replace `current` in `who::grow`.
inline void check_summary_grow(const char* who, std::uint32_t current, std::uint32_t capacity) {
  if (capacity < current) [[unlikely]] {
    raise(errc::invalid_argument, who, "::grow(", capacity, "): below the current capacity ",
          current);
  }
}

//! @brief `v`, `[parts][old_per_part]` elements, re-laid as `[parts][new_per_part]`: each part
//! keeps its elements at its front and the rest is `fill`. For head-major summary stores (the
//! caller moves the result in once every allocation has succeeded).
template <class T>
std::vector<T> regrow_parts(const std::vector<T>& v, std::size_t parts, std::size_t old_per_part,
                            std::size_t new_per_part, const T& fill) {
  std::vector<T> grown(parts * new_per_part, fill);
  for (std::size_t p = 0; p < parts; ++p) {
    std::copy_n(v.begin() + static_cast<std::ptrdiff_t>(p * old_per_part), old_per_part,
                grown.begin() + static_cast<std::ptrdiff_t>(p * new_per_part));
  }
  return grown;
}

//! @brief A copy of `v` resized to `n` elements, the new ones `fill`.
template <class T>
std::vector<T> regrow(const std::vector<T>& v, std::size_t n, const T& fill) {
  std::vector<T> grown(n, fill);
  std::copy_n(v.begin(), std::min(n, v.size()), grown.begin());
  return grown;
}

}  // namespace oasiskv::detail
