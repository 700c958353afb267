// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `kv_layout`: the shape of a model's KV cache and of one block slot.
#pragma once

#include <cstddef>
#include <cstdint>

#include "oasiskv/config.hpp"
#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/error.hpp"

namespace oasiskv {

//! @brief Upper bounds that `kv_layout::validate` enforces. They are far above any published
//! model and exist to turn a garbage value (an uninitialised field, a byte count passed as a head
//! count) into an error instead of a multi-gigabyte allocation.
struct layout_limits {
  static constexpr std::uint32_t max_layers = 1024;
  static constexpr std::uint32_t max_heads = 1024;
  static constexpr std::uint32_t max_head_dim = 1024;
  static constexpr std::uint32_t head_dim_multiple = 8;  // 16-byte rows in f16/bf16
  static constexpr std::uint32_t max_tokens_per_block = 1024;
  static constexpr std::size_t max_block_bytes = std::size_t{1} << 30;
};

//! @brief The shape of a KV cache. One *block* holds `tokens_per_block` consecutive tokens of one
//! layer, keys and values of every KV head, laid out as
//! `[2 (K, V)][num_kv_heads][tokens_per_block][head_dim]` so that one head's keys (or values) for
//! the whole block are contiguous: the unit an attention kernel streams.
struct kv_layout {
  std::uint32_t num_layers = 0;
  std::uint32_t num_q_heads = 0;
  std::uint32_t num_kv_heads = 0;
  std::uint32_t head_dim = 0;
  std::uint32_t tokens_per_block = 0;
  dtype kv_dtype = dtype::f16;

  //! @brief Throws `oasiskv::error{errc::invalid_layout}` naming the first bad field and value.
  void validate() const {
    auto check = [](bool ok, const char* field, std::uint64_t value, const char* rule) {
      if (!ok) [[unlikely]] {
        detail::raise(errc::invalid_layout, "kv_layout.", field, " = ", value, ": ", rule);
      }
    };
    using L = layout_limits;
    check(num_layers >= 1 && num_layers <= L::max_layers, "num_layers", num_layers,
          "must be in [1, 1024]");
    check(num_q_heads >= 1 && num_q_heads <= L::max_heads, "num_q_heads", num_q_heads,
          "must be in [1, 1024]");
    check(num_kv_heads >= 1 && num_kv_heads <= num_q_heads, "num_kv_heads", num_kv_heads,
          "must be in [1, num_q_heads]");
    if (num_q_heads % num_kv_heads != 0) [[unlikely]] {
      detail::raise(errc::invalid_layout, "kv_layout.num_q_heads = ", num_q_heads,
                    " is not a multiple of num_kv_heads = ", num_kv_heads,
                    " (each KV head must serve a whole GQA group)");
    }
    check(head_dim >= L::head_dim_multiple && head_dim <= L::max_head_dim, "head_dim", head_dim,
          "must be in [8, 1024]");
    check(head_dim % L::head_dim_multiple == 0, "head_dim", head_dim,
          "must be a multiple of 8 (rows of 16 bytes)");
    check(tokens_per_block >= 1 && tokens_per_block <= L::max_tokens_per_block, "tokens_per_block",
          tokens_per_block, "must be in [1, 1024]");
    check(kv_dtype == dtype::f32 || kv_dtype == dtype::f16 || kv_dtype == dtype::bf16, "kv_dtype",
          static_cast<std::uint64_t>(kv_dtype), "must be f32, f16 or bf16");
    check(block_bytes() <= L::max_block_bytes, "block_bytes()", block_bytes(),
          "a block of one layer must not exceed 1 GiB");
  }

  //! @brief Query heads that share one KV head.
  OASISKV_HOST_DEVICE constexpr std::uint32_t group_size() const noexcept {
    return num_q_heads / num_kv_heads;
  }
  OASISKV_HOST_DEVICE constexpr std::size_t elem_bytes() const noexcept {
    return dtype_size(kv_dtype);
  }
  //! @brief Bytes of one token's key (or value) for one head.
  OASISKV_HOST_DEVICE constexpr std::size_t row_bytes() const noexcept {
    return std::size_t{head_dim} * elem_bytes();
  }
  //! @brief Bytes of one head's keys (or values) over a whole block.
  OASISKV_HOST_DEVICE constexpr std::size_t head_bytes() const noexcept {
    return std::size_t{tokens_per_block} * row_bytes();
  }
  //! @brief Bytes of one layer's block, keys and values: the size of one slot.
  OASISKV_HOST_DEVICE constexpr std::size_t block_bytes() const noexcept {
    return 2 * std::size_t{num_kv_heads} * head_bytes();
  }
  //! @brief Byte offset of head `h`'s keys inside a slot.
  OASISKV_HOST_DEVICE constexpr std::size_t key_offset(std::uint32_t h) const noexcept {
    return std::size_t{h} * head_bytes();
  }
  //! @brief Byte offset of head `h`'s values inside a slot.
  OASISKV_HOST_DEVICE constexpr std::size_t value_offset(std::uint32_t h) const noexcept {
    return (std::size_t{num_kv_heads} + h) * head_bytes();
  }
  //! @brief Blocks needed to hold `tokens` tokens of one layer.
  OASISKV_HOST_DEVICE constexpr std::uint32_t blocks_for(std::uint64_t tokens) const noexcept {
    return static_cast<std::uint32_t>((tokens + tokens_per_block - 1) / tokens_per_block);
  }
  //! @brief KV bytes of one token across all layers (what a dense cache holds per token).
  OASISKV_HOST_DEVICE constexpr std::size_t bytes_per_token() const noexcept {
    return 2 * std::size_t{num_layers} * num_kv_heads * row_bytes();
  }

  friend constexpr bool operator==(const kv_layout&, const kv_layout&) = default;
};

}  // namespace oasiskv
