// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Host-side validation of a `decode_params` whose tables live in host memory. Every CPU
//! kernel runs it before touching data, so that bad input is an `oasiskv::error`, never a read out
//! of bounds.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "oasiskv/core/decode_params.hpp"
#include "oasiskv/core/error.hpp"

namespace oasiskv {

//! @brief Throws `oasiskv::error` naming the first problem found. O(total refs + blocks).
inline void validate(const decode_params& p) {
  p.pool.validate();
  const kv_layout& l = p.pool.layout;
  auto check_ptr = [](const void* ptr, const char* name) {
    if (ptr == nullptr) [[unlikely]] {
      detail::raise(errc::invalid_argument, "decode_params.", name, " is null");
    }
    if (reinterpret_cast<std::uintptr_t>(ptr) % alignof(float) != 0) [[unlikely]] {
      detail::raise(errc::misaligned, "decode_params.", name, " = ", ptr,
                    " is not aligned to a float");
    }
  };
  check_ptr(p.q, "q");
  check_ptr(p.out, "out");
  check_ptr(p.lse, "lse");
  check_ptr(p.seq_lens, "seq_lens");
  if (p.table.refs == nullptr || p.table.offsets == nullptr) [[unlikely]] {
    detail::raise(errc::invalid_argument, "decode_params.table has a null refs or offsets");
  }
  if (p.num_seqs == 0 || p.table.num_seqs != p.num_seqs) [[unlikely]] {
    detail::raise(errc::invalid_argument, "decode_params.num_seqs = ", p.num_seqs,
                  " must be >= 1 and equal table.num_seqs = ", p.table.num_seqs);
  }
  if (p.q_len < 1 || p.q_len > max_query_tokens) [[unlikely]] {
    detail::raise(errc::invalid_argument, "decode_params.q_len = ", p.q_len, " must be in [1, 16]");
  }
  if (p.table.tables_per_seq != 1 && p.table.tables_per_seq != l.num_kv_heads) [[unlikely]] {
    detail::raise(errc::invalid_argument,
                  "block_table_view.tables_per_seq = ", p.table.tables_per_seq,
                  " must be 1 or num_kv_heads = ", l.num_kv_heads);
  }
  if (!std::isfinite(p.scale)) [[unlikely]] {
    detail::raise(errc::invalid_argument, "decode_params.scale = ", p.scale, " is not finite");
  }
  if (p.table.offsets[0] != 0) [[unlikely]] {
    detail::raise(errc::invalid_argument, "block_table_view.offsets[0] = ", p.table.offsets[0],
                  " must be 0");
  }
  std::vector<std::uint8_t> seen;
  for (std::uint32_t s = 0; s < p.num_seqs; ++s) {
    const std::uint32_t len = p.seq_lens[s];
    if (len < p.q_len) [[unlikely]] {
      detail::raise(errc::invalid_argument, "seq_lens[", s, "] = ", len,
                    " is shorter than q_len = ", p.q_len);
    }
    const std::uint32_t nblocks = l.blocks_for(len);
    for (std::uint32_t h = 0; h < p.table.tables_per_seq; ++h) {
      const std::uint32_t t = s * p.table.tables_per_seq + h;
      if (p.table.offsets[t + 1] < p.table.offsets[t]) [[unlikely]] {
        detail::raise(errc::invalid_argument, "block_table_view.offsets decrease at table ", t,
                      ": ", p.table.offsets[t], " -> ", p.table.offsets[t + 1]);
      }
      const std::uint32_t n = p.table.size(t);
      if (n == 0) [[unlikely]] {
        detail::raise(errc::invalid_argument, "block table ", t, " (sequence ", s, ", kv head ", h,
                      ") is empty");
      }
      seen.assign(nblocks, 0);
      const block_ref* refs = p.table.begin(t);
      for (std::uint32_t i = 0; i < n; ++i) {
        const block_ref r = refs[i];
        if (r.slot >= p.pool.num_slots) [[unlikely]] {
          detail::raise(errc::invalid_slot, "block table ", t, " entry ", i, ": slot ", r.slot,
                        " is outside the pool of ", p.pool.num_slots, " slots");
        }
        if (r.index >= nblocks) [[unlikely]] {
          detail::raise(errc::out_of_range, "block table ", t, " entry ", i, ": block ", r.index,
                        " is past the end of sequence ", s, " (", len, " tokens, ", nblocks,
                        " blocks)");
        }
        if (seen[r.index]++) [[unlikely]] {
          detail::raise(errc::invalid_argument, "block table ", t, " lists block ", r.index,
                        " twice");
        }
      }
    }
  }
}

//! @brief Tokens of block `index` that a sequence of `seq_len` tokens holds (the fill).
OASISKV_HOST_DEVICE constexpr std::uint32_t block_fill(const kv_layout& l, std::uint32_t index,
                                                       std::uint32_t seq_len) noexcept {
  const std::uint64_t start = std::uint64_t{index} * l.tokens_per_block;
  if (start >= seq_len) {
    return 0;
  }
  const std::uint64_t rest = seq_len - start;
  return rest < l.tokens_per_block ? static_cast<std::uint32_t>(rest) : l.tokens_per_block;
}

}  // namespace oasiskv
