// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cache::block_writer`: how `tiered_kv_cache` writes a sequence's tokens into the
//! capacity tier (copy-on-write for shared and read-only blocks, write-through to staged copies,
//! all-or-nothing appends) and takes in blocks that already lie there (adoption).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "oasiskv/allocator/refcounted_allocator.hpp"
#include "oasiskv/cache/layer_blocks.hpp"
#include "oasiskv/concepts/block_allocator.hpp"
#include "oasiskv/concepts/loadable_summary.hpp"
#include "oasiskv/concepts/prefetch_scheduler.hpp"
#include "oasiskv/concepts/tier_backend.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/ids.hpp"
#include "oasiskv/core/layout.hpp"
#include "oasiskv/core/selection.hpp"

namespace oasiskv::cache {

//! @brief The write and adoption paths of `tiered_kv_cache`, over the cache's tiers, scheduler,
//! capacity allocator and summary entries (which it references; the cache owns them and calls
//! under its lock).
//!
//! - `append`: all or nothing. Where a capacity-tier write fails or no capacity slot is left
//!   part-way, the error propagates and the layer holds exactly the tokens it held before, its
//!   new blocks released and the summary of its partial block recomputed.
//! - A block shared with a fork is copied for its writer first (copy-on-write); a block in the
//!   capacity tier's read-only slots (adopted from a prefill node) is copied to a slot the cache
//!   allocates.
//! - A staged copy of a block being written is written through, so attention never reads a
//!   stale copy: with `memcpy` where the fast tier is host memory, through its `write_slot` where
//!   the CPU must not address it (`slot_io_tier`: device memory), else by staging it again.
//!   Which path is chosen at compile time; a host fast tier pays nothing for the others.
//! - `adopt`: slots that already hold blocks are taken by the allocator and given summary
//!   entries, loaded from shipped bytes or computed from the blocks; on failure none is held.
//!
//! `StageFull`: every block is staged as soon as it fills (the dense baseline).
template <class Slow, class Fast, class Scheduler, class Allocator, class Entries, bool StageFull>
class block_writer {
 public:
  using slow_tier_type = Slow;
  using fast_tier_type = Fast;
  static constexpr bool has_summary = !std::is_same_v<typename Entries::summary_type, no_summary>;

  block_writer(const kv_layout& l, Slow& slow, Fast& fast, Scheduler& scheduler,
               refcounted_allocator<Allocator>& capacity, Entries& entries) noexcept
      : layout_(l),
        slow_(slow),
        fast_(fast),
        scheduler_(scheduler),
        capacity_(capacity),
        entries_(entries) {}

  //! @brief Where the capacity tier has read-only slots (`read_only_slot_tier`: a prefill
  //! node's memory), keeps them out of the allocator, so that only `adopt` hands them out, and
  //! copies a block in one before a write into it. Returns how many there are.
  std::uint32_t reserve_read_only_slots() {
    if constexpr (read_only_slot_tier<Slow>) {
      static_assert(claimable_allocator<Allocator>,
                    "oasiskv: a capacity tier with read-only slots needs an allocator with "
                    "take(slot) (free_list_allocator has it)");
      read_only_slots_ = slow_.read_only_slots();
      for (slot_id s = 0; s < read_only_slots_; ++s) {
        capacity_.reserve(s);
      }
    }
    return read_only_slots_;
  }

  //! @brief Appends `n` tokens (`k`, `v`: `[n][num_kv_heads][head_dim]` elements) to `ls`,
  //! writing through to its staged copies at once. All or nothing (see the class comment).
  void append(layer_blocks& ls, const std::byte* kb, const std::byte* vb, std::uint32_t n) {
    append_undo undo{ls.tokens, ls.blocks.size(), false, {}};
    try {
      append_rows(ls, kb, vb, n, undo);
    } catch (...) {
      undo_append(ls, undo);
      throw;
    }
  }

