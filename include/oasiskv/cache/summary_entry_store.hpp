// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cache::summary_entry_store<Summary>`: the block summaries of `tiered_kv_cache` and
//! which summary entry each capacity slot in use has.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "oasiskv/concepts/block_summary.hpp"
#include "oasiskv/concepts/growable_summary.hpp"
#include "oasiskv/concepts/loadable_summary.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/ids.hpp"
#include "oasiskv/core/layout.hpp"
#include "oasiskv/core/selection.hpp"

namespace oasiskv::cache {

//! @brief The summary store of a cache whose capacity tier has `num_slots` slots, and the map
//! from each capacity slot in use to its summary entry.
//!
//! - A `growable_summary` (*compact*): entries go only to the slots in use and the store grows
//!   with them, from 64 entries up to one per slot. Entries are kept in runs: a layer's next
//!   block takes the entry after its previous block's when that one is free and in the same tile
//!   of `run` entries (the summary's tiles, `summary_tile_entries_v`: consecutive entries of a
//!   tile are scored in one pass over it, where a layer's entries interleaved with other layers'
//!   would cost a tile each). A new run starts on a whole free tile, else on a whole tile of the
//!   entries never handed out (growing the store by at least a quarter for it), else at the
//!   start of any free stretch.
//! - Any other summary: one entry per capacity slot, the slot itself.
//! - `no_summary`: nothing is stored (see the specialisation below).
//!
//! `bind` may allocate (only where the store grows) and then leaves the store as it was when it
//! throws; `unbind` never allocates and never throws. Not thread-safe: the cache calls it under
//! its lock.
template <class Summary>
class summary_entry_store {
 public:
  using summary_type = Summary;
  //! True for a `growable_summary`: entries only for the slots in use.
  static constexpr bool compact = growable_summary<Summary>;
  //! Entries per tile of the summary: the length of a run.
  static constexpr std::uint32_t run = summary_tile_entries_v<Summary>;
  //! The entry of a slot that has none.
  static constexpr std::uint32_t no_entry = ~std::uint32_t{0};
  //! Entries a compact store starts with.
  static constexpr std::uint32_t initial_entries = 64;

  summary_entry_store(const kv_layout& l, std::uint32_t num_slots)
      : summaries_(make(l, num_slots)), entry_of_(compact ? num_slots : 0, no_entry) {
    if constexpr (compact) {
      const std::size_t tiles = tiles_for(summaries_.capacity());
      free_entries_.reserve(summaries_.capacity());
      free_pos_.assign(summaries_.capacity(), no_entry);
      free_tiles_.reserve(tiles);
      tile_free_.assign(tiles, 0);
      tile_listed_.assign(tiles, 0);
    }
  }

  Summary& summaries() noexcept { return summaries_; }
  const Summary& summaries() const noexcept { return summaries_; }

  //! @brief The summary entry of capacity slot `s` (`no_entry` for a compact store's free slot).
  std::uint32_t entry(slot_id s) const noexcept {
    if constexpr (compact) {
      return entry_of_[s];
    } else {
      return s;
    }
  }

  //! @brief The entries of `slots`, in order: `slots` itself where entries are slots, else
  //! written to `scratch`.
  std::span<const std::uint32_t> entries_of(std::span<const slot_id> slots,
                                            std::vector<std::uint32_t>& scratch) const {
    if constexpr (compact) {
      scratch.resize(slots.size());
      for (std::size_t i = 0; i < slots.size(); ++i) {
        scratch[i] = entry_of_[slots[i]];
      }
      return scratch;
    } else {
      (void)scratch;
      return slots;
    }
  }

  //! @brief Folds the keys of tokens `[first, first + count)` of `block` (capacity slot `s`'s
  //! bytes) into `s`'s entry.
  void update(slot_id s, const std::byte* block, std::uint32_t first, std::uint32_t count) {
    summaries_.update(entry(s), block, first, count);
  }

  //! @brief Summarises the first `tokens` tokens of `block` into `s`'s entry afresh.
  void resummarize(slot_id s, const std::byte* block, std::uint32_t tokens) {
    summaries_.reset(entry(s));
    summaries_.update(entry(s), block, 0, tokens);
  }

  //! @brief Loads `s`'s entry from `bytes` computed where its block of `tokens` tokens was
  //! written (`loadable_summary`).
  void load(slot_id s, std::span<const std::byte> bytes,
            std::uint32_t tokens) requires loadable_summary<Summary> {
    summaries_.load(entry(s), bytes, tokens);
  }

  //! @brief Entries held by slots.
  std::size_t in_use() const noexcept {
    if constexpr (compact) {
      return entries_used_ - free_entries_.size();
    } else {
      return 0;
    }
  }

