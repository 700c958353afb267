// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `kept_window`: the blocks every selection of a sequence keeps, whatever the scores say.
#pragma once

#include <cstdint>

#include "oasiskv/config.hpp"

namespace oasiskv {

//! @brief The always-kept blocks of a sequence of `blocks` blocks: the sinks `[0, sinks)` and the
//! recent window `[recent_from, blocks)`. The two never overlap; between them lie the
//! candidates `[sinks, recent_from)` that a predictor ranks.
struct block_window {
  std::uint32_t blocks = 0;       //!< the sequence's blocks
  std::uint32_t sinks = 0;        //!< blocks `[0, sinks)` are kept
  std::uint32_t recent_from = 0;  //!< blocks `[recent_from, blocks)` are kept

  //! @brief Blocks of the recent window.
  OASISKV_HOST_DEVICE constexpr std::uint32_t recent() const noexcept {
    return blocks - recent_from;
  }
  //! @brief Blocks kept: the sinks and the recent window.
  OASISKV_HOST_DEVICE constexpr std::uint32_t kept() const noexcept { return sinks + recent(); }
  //! @brief Blocks between the sinks and the recent window, which a predictor ranks.
  OASISKV_HOST_DEVICE constexpr std::uint32_t candidates() const noexcept {
    return recent_from - sinks;
  }
  //! @brief True for a sink or a block of the recent window.
  OASISKV_HOST_DEVICE constexpr bool keeps(std::uint32_t b) const noexcept {
    return b < sinks || (b >= recent_from && b < blocks);
  }
};

//! @brief The one rule for the kept blocks, shared by the predictors (CPU and CUDA), the facade,
//! admission and the remote sequence: the first `sink_blocks` (attention sinks) and the last
//! `max(recent_blocks, 1)` (the recent window; the last block holds the newest token, so it is
//! always kept, and it may be partial), both within the sequence, the sinks first. O(1).
OASISKV_HOST_DEVICE constexpr block_window kept_window(std::uint32_t blocks,
                                                       std::uint32_t sink_blocks,
                                                       std::uint32_t recent_blocks) noexcept {
  const std::uint32_t sinks = sink_blocks < blocks ? sink_blocks : blocks;
  const std::uint32_t want = recent_blocks > 1 ? recent_blocks : 1;
  const std::uint32_t recent = want < blocks - sinks ? want : blocks - sinks;
  return {blocks, sinks, blocks - recent};
}

//! @brief `kept_window` with the counts of any options or parameters struct that names them
//! (`selection_params`, `cache_options`, `disagg::admission_options`).
template <class Params>
requires requires(const Params& p) {
  std::uint32_t{p.sink_blocks};
  std::uint32_t{p.recent_blocks};
}
OASISKV_HOST_DEVICE constexpr block_window kept_window(std::uint32_t blocks,
                                                       const Params& p) noexcept {
  return kept_window(blocks, p.sink_blocks, p.recent_blocks);
}

//! @brief The least budget, in blocks, that holds the kept blocks of a long sequence:
//! `sink_blocks + max(recent_blocks, 1)`. A budget below it is refused wherever one is checked.
OASISKV_HOST_DEVICE constexpr std::uint64_t min_budget_blocks(
    std::uint32_t sink_blocks, std::uint32_t recent_blocks) noexcept {
  return std::uint64_t{sink_blocks} + (recent_blocks > 1 ? recent_blocks : 1);
}

}  // namespace oasiskv
