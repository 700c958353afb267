// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cache::audit`: every invariant of a cache checked, and every staged copy compared
//! with the capacity tier's. For tests and debugging.
#pragma once

#include <cstddef>
#include <cstring>
#include <utility>
#include <vector>

#include "oasiskv/concepts/tier_backend.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/ids.hpp"

namespace oasiskv::cache {

//! @brief Checks the scheduler's bookkeeping, one summary entry per capacity slot in use (none
//! lost), residency within the fast tier, and that the staged copy of every block of every
//! layer `for_each_layer` visits is byte-equal to the capacity tier's (waiting for a copy in
//! flight first). A fast tier the CPU must not address (`slot_io_tier`) is read through
//! `read_slot`, a block-I/O one through `read_block`; one it can neither address nor read is
//! checked for its bookkeeping only. Raises `errc::invalid_argument` (a copy or an entry that
//! differs, naming the slot) or `errc::capacity_exceeded`; returns the blocks compared.
//! O(everything).
//! The parts are a cache's, under its lock: `writer` reads capacity slots (`read`), `entries`
//! holds each slot's summary entry, `capacity` counts each slot's holders (`use_count`).
template <class Scheduler, class Fast, class Writer, class Entries, class Capacity,
          class ForEachLayer>
std::size_t audit(Scheduler& scheduler, Fast& fast, const Writer& writer, const Entries& entries,
                  const Capacity& capacity, std::size_t block_bytes,
                  ForEachLayer&& for_each_layer) {
  struct {
    Scheduler& scheduler;
    Fast& fast;
    const Writer& writer;
    const Entries& entries;
    const Capacity& capacity;
  } parts{scheduler, fast, writer, entries, capacity};
  parts.scheduler.check_invariants();
  parts.entries.check([&](slot_id s) { return parts.capacity.use_count(s); });
  if (parts.scheduler.resident_blocks() > parts.fast.num_slots()) [[unlikely]] {
    detail::raise(errc::capacity_exceeded, "audit: ", parts.scheduler.resident_blocks(),
                  " blocks resident in a fast tier of ", parts.fast.num_slots());
  }
  std::size_t compared = 0;
  std::vector<std::byte> buffer(block_bytes), fast_buffer;
  for_each_layer([&](const auto& ls) {
    for (const slot_id s : ls.blocks) {
      const auto f = parts.scheduler.settle(s);
      if (!f) {
        continue;
      }
      const std::byte* fast_bytes = nullptr;
      if constexpr (host_accessible_tier<Fast>) {
        fast_bytes = std::as_const(parts.fast).slot_data(*f);
      } else if constexpr (slot_io_tier<Fast>) {
        fast_buffer.resize(block_bytes);  // device memory: copied out first
        std::as_const(parts.fast).read_slot(*f, 0, fast_buffer.data(), block_bytes);
        fast_bytes = fast_buffer.data();
      } else if constexpr (block_io_tier<Fast>) {
        fast_buffer.resize(block_bytes);
        parts.fast.read_block(*f, fast_buffer.data());
        fast_bytes = fast_buffer.data();
      } else {
        continue;  // bookkeeping only: the CPU cannot read this tier
      }
      const std::byte* slow_bytes = parts.writer.read(s, buffer);
      if (std::memcmp(fast_bytes, slow_bytes, block_bytes) != 0) [[unlikely]] {
        detail::raise(errc::invalid_argument, "audit: staged copy of capacity slot ", s,
                      " (fast slot ", *f, ") differs from the capacity tier");
      }
      ++compared;
    }
  });
  return compared;
}

}  // namespace oasiskv::cache
