// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cache::admission`: what a sequence costs in fast memory under a selective cache
//! against a dense one, and which blocks are staged when it is admitted. Shared by
//! `tiered_kv_cache` and the decode node's `disagg::remote_sequence`.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "oasiskv/core/kept_window.hpp"
#include "oasiskv/core/layout.hpp"
#include "oasiskv/kv_cache_types.hpp"

namespace oasiskv {

//! @brief How a sequence is admitted to fast memory.
enum class admission_mode : std::uint8_t {
  full,       //!< dense: every block staged (or copied) at admission
  selective,  //!< the kept blocks at admission (sinks, recent window); the rest per step
};

}  // namespace oasiskv

namespace oasiskv::cache {

//! @brief The fast-memory footprint of sequences under a budget. A selective cache keeps at most
//! `staged_cap` blocks of one (sequence, layer) staged at once, plus every block's summary; a
//! dense one every block.
class admission {
 public:
  //! @param staged_cap blocks of one (sequence, layer) staged at once, at most
  //! @param summary_bytes_per_block the summary of one block and layer (0 without a summary)
  constexpr admission(const kv_layout& layout, std::uint64_t staged_cap,
                      std::uint64_t summary_bytes_per_block) noexcept
      : layout_(layout), staged_cap_(staged_cap), summary_bytes_(summary_bytes_per_block) {}

  //! @brief A cache whose steps take `budget_blocks` per table (or up to `block_cap` with an
  //! adaptive budget): two selections staged per layer, the one attended and the one
  //! prefetched for the next step (`tiered_kv_cache`).
  static constexpr admission double_buffered(const kv_layout& layout, std::uint32_t budget_blocks,
                                             std::uint32_t block_cap,
                                             std::uint64_t summary_bytes_per_block) noexcept {
    return {layout, std::max<std::uint64_t>(2ull * budget_blocks, block_cap),
            summary_bytes_per_block};
  }
  //! @brief A pool that holds one selection of `budget_blocks`, the kept blocks and
  //! `slack_percent` of the budget for blocks evicted but likely reused
  //! (`disagg::remote_sequence`, which unpins a step's blocks before fetching the next).
  static constexpr admission with_slack(const kv_layout& layout, std::uint32_t budget_blocks,
                                        std::uint32_t slack_percent, std::uint32_t sink_blocks,
                                        std::uint32_t recent_blocks,
                                        std::uint64_t summary_bytes_per_block) noexcept {
    return {layout,
            std::uint64_t{budget_blocks} + std::uint64_t{budget_blocks} * slack_percent / 100 +
                min_budget_blocks(sink_blocks, recent_blocks),
            summary_bytes_per_block};
  }

  //! @brief Blocks of one (sequence, layer) of `blocks` blocks staged at once.
  constexpr std::uint64_t staged_blocks(std::uint64_t blocks) const noexcept {
    return std::min(blocks, staged_cap_);
  }

  //! @brief How many sequences of `seq_len` tokens `fast_bytes` of fast memory admit, dense
  //! (every block of every layer resident) and selective (the staged blocks and the summaries).
  constexpr admission_report report(std::uint64_t seq_len,
                                    std::uint64_t fast_bytes) const noexcept {
    admission_report r;
    const std::uint64_t blocks = layout_.blocks_for(seq_len);
    r.dense_bytes_per_sequence = blocks * layout_.num_layers * layout_.block_bytes();
    r.oasis_bytes_per_sequence =
        layout_.num_layers *
        (staged_blocks(blocks) * layout_.block_bytes() + blocks * summary_bytes_);
    r.dense_sequences = fast_bytes / std::max<std::uint64_t>(1, r.dense_bytes_per_sequence);
    r.oasis_sequences = fast_bytes / std::max<std::uint64_t>(1, r.oasis_bytes_per_sequence);
    return r;
  }

  //! @brief Appends to `out` the blocks staged when a layer of `window.blocks` blocks, the first
  //! `full` of them full, is admitted, ascending: every full block (`admission_mode::full`), or
  //! the full blocks among the kept ones (`selective`: the sinks and the recent window, which
  //! every step attends). A partial last block is left to the first append or step, which
  //! writes into it. O(blocks staged).
  static void initial_blocks(const block_window& window, std::uint32_t full, admission_mode mode,
                             std::vector<std::uint32_t>& out) {
    if (mode == admission_mode::full) {
      for (std::uint32_t b = 0; b < full; ++b) {
        out.push_back(b);
      }
      return;
    }
    for (std::uint32_t b = 0; b < std::min(window.sinks, full); ++b) {
      out.push_back(b);
    }
    for (std::uint32_t b = window.recent_from; b < full; ++b) {
      out.push_back(b);
    }
  }

 private:
  kv_layout layout_;
  std::uint64_t staged_cap_;
  std::uint64_t summary_bytes_;
};

}  // namespace oasiskv::cache
