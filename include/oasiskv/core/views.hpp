// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Trivially copyable views that kernels take by value: a pool of block slots and a block
//! table. They own nothing; host and device code read them alike.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "oasiskv/config.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/ids.hpp"
#include "oasiskv/core/layout.hpp"

namespace oasiskv {

//! @brief Alignment, in bytes, of a pool's base and slot stride. Kernels issue 16-byte loads.
inline constexpr std::size_t pool_alignment = 16;

//! @brief A pool of block slots in one address space.
struct block_pool_view {
  std::byte* base = nullptr;    // [num_slots][2][num_kv_heads][tokens_per_block][head_dim]
  std::size_t slot_stride = 0;  // bytes from one slot to the next; >= layout.block_bytes()
  std::uint32_t num_slots = 0;
  kv_layout layout{};

  OASISKV_HOST_DEVICE std::byte* slot(slot_id s) const noexcept { return base + s * slot_stride; }

  //! @brief Head `h`'s keys in slot `s`.  // [tokens_per_block][head_dim]
  template <class T>
  OASISKV_HOST_DEVICE const T* keys(slot_id s, std::uint32_t h) const noexcept {
    return reinterpret_cast<const T*>(slot(s) + layout.key_offset(h));
  }
  //! @brief Head `h`'s values in slot `s`.  // [tokens_per_block][head_dim]
  template <class T>
  OASISKV_HOST_DEVICE const T* values(slot_id s, std::uint32_t h) const noexcept {
    return reinterpret_cast<const T*>(slot(s) + layout.value_offset(h));
  }

  //! @brief Throws `oasiskv::error` when the view cannot be read as its layout says.
  void validate() const {
    layout.validate();
    if (base == nullptr) [[unlikely]] {
      detail::raise(errc::invalid_argument, "block_pool_view.base is null");
    }
    if (reinterpret_cast<std::uintptr_t>(base) % pool_alignment != 0) [[unlikely]] {
      detail::raise(errc::misaligned, "block_pool_view.base = ", static_cast<const void*>(base),
                    " is not ", pool_alignment, "-byte aligned");
    }
    if (slot_stride < layout.block_bytes() || slot_stride % pool_alignment != 0) [[unlikely]] {
      detail::raise(
          errc::layout_mismatch, "block_pool_view.slot_stride = ", slot_stride,
          " must be a multiple of 16 and at least block_bytes() = ", layout.block_bytes());
    }
    if (num_slots == 0) [[unlikely]] {
      detail::raise(errc::invalid_argument, "block_pool_view.num_slots is 0");
    }
  }
};

//! @brief The blocks each sequence attends to. Table `i` is `refs[offsets[i] .. offsets[i+1])`.
//! With `tables_per_seq == 1` a sequence has one table for all its KV heads; with
//! `tables_per_seq == num_kv_heads` each KV head has its own (per-head selection), table
//! `seq * num_kv_heads + kv_head`.
struct block_table_view {
  const block_ref* refs = nullptr;         // [offsets[num_seqs * tables_per_seq]]
  const std::uint32_t* offsets = nullptr;  // [num_seqs * tables_per_seq + 1]
  std::uint32_t num_seqs = 0;
  std::uint32_t tables_per_seq = 1;

  OASISKV_HOST_DEVICE std::uint32_t table_index(std::uint32_t seq,
                                                std::uint32_t kv_head) const noexcept {
    return tables_per_seq == 1 ? seq : seq * tables_per_seq + kv_head;
  }
  OASISKV_HOST_DEVICE const block_ref* begin(std::uint32_t table) const noexcept {
    return refs + offsets[table];
  }
  OASISKV_HOST_DEVICE std::uint32_t size(std::uint32_t table) const noexcept {
    return offsets[table + 1] - offsets[table];
  }
};

static_assert(std::is_trivially_copyable_v<block_pool_view>);
static_assert(std::is_trivially_copyable_v<block_table_view>);
static_assert(std::is_trivially_copyable_v<kv_layout>);

}  // namespace oasiskv
