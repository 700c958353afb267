// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief One task of the CPU decode kernel as its code paths see it (a range of one table's
//! entries, for one or all KV heads), the causal visibility of a block, and the generic driver
//! that runs a per-block function over a range.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "oasiskv/attention/cpu/row_state.hpp"
#include "oasiskv/attention/validate.hpp"
#include "oasiskv/core/ids.hpp"
#include "oasiskv/core/views.hpp"

namespace oasiskv::cpu::detail {

//! @brief Entries `[begin, end)` of one block table, for KV heads `[head, head + heads)` of one
//! sequence of `len` tokens whose last `q_len` tokens are the queries. `states[hi]` is head
//! `head + hi`'s running state (rows: `q_len x group`, row `r` = query token `r / group`).
struct item_span {
  row_state* states = nullptr;
  block_pool_view pool{};
  const block_ref* refs = nullptr;
  std::uint32_t begin = 0, end = 0;
  std::uint32_t head = 0, heads = 0;
  std::uint32_t len = 0, q_len = 0, group = 0;
};

//! @brief Runs one task: updates `states` with every block of the range.
using range_fn = void (*)(const item_span& a);

//! @brief Causal visibility of block `index` (holding `fill` tokens): `vis[j]` = tokens of the
//! block that query token `j` sees (query token `j` is at position `len - q_len + j`). Returns
//! the most any query token sees (that of the last one), 0 when none sees anything.
inline std::uint32_t block_visibility(std::uint32_t tokens_per_block, std::uint32_t index,
                                      std::uint32_t fill, std::uint32_t len, std::uint32_t q_len,
                                      std::uint32_t* vis) noexcept {
  const std::uint64_t start = std::uint64_t{index} * tokens_per_block;
  const std::uint64_t first_pos = len - q_len;
  for (std::uint32_t j = 0; j < q_len; ++j) {
    const std::uint64_t pos = first_pos + j;
    vis[j] = pos < start
                 ? 0u
                 : static_cast<std::uint32_t>(std::min<std::uint64_t>(fill, pos - start + 1));
  }
  return vis[q_len - 1];
}

//! @brief A `range_fn` made of a per-block function `Block` (see `block_fn`): walks the range
//! block by block and, within a block, head by head (so each slot's bytes stream in address
//! order), prefetching the next head's (or next block's first head's) K and V.
template <class T, void (*Block)(const row_state&, const block_span&)>
void range_blocks(const item_span& a) {
  const kv_layout& l = a.pool.layout;
  const std::uint32_t g = a.group;
  const std::uint32_t rows = a.q_len * g;
  std::uint32_t qvis[16];  // q_len <= 16 (validated)
  std::vector<std::uint32_t> rv(rows);
  for (std::uint32_t hi = 0; hi < a.heads; ++hi) {
    a.states[hi].vis = rv.data();
  }
  for (std::uint32_t i = a.begin; i < a.end; ++i) {
    const block_ref ref = a.refs[i];
    const std::uint32_t fill = block_fill(l, ref.index, a.len);
    const std::uint32_t vmax =
        block_visibility(l.tokens_per_block, ref.index, fill, a.len, a.q_len, qvis);
    if (vmax == 0) {
      continue;
    }
    for (std::uint32_t j = 0; j < a.q_len; ++j) {
      std::fill_n(rv.data() + std::size_t{j} * g, g, qvis[j]);
    }
    for (std::uint32_t hi = 0; hi < a.heads; ++hi) {
      const std::uint32_t h = a.head + hi;
      block_span b{
          a.pool.keys<T>(ref.slot, h), a.pool.values<T>(ref.slot, h), nullptr, nullptr, fill, vmax};
      if (hi + 1 < a.heads) {
        b.next_k = a.pool.keys<T>(ref.slot, h + 1);
        b.next_v = a.pool.values<T>(ref.slot, h + 1);
      } else if (i + 1 < a.end) {
        b.next_k = a.pool.keys<T>(a.refs[i + 1].slot, a.head);
        b.next_v = a.pool.values<T>(a.refs[i + 1].slot, a.head);
      }
      Block(a.states[hi], b);
    }
  }
}

}  // namespace oasiskv::cpu::detail
