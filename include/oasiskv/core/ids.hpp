// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Identifiers: slots of a tier's pool, sequences, and a block's place in a sequence.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace oasiskv {

//! @brief A block slot inside one tier's pool. Any layer's block fits any slot.
using slot_id = std::uint32_t;

//! @brief The slot id that no pool hands out.
inline constexpr slot_id null_slot = ~slot_id{0};

//! @brief A sequence (request) known to the cache. A distinct type so that it cannot be mixed up
//! with slot or block numbers.
enum class sequence_id : std::uint64_t {};

//! @brief One block of one layer of one sequence: the unit that is predicted, fetched and evicted.
struct block_key {
  sequence_id seq{};
  std::uint32_t layer = 0;
  std::uint32_t index = 0;  //!< tokens [index * tokens_per_block, (index + 1) * tokens_per_block)

  friend constexpr bool operator==(const block_key&, const block_key&) = default;
};

//! @brief A staged block as a kernel sees it: where it is, and which block of the sequence it is
//! (its position gives both the fill of a partial last block and the causal mask of the newest
//! tokens, so no separate count is stored).
struct block_ref {
  slot_id slot = null_slot;
  std::uint32_t index = 0;

  friend constexpr bool operator==(const block_ref&, const block_ref&) = default;
};

static_assert(sizeof(block_ref) == 8);

}  // namespace oasiskv

// A standard-library specialisation, not API: the reference leaves it out.
//! @cond
template <>
struct std::hash<oasiskv::block_key> {
  std::size_t operator()(const oasiskv::block_key& k) const noexcept {
    // splitmix64 finaliser over the packed fields: cheap and well mixed for hash maps.
    std::uint64_t x = static_cast<std::uint64_t>(k.seq) * 0x9e3779b97f4a7c15ull;
    x ^= (static_cast<std::uint64_t>(k.layer) << 32) | k.index;
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return static_cast<std::size_t>(x);
  }
};
//! @endcond