  //! @brief Appends `n` tokens to each of `lss` (distinct layers of distinct sequences): `k` and
  //! `v` are `[lss.size()][n][num_kv_heads][head_dim]`. All or nothing over the batch: should
  //! any part fail, every layer holds what it held before. Where the fast tier queues writes
  //! (`async_slot_io_tier`) and the capacity tier's slots are host memory (the sources stay put
  //! until the writes complete), the write-through of the whole batch is queued and completed
  //! once; every scheduler call that may evict or stage (a slot a queued write targets could be
  //! taken) completes the queued writes first.
  void append(std::span<layer_blocks* const> lss, const std::byte* kb, const std::byte* vb,
              std::uint32_t n) {
    const std::size_t bytes = std::size_t{n} * layout_.num_kv_heads * layout_.row_bytes();
    undos_.clear();
    undos_.reserve(lss.size());
    deferring_ = can_defer;
    try {
      for (std::size_t i = 0; i < lss.size(); ++i) {
        undos_.push_back({lss[i]->tokens, lss[i]->blocks.size(), false, {}});
        append_rows(*lss[i], kb + i * bytes, vb + i * bytes, n, undos_.back());
      }
      complete_writes();
    } catch (...) {
      deferring_ = false;
      try {
        complete_writes();  // a failed write drops the staged copies it may have left partial
      } catch (...) {
      }
      for (std::size_t i = undos_.size(); i-- > 0;) {
        undo_append(*lss[i], undos_[i]);
      }
      throw;
    }
    deferring_ = false;
  }

  //! @brief Takes `slots` (`[layers][blocks_for(tokens)]`, each layer's last block holding the
  //! rest of `tokens`) from the allocator and gives each a summary entry: loaded from
  //! `summaries` (`[layers][blocks][wire_bytes]`, a `loadable_summary`'s) when given, else
  //! computed from the blocks. Returns the blocks per layer. Errors, with nothing held:
  //! `errc::invalid_argument` for a slot count or summary size that does not match, and what
  //! the allocator raises for a slot in use or outside the tier; a failure while summarising
  //! returns every slot and entry.
  std::uint32_t adopt(std::uint32_t tokens, std::span<const slot_id> slots,
                      std::span<const std::byte> summaries) {
    const std::uint32_t blocks = layout_.blocks_for(tokens);
    const std::size_t total = std::size_t{layout_.num_layers} * blocks;
    if (slots.size() != total) [[unlikely]] {
      detail::raise(errc::invalid_argument, "adopt: ", slots.size(), " slots for ", tokens,
                    " tokens; expected ", layout_.num_layers, " layers x ", blocks,
                    " blocks = ", total);
    }
    bool load = false;
    if constexpr (loads_summaries) {
      if (!summaries.empty()) {
        const std::size_t want = total * entries_.summaries().wire_bytes();
        if (summaries.size() != want) [[unlikely]] {
          detail::raise(errc::invalid_argument, "adopt: ", summaries.size(), " summary bytes for ",
                        total, " blocks; expected ", total, " x ",
                        entries_.summaries().wire_bytes(), " = ", want);
        }
        load = true;
      }
    }
    entries_.reserve(slots.size());  // the only step that may allocate: before any slot is held
    std::size_t held = 0;
    try {
      for (; held < slots.size(); ++held) {
        capacity_.adopt(slots[held]);
        entries_.bind(slots[held], held % blocks == 0 ? null_slot : slots[held - 1], false);
      }
      if constexpr (has_summary) {
        summarize(tokens, blocks, slots, summaries, load);
      } else {
        (void)summaries, (void)load;
      }
    } catch (...) {
      for (std::size_t i = 0; i < held; ++i) {
        entries_.unbind(slots[i]);
        capacity_.deallocate(slots[i]);
      }
      throw;
    }
    return blocks;
  }

  //! @brief The bytes of capacity slot `s`: its memory, or read into `buffer` (one block).
  const std::byte* read(slot_id s, std::vector<std::byte>& buffer) const {
    if constexpr (host_accessible_tier<slow_tier_type>) {
      (void)buffer;
      return std::as_const(slow_).slot_data(s);
    } else {
      slow_.read_block(s, buffer.data());
      return buffer.data();
    }
  }