  //! @brief Bytes the store holds: its capacity in entries times a block's summary bytes.
  std::uint64_t bytes() const noexcept {
    return std::uint64_t{summaries_.capacity()} * summaries_.bytes_per_block();
  }

  //! @brief Makes room for `n` more entries than are in use, so that the next `n` binds do not
  //! allocate. May allocate (the store is rebuilt); on failure nothing changed.
  void reserve(std::size_t n) {
    if constexpr (compact) {
      if (in_use() + n > summaries_.capacity()) {
        grow(in_use() + n);
      }
    } else {
      (void)n;
    }
  }

  //! @brief Gives slot `s` (just allocated or adopted, without an entry) an empty entry.
  //! `after`: the slot of the block before `s`'s in the same (sequence, layer), or `null_slot`;
  //! its next entry is preferred. `may_grow`: the store may grow to start a run on a tile
  //! boundary (false after a `reserve` that must not be exceeded).
  void bind(slot_id s, slot_id after = null_slot, bool may_grow = true) {
    if constexpr (compact) {
      std::uint32_t e = no_entry;
      if (after != null_slot && entry_of_[after] != no_entry &&
          (entry_of_[after] + 1) % run != 0) {  // the next entry, in the same tile
        const std::uint32_t next = entry_of_[after] + 1;
        if (next < entries_used_ && free_pos_[next] != no_entry) {
          take_free(next);
          e = next;
        } else if (next == entries_used_ && next < summaries_.capacity()) {
          e = entries_used_++;
        }
      }
      while (e == no_entry && !free_tiles_.empty()) {  // a new run: a whole free tile
        const std::uint32_t t = free_tiles_.back();
        free_tiles_.pop_back();
        tile_listed_[t] = 0;
        if (tile_free_[t] == run) {
          e = t * run;
          take_free(e);
        }
      }
      if (e == no_entry) {  // or a whole tile of the entries never handed out
        const std::uint32_t aligned = (entries_used_ + run - 1) / run * run;
        if (may_grow && std::size_t{aligned} + run > summaries_.capacity()) {
          grow(std::size_t{aligned} + run);
        }
        if (std::size_t{aligned} + run <= summaries_.capacity()) {
          while (entries_used_ < aligned) {
            push_free(entries_used_++);
          }
          e = entries_used_++;
        }
      }
      if (e == no_entry && !free_entries_.empty()) {  // else the start of a free stretch
        e = free_entries_.back();
        while (e % run != 0 && free_pos_[e - 1] != no_entry) {
          --e;
        }
        take_free(e);
      }
      if (e == no_entry) {
        if (entries_used_ == summaries_.capacity()) {
          grow(std::size_t{entries_used_} + 1);
        }
        e = entries_used_++;
      }
      entry_of_[s] = e;
      summaries_.reset(e);
    } else {
      (void)after, (void)may_grow;
      summaries_.reset(s);
    }
  }

  //! @brief Returns the entry of slot `s` (its last holder let go); a no-op for a slot without
  //! one.
  void unbind(slot_id s) noexcept {
    if constexpr (compact) {
      if (entry_of_[s] != no_entry) {
        push_free(entry_of_[s]);
        entry_of_[s] = no_entry;
      }
    } else {
      (void)s;
    }
  }

  //! @brief Checks that exactly the slots with `holders(s) != 0` have an entry, each its own,
  //! and that the free lists and tile counts agree; raises `errc::invalid_argument` naming the
  //! first slot, entry or tile that does not. O(slots + entries).
  template <class Holders>
  void check(Holders&& holders) const {
    if constexpr (compact) {
      std::vector<std::uint8_t> seen(entries_used_, 0);
      for (slot_id s = 0; s < entry_of_.size(); ++s) {
        const std::uint32_t e = entry_of_[s];
        const auto count = holders(s);
        const bool held = count != 0;
        if (held != (e != no_entry) ||
            (held && (e >= entries_used_ || seen[e]++ != 0 || free_pos_[e] != no_entry)))
            [[unlikely]] {
          detail::raise(errc::invalid_argument, "audit: capacity slot ", s, " (", count,
                        " holders) has summary entry ",
                        e == no_entry ? std::string("none") : std::to_string(e),
                        held ? ", not its own" : " while free");
        }
      }
      for (std::size_t i = 0; i < free_entries_.size(); ++i) {
        const std::uint32_t e = free_entries_[i];
        if (e >= entries_used_ || seen[e]++ != 0 || free_pos_[e] != i) [[unlikely]] {
          detail::raise(errc::invalid_argument, "audit: free summary entry ", e,
                        " is in use or listed twice");
        }
      }
      std::vector<std::uint8_t> free_in_tile(tile_free_.size(), 0);
      for (const std::uint32_t e : free_entries_) {
        ++free_in_tile[e / run];
      }
      for (std::size_t t = 0; t < tile_free_.size(); ++t) {
        if (free_in_tile[t] != tile_free_[t] || (tile_free_[t] == run && tile_listed_[t] == 0))
            [[unlikely]] {
          detail::raise(errc::invalid_argument, "audit: summary tile ", t, " counts ",
                        unsigned{tile_free_[t]}, " free entries, holds ", unsigned{free_in_tile[t]},
                        tile_listed_[t] == 0 ? ", not listed" : "");
        }
      }
      if (static_cast<std::size_t>(std::count(seen.begin(), seen.end(), std::uint8_t{1})) !=
          entries_used_) [[unlikely]] {
        detail::raise(errc::invalid_argument, "audit: summary entries lost (", entries_used_,
                      " handed out)");
      }
    } else {
      (void)holders;
    }
  }

