//! @file
//! @brief Argument checks shared by the `block_summary` models.
#pragma once

#include <cstddef>
#include <cstdint>

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

}  // namespace oasiskv::detail