  //! @brief Cuts each of `lss` (distinct layers) to its first `tokens` tokens; a layer that
  //! holds no more is unchanged. The blocks past the new end are let go (the last holder of
  //! one drops its staged copy, after waiting for a prefetch in flight, and its summary entry;
  //! a fork's holders keep theirs). A new partial last block gets its summary recomputed from
  //! the tokens it keeps; where another holder shares it (a fork) or it lies in read-only
  //! memory, the layer first gets a private copy, so the other holders' block and summary stay
  //! as they were. All or nothing: the copies and reads come first, and should one fail
  //! (`errc::capacity_exceeded` with no slot left, or the capacity tier's error) every layer
  //! holds what it held before.
  void truncate(std::span<layer_blocks* const> lss, std::uint32_t tokens) {
    const std::uint32_t tpb = layout_.tokens_per_block;
    cuts_.clear();
    try {
      for (layer_blocks* ls : lss) {
        if (ls->tokens <= tokens) {
          continue;
        }
        cut c{ls, layout_.blocks_for(tokens), tokens % tpb, null_slot, {}};
        cuts_.push_back(std::move(c));
        cut& k = cuts_.back();
        if (k.filled == 0) {
          continue;  // the new last block is full: its summary already covers exactly it
        }
        const slot_id last = ls->blocks[k.keep - 1];
        if (capacity_.use_count(last) > 1) {
          const auto fresh = capacity_.allocate();
          if (!fresh) [[unlikely]] {
            detail::raise(errc::capacity_exceeded, "truncate: no capacity slot left to copy ",
                          "shared block ", k.keep - 1, " (slot ", last, ") for its holder");
          }
          k.fresh = *fresh;
          try {
            copy_capacity_block(last, *fresh, k.filled);  // summarises the kept tokens
          } catch (...) {
            entries_.unbind(*fresh);
            k.fresh = null_slot;
            capacity_.deallocate(*fresh);
            throw;
          }
        } else if constexpr (!host_accessible_tier<slow_tier_type>) {
          k.bytes.resize(layout_.block_bytes());  // the summary is recomputed from these below
          slow_.read_block(last, k.bytes.data());
        }
      }
    } catch (...) {
      for (const cut& k : cuts_) {
        if (k.fresh != null_slot) {
          entries_.unbind(k.fresh);
          capacity_.deallocate(k.fresh);
        }
      }
      throw;
    }
    // Nothing below fails: releasing a block only this layer holds waits for its prefetch (no
    // step pins it: calls for one sequence do not overlap), and summarising reads memory.
    for (cut& k : cuts_) {
      layer_blocks& ls = *k.ls;
      if (k.fresh != null_slot) {
        release_quietly(ls.blocks[k.keep - 1]);
        ls.blocks[k.keep - 1] = k.fresh;
      }
      while (ls.blocks.size() > k.keep) {
        const slot_id x = ls.blocks.back();
        ls.blocks.pop_back();
        release_quietly(x);
      }
      ls.tokens = tokens;
      ls.tail.clear();  // a block-I/O tier's next write reads the last block back
      if constexpr (has_summary) {
        if (k.filled != 0 && k.fresh == null_slot) {
          const slot_id last = ls.blocks.back();
          if constexpr (host_accessible_tier<slow_tier_type>) {
            entries_.resummarize(last, std::as_const(slow_).slot_data(last), k.filled);
          } else {
            entries_.resummarize(last, k.bytes.data(), k.filled);
          }
        }
      }
    }
    cuts_.clear();
  }

  //! @brief One more holder of every block of `ls` (a fork shares them).
  void share(const layer_blocks& ls) {
    for (const slot_id s : ls.blocks) {
      capacity_.retain(s);
    }
  }
  //! @brief Lets go of one holder of every block of `ls`.
  void release(const layer_blocks& ls) {
    for (const slot_id s : ls.blocks) {
      release(s);
    }
  }

  //! @brief Lets go of one holder of capacity slot `s`; the last one also drops its staged copy
  //! and summary entry.
  void release(slot_id s) {
    if (capacity_.use_count(s) == 1) {
      scheduler_.forget(s);
      entries_.unbind(s);
    }
    capacity_.deallocate(s);
  }