 private:
  static Summary make(const kv_layout& l, std::uint32_t n) {
    l.validate();
    if constexpr (compact) {
      return Summary(l, std::min(n, initial_entries));
    } else {
      return Summary(l, n);
    }
  }

  static std::size_t tiles_for(std::size_t entries) noexcept { return (entries + run - 1) / run; }

  // Grows the store to at least `n` entries and by at least a quarter, within one per slot.
  // Every container that `unbind` (noexcept) touches gets room for the new entries first; the
  // summary grows last, so a failure leaves the entries as they were.
  void grow(std::size_t n) {
    const std::size_t cap = summaries_.capacity();
    const std::size_t want = std::max(n, cap + std::max<std::size_t>(cap / 4, run));
    const auto grown = static_cast<std::uint32_t>(std::min<std::size_t>(want, entry_of_.size()));
    if (grown <= cap) {
      return;
    }
    const std::size_t tiles = tiles_for(grown);
    free_entries_.reserve(grown);
    free_tiles_.reserve(tiles);
    free_pos_.resize(grown, no_entry);
    tile_free_.resize(tiles, 0);
    tile_listed_.resize(tiles, 0);
    summaries_.grow(grown);
  }

  // The free entries: a list with each entry's position, so that any one leaves it in O(1).
  // Neither allocates: `free_entries_` has room for every entry, `free_pos_` one per entry.
  // A tile whose entries are all free goes on `free_tiles_` (once), where new runs start.
  void push_free(std::uint32_t e) noexcept {
    free_pos_[e] = static_cast<std::uint32_t>(free_entries_.size());
    free_entries_.push_back(e);
    const std::uint32_t t = e / run;
    if (++tile_free_[t] == run && tile_listed_[t] == 0) {
      tile_listed_[t] = 1;
      free_tiles_.push_back(t);  // fits: room for every tile
    }
  }
  void take_free(std::uint32_t e) noexcept {
    const std::uint32_t at = free_pos_[e], last = free_entries_.back();
    free_entries_[at] = last;
    free_pos_[last] = at;
    free_entries_.pop_back();
    free_pos_[e] = no_entry;
    --tile_free_[e / run];
  }

  Summary summaries_;
  std::vector<std::uint32_t> entry_of_;      // compact: capacity slot -> entry
  std::vector<std::uint32_t> free_entries_;  // compact: entries to reuse
  std::vector<std::uint32_t> free_pos_;      // compact: entry -> its place there
  std::vector<std::uint32_t> free_tiles_;    // compact: tiles once seen all free
  std::vector<std::uint8_t> tile_free_;      // compact: free entries per tile
  std::vector<std::uint8_t> tile_listed_;    // compact: tile is on free_tiles_
  std::uint32_t entries_used_ = 0;           // compact: entries ever handed out
};

//! @brief No summary: nothing is stored, every call is a no-op.
template <>
class summary_entry_store<no_summary> {
 public:
  using summary_type = no_summary;
  static constexpr bool compact = false;
  summary_entry_store(const kv_layout& l, std::uint32_t) { l.validate(); }
  std::uint32_t entry(slot_id s) const noexcept { return s; }
  std::span<const std::uint32_t> entries_of(std::span<const slot_id> slots,
                                            std::vector<std::uint32_t>&) const {
    return slots;
  }
  std::size_t in_use() const noexcept { return 0; }
  std::uint64_t bytes() const noexcept { return 0; }
  void reserve(std::size_t) noexcept {}
  void bind(slot_id, slot_id = null_slot, bool = true) noexcept {}
  void unbind(slot_id) noexcept {}
  template <class Holders>
  void check(Holders&&) const noexcept {}
};

}  // namespace oasiskv::cache
