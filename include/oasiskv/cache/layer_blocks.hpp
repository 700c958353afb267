// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cache::layer_blocks`: one (sequence, layer)'s KV in the capacity tier.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "oasiskv/core/ids.hpp"

namespace oasiskv::cache {

//! @brief One (sequence, layer)'s KV in the capacity tier: its tokens, the capacity slot of each
//! block, and, for a capacity tier the CPU cannot address (block I/O), the partial last block's
//! bytes, which appends update in memory and write whole.
struct layer_blocks {
  std::uint32_t tokens = 0;
  std::vector<slot_id> blocks;  // block index -> capacity slot
  std::vector<std::byte> tail;  // the partial block, for block-I/O capacity tiers
};

}  // namespace oasiskv::cache