 private:
  // The CPU can put a block's bytes into a fast slot: directly, or through `write_slot`.
  static constexpr bool fast_writable =
      host_accessible_tier<fast_tier_type> || slot_io_tier<fast_tier_type>;

  static constexpr bool loads_summaries = [] {
    if constexpr (has_summary) {
      return loadable_summary<typename Entries::summary_type>;
    } else {
      return false;
    }
  }();

  // The summaries of adopted blocks: loaded from `summaries` (`load`), else computed from the
  // blocks, read in batches.
  void summarize(std::uint32_t tokens, std::uint32_t blocks, std::span<const slot_id> slots,
                 std::span<const std::byte> summaries, bool load) {
    const std::uint32_t tpb = layout_.tokens_per_block;
    auto filled = [&](std::size_t i) {
      const std::uint32_t b = static_cast<std::uint32_t>(i % blocks);
      return b + 1 < blocks ? tpb : tokens - b * tpb;
    };
    if constexpr (loads_summaries) {
      if (load) {
        const std::size_t wb = entries_.summaries().wire_bytes();
        for (std::size_t i = 0; i < slots.size(); ++i) {
          entries_.load(slots[i], summaries.subspan(i * wb, wb), filled(i));
        }
        return;
      }
    } else {
      (void)summaries, (void)load;
    }
    constexpr std::size_t chunk = 64;
    const std::size_t bb = layout_.block_bytes();
    std::vector<std::byte> buffer;
    std::vector<block_read> reads;
    for (std::size_t first = 0; first < slots.size(); first += chunk) {
      const std::size_t n = std::min(chunk, slots.size() - first);
      const std::byte* base = nullptr;
      if constexpr (!host_accessible_tier<slow_tier_type>) {
        buffer.resize(n * bb);
        reads.clear();
        for (std::size_t i = 0; i < n; ++i) {
          reads.push_back({slots[first + i], buffer.data() + i * bb});
        }
        if constexpr (batched_block_io_tier<slow_tier_type>) {
          slow_.read_blocks(reads);
        } else {
          for (const block_read& r : reads) {
            slow_.read_block(r.slot, r.out);
          }
        }
        base = buffer.data();
      }
      for (std::size_t i = 0; i < n; ++i) {
        const slot_id s = slots[first + i];
        const std::byte* block = nullptr;
        if constexpr (host_accessible_tier<slow_tier_type>) {
          block = std::as_const(slow_).slot_data(s);
        } else {
          block = base + i * bb;
        }
        entries_.update(s, block, 0, filled(first + i));  // `bind` emptied it
      }
    }
  }

  // The capacity slot of the block that token `offset` of the next append goes to, made
  // private (copy-on-write) if a fork shares it.
  slot_id writable_block(layer_blocks& ls, std::uint32_t offset) {
    if (offset == 0) {
      const auto s = capacity_.allocate();
      if (!s) [[unlikely]] {
        detail::raise(errc::capacity_exceeded, "append: the capacity tier's ", slow_.num_slots(),
                      " slots are all in use");
      }
      try {
        entries_.bind(*s, ls.blocks.empty() ? null_slot : ls.blocks.back());
        ls.blocks.push_back(*s);
      } catch (...) {
        entries_.unbind(*s);
        capacity_.deallocate(*s);
        throw;
      }
      if constexpr (block_io_tier<slow_tier_type> && !host_accessible_tier<slow_tier_type>) {
        ls.tail.assign(layout_.block_bytes(), std::byte{0});
      }
      return *s;
    }
    slot_id& current = ls.blocks.back();
    if (current < read_only_slots_) {
      // An adopted block in read-only memory (a prefill node's): its tokens and the new ones go
      // to a slot of the cache's own.
      const auto fresh = capacity_.allocate();
      if (!fresh) [[unlikely]] {
        detail::raise(errc::capacity_exceeded, "append: no capacity slot left to copy read-only ",
                      "block ", ls.blocks.size() - 1, " (slot ", current, ") for its writer");
      }
      try {
        copy_capacity_block(current, *fresh, offset);
      } catch (...) {
        entries_.unbind(*fresh);
        capacity_.deallocate(*fresh);
        throw;
      }
      release(current);
      current = *fresh;
      ls.tail.clear();  // re-read from the new slot by `write_rows`
      return current;
    }
    const auto cow = capacity_.prepare_write(current);
    if (!cow) [[unlikely]] {
      detail::raise(errc::capacity_exceeded, "append: no capacity slot left to copy shared block ",
                    ls.blocks.size() - 1, " for its writer");
    }
    if (cow->copied) {
      try {
        copy_capacity_block(current, cow->slot, offset);
      } catch (...) {
        // `prepare_write` let go of `current` for the new slot: take the reference back.
        capacity_.retain(current);
        entries_.unbind(cow->slot);
        capacity_.deallocate(cow->slot);
        throw;
      }
      current = cow->slot;
    }
    return current;
  }

  // Where a batched append queues its write-through (see `append`).
  static constexpr bool can_defer =
      async_slot_io_tier<Fast> && !host_accessible_tier<Fast> && host_accessible_tier<Slow>;

  // Writes the rows of one layer's append; on failure, `undo` says what to restore.
  template <class Undo>
  void append_rows(layer_blocks& ls, const std::byte* kb, const std::byte* vb, std::uint32_t n,
                   Undo& undo) {
    const std::size_t token_bytes = std::size_t{layout_.num_kv_heads} * layout_.row_bytes();
    for (std::uint32_t done = 0; done < n;) {
      const std::uint32_t offset = ls.tokens % layout_.tokens_per_block;
      const std::uint32_t count = std::min(n - done, layout_.tokens_per_block - offset);
      if constexpr (block_io_tier<slow_tier_type> && !host_accessible_tier<slow_tier_type>) {
        if (offset == 0 && undo.first_summarized && undo.tail.empty()) {
          undo.tail = std::move(ls.tail);  // the partial block's bytes, for the undo
        }
      }
      const slot_id slot = writable_block(ls, offset);
      if (offset == 0 && done + count == n) {
        stage_created(ls, slot);  // the block this append leaves as the sequence's last
      }
      write_rows(ls, slot, offset, count, kb + done * token_bytes, vb + done * token_bytes);
      undo.first_summarized = undo.first_summarized || offset != 0;
      if constexpr (StageFull) {
        if (offset + count == layout_.tokens_per_block) {
          complete_writes();  // the prefetch may evict a slot a queued write targets
          scheduler_.prefetch(std::span<const slot_id>(&slot, 1));  // full: stage it now
        }
      }
      ls.tokens += count;
      done += count;
    }
  }

  // Waits for the write-through queued by a batched append. Should a write fail, every staged
  // copy written since the last completion is dropped (it may hold partial bytes), then the
  // error propagates.
  void complete_writes() {
    if constexpr (can_defer) {
      if (pending_.empty()) {
        return;
      }
      try {
        fast_.complete_writes();
      } catch (...) {
        for (const slot_id s : pending_) {
          forget_quietly(s);
        }
        pending_.clear();
        throw;
      }
      pending_.clear();
    }
  }

  // Writes host bytes into a staged copy: queued during a batched append, else complete now.
  void write_staged(slot_id source, slot_id staged, std::size_t offset, const std::byte* in,
                    std::size_t n) {
    if constexpr (can_defer) {
      if (deferring_) {
        pending_.reserve(pending_.size() + 1);  // before queuing: the record cannot then fail
        fast_.write_slot_async(staged, offset, in, n);
        pending_.push_back(source);
        return;
      }
    }
    (void)source;
    fast_.write_slot(staged, offset, in, n);
  }

  // What `append` restores when it fails part-way: the token count, the blocks it had, and
  // whether the summary of its partial last block took rows that are now dropped (then, for a
  // block-I/O capacity tier, `tail` holds that block's bytes once a later block replaced them).
  struct append_undo {
    std::uint32_t tokens;
    std::size_t blocks;
    bool first_summarized = false;
    std::vector<std::byte> tail;
  };

  void undo_append(layer_blocks& ls, append_undo& undo) noexcept {
    while (ls.blocks.size() > undo.blocks) {
      const slot_id s = ls.blocks.back();
      ls.blocks.pop_back();
      try {
        release(s);
      } catch (...) {  // forget() waits for a transfer in flight and never finds a pin here
      }
    }
    ls.tokens = undo.tokens;
    const std::uint32_t filled = ls.tokens % layout_.tokens_per_block;
    if constexpr (block_io_tier<slow_tier_type> && !host_accessible_tier<slow_tier_type>) {
      if (!undo.tail.empty()) {
        ls.tail = std::move(undo.tail);
      } else if (filled == 0) {
        ls.tail.clear();  // the next append starts a block and sets it up
      }
    }
    if constexpr (has_summary) {
      if (undo.first_summarized && filled != 0) {
        // The partial block's entry folded in rows that are gone: summarise its tokens again.
        // Should the bytes not be readable now, the entry keeps them, which a bound-style
        // summary tolerates (its bounds only widen) and no attention reads.
        try {
          const slot_id s = ls.blocks.back();
          const std::byte* bytes = nullptr;
          std::vector<std::byte> buffer;
          if constexpr (host_accessible_tier<slow_tier_type>) {
            bytes = std::as_const(slow_).slot_data(s);
          } else if (ls.tail.size() == layout_.block_bytes()) {
            bytes = ls.tail.data();
          } else {
            buffer.resize(layout_.block_bytes());
            slow_.read_block(s, buffer.data());
            bytes = buffer.data();
          }
          entries_.resummarize(s, bytes, filled);
        } catch (...) {
        }
      }
    }
  }

  // `release` where nothing may fail: the slot is held and unpinned (see `truncate`), so
  // `forget` has nothing to refuse.
  void release_quietly(slot_id s) noexcept {
    try {
      release(s);
    } catch (...) {
    }
  }

  // Drops the staged copy of `slot` after a failed write into it. It is neither pinned (a block
  // being written belongs to one sequence, whose calls do not overlap) nor in flight (settled
  // before the write), so `forget` has nothing to refuse or wait for.
  void forget_quietly(slot_id slot) noexcept {
    try {
      scheduler_.forget(slot);
    } catch (...) {
    }
  }

  // Copies the first `filled` tokens' block from `from` into `to`, a slot just allocated (its
  // summary entry is bound here).
  void copy_capacity_block(slot_id from, slot_id to, std::uint32_t filled) {
    entries_.bind(to);
    scheduler_.settle(from);  // a staging copy may still read `from`; it stays valid (shared)
    const std::byte* src = nullptr;
    std::vector<std::byte> buffer;
    if constexpr (host_accessible_tier<slow_tier_type>) {
      src = std::as_const(slow_).slot_data(from);
      std::memcpy(slow_.slot_data(to), src, layout_.block_bytes());
    } else {
      buffer.resize(layout_.block_bytes());
      slow_.read_block(from, buffer.data());
      slow_.write_block(to, buffer.data());
      src = buffer.data();
    }
    if constexpr (has_summary) {
      entries_.update(to, src, 0, filled);
    }
  }

  // A block the cache has just created is staged from memory rather than fetched: a fast slot
  // gets its content (the capacity slot's bytes where the CPU reaches them, else the zeroed tail
  // buffer), and `write_rows` keeps it exact. Otherwise the first attention over every new block
  // would miss and read back from the capacity tier what the cache had just written there.
  // A fast tier the CPU must not address gets the block through `write_slot` (undone with the
  // rest of the append, which forgets the new block, should it fail).
  void stage_created(layer_blocks& ls, slot_id slot) {
    if constexpr (fast_writable && new_block_staging_scheduler<Scheduler>) {
      complete_writes();  // staging may evict a slot a queued write targets
      const auto f = scheduler_.stage_new(slot);
      if (!f) {
        return;  // no room: the step fetches it as before
      }
      const std::byte* bytes = nullptr;
      if constexpr (host_accessible_tier<slow_tier_type>) {
        bytes = std::as_const(slow_).slot_data(slot);
      } else {
        bytes = ls.tail.data();
      }
      if constexpr (host_accessible_tier<fast_tier_type>) {
        std::memcpy(fast_.slot_data(*f), bytes, layout_.block_bytes());
      } else {
        write_staged(slot, *f, 0, bytes, layout_.block_bytes());
      }
    } else {
      (void)ls, (void)slot;
    }
  }

  // Writes `count` tokens at `offset` of capacity slot `slot` (and of its staged copy).
  void write_rows(layer_blocks& ls, slot_id slot, std::uint32_t offset, std::uint32_t count,
                  const std::byte* k, const std::byte* v) {
    const auto staged = scheduler_.settle(slot);  // no copy may read the slot while we write
    const std::size_t row = layout_.row_bytes();
    auto scatter = [&](std::byte* block) {
      for (std::uint32_t t = 0; t < count; ++t) {
        for (std::uint32_t h = 0; h < layout_.num_kv_heads; ++h) {
          const std::size_t in = (std::size_t{t} * layout_.num_kv_heads + h) * row;
          const std::size_t at = (offset + t) * row;
          std::memcpy(block + layout_.key_offset(h) + at, k + in, row);
          std::memcpy(block + layout_.value_offset(h) + at, v + in, row);
        }
      }
    };
    const std::byte* block = nullptr;
    if constexpr (host_accessible_tier<slow_tier_type>) {
      scatter(slow_.slot_data(slot));
      block = std::as_const(slow_).slot_data(slot);
    } else {
      if (ls.tail.size() != layout_.block_bytes()) {  // a forked sequence's first write
        ls.tail.resize(layout_.block_bytes());
        slow_.read_block(slot, ls.tail.data());
      }
      scatter(ls.tail.data());
      slow_.write_block(slot, ls.tail.data());
      block = ls.tail.data();
    }
    if (staged) {
      if constexpr (host_accessible_tier<fast_tier_type>) {
        scatter(fast_.slot_data(*staged));  // write-through keeps the staged copy exact
      } else if constexpr (slot_io_tier<fast_tier_type>) {
        // One copy from the first new key row to the last new value row, taken from the capacity
        // copy: the bytes between them are rows the staged copy already holds equal (it is a
        // byte copy of the whole block, kept exact by every write), so one call replaces
        // 2 x num_kv_heads small ones. Should it fail, the staged copy is dropped, never left
        // stale.
        const std::size_t first = layout_.key_offset(0) + std::size_t{offset} * row;
        const std::size_t last =
            layout_.value_offset(layout_.num_kv_heads - 1) + std::size_t{offset + count} * row;
        try {
          write_staged(slot, *staged, first, block + first, last - first);
        } catch (...) {
          forget_quietly(slot);
          throw;
        }
      } else {
        // Device memory: stage the updated block again through the engine rather than write
        // rows the CPU cannot reach.
        scheduler_.forget(slot);
        scheduler_.prefetch(std::span<const slot_id>(&slot, 1));
      }
    }
    if constexpr (has_summary) {
      entries_.update(slot, block, offset, count);
    }
  }

  kv_layout layout_;
  Slow& slow_;
  Fast& fast_;
  Scheduler& scheduler_;
  refcounted_allocator<Allocator>& capacity_;
  Entries& entries_;
  std::uint32_t read_only_slots_ = 0;
  bool deferring_ = false;          // within `append`, where `can_defer`
  std::vector<slot_id> pending_;    // capacity slots whose staged copy has a queued write
  std::vector<append_undo> undos_;  // `append`'s, one per layer in the batch
  // One layer of a `truncate`: the blocks and tokens of the last block it keeps, the private
  // copy of that block where it had to be copied, and its bytes (block-I/O capacity tiers).
  struct cut {
    layer_blocks* ls;
    std::uint32_t keep;
    std::uint32_t filled;
    slot_id fresh;
    std::vector<std::byte> bytes;
  };
  std::vector<cut> cuts_;
};

}  // namespace oasiskv::cache
