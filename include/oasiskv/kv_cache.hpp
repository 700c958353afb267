// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `tiered_kv_cache<Policies>`: the facade an engine's decode loop calls.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <span>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "oasiskv/allocator/refcounted_allocator.hpp"
#include "oasiskv/concepts/block_summary.hpp"
#include "oasiskv/concepts/growable_summary.hpp"
#include "oasiskv/concepts/loadable_summary.hpp"
#include "oasiskv/concepts/policy_bundle.hpp"
#include "oasiskv/concepts/prefetch_scheduler.hpp"
#include "oasiskv/core/decode_params.hpp"
#include "oasiskv/core/selection.hpp"
#include "oasiskv/kv_cache_types.hpp"
#include "oasiskv/scheduler/staging_scheduler.hpp"

namespace oasiskv {

//! @brief Keeps the full KV cache of every sequence in a capacity tier and a budget of blocks
//! in a fast tier; predicts each step's blocks, stages them ahead, and runs sparse attention.
//!
//! The decode loop of an engine, per layer:
//! 1. `append(seq, layer, k, v, n)`: the new tokens' keys and values (the capacity tier gets
//!    them; a staged copy of the block is written through; the block summary is updated).
//! 2. `lookahead(seq, layer, queries)`: the drafted tokens' queries (or, without speculative
//!    decoding, the current one); the predictor selects the next step's blocks and the scheduler
//!    starts staging them. Returns at once.
//! 3. `attend(seqs, layer, q, q_len, out, lse)`: waits only for the blocks the step needs and
//!    runs the kernel over them.
//!
//! A sequence whose blocks already lie in the capacity tier (a prefill node's memory, a restored
//! prefix) enters through `adopt` instead of `add_sequence` + `append`. A capacity tier with
//! `read_only_slots()` (a `composite_tier` over a remote tier) keeps slots `[0, k)` out of the
//! allocator: they are only ever adopted, and a write into one (an append into an adopted
//! partial block) first copies the block to a slot the cache allocates.
//!
//! The transfer engine is constructed from the capacity tier when it has such a constructor (an
//! engine bound to the tier it reads: `routing_engine` over a `composite_tier`), otherwise
//! default-constructed.
//!
//! Thread safety: calls may come from several threads for *different* sequences; calls for one
//! sequence must not overlap. The kernel runs outside the cache's lock.
template <class Policies>
class tiered_kv_cache {
  static_assert(check_policy_bundle<Policies>);

 public:
  using allocator_type = typename Policies::allocator;
  using fast_tier_type = typename Policies::fast_tier;
  using slow_tier_type = typename Policies::slow_tier;
  using transfer_type = typename Policies::transfer;
  using predictor_type = typename Policies::predictor;
  using kernel_type = typename Policies::kernel;
  using summary_type = typename predictor_type::summary_type;
  static_assert(
      scheduler_policy<typename Policies::scheduler, fast_tier_type, slow_tier_type, transfer_type,
                       allocator_type>,
      "oasiskv: Policies::scheduler does not model oasiskv::scheduler_policy (a tag whose "
      "bind<fast_tier, slow_tier, transfer, allocator> models oasiskv::prefetch_scheduler)");
  using scheduler_type = typename Policies::scheduler::template bind<fast_tier_type, slow_tier_type,
                                                                     transfer_type, allocator_type>;
  static constexpr bool has_summary = !std::is_same_v<summary_type, no_summary>;
  //! True when `adopt` can take shipped summary bytes (else it reads the blocks to summarise
  //! them).
  static constexpr bool loads_summaries = [] {
    if constexpr (has_summary) {
      return loadable_summary<summary_type>;
    } else {
      return false;
    }
  }();
  //! True when summary entries go only to the capacity slots in use (`growable_summary`: the
  //! store grows with them), else one entry per capacity slot.
  static constexpr bool compact_summaries = [] {
    if constexpr (has_summary) {
      return growable_summary<summary_type>;
    } else {
      return false;
    }
  }();
  //! True for kernels that read device memory but accept tables built on the host
  //! (`decode_host_tables`): the cache's tables always are.
  static constexpr bool host_table_kernel = requires(kernel_type & k, const decode_params& dp) {
    k.decode_host_tables(dp);
  };
  //! True for the dense baseline (`all_resident`): every block is staged as soon as it fills.
  static constexpr bool stages_everything = [] {
    if constexpr (requires { scheduler_type::mode; }) {
      return scheduler_type::mode == prefetch_mode::all_resident;
    } else {
      return false;
    }
  }();

  //! @brief Takes ownership of both tiers (their layouts must agree). The fast tier's slots are
  //! the staging budget shared by every sequence and layer; `options.budget_tokens` is what one
  //! (sequence, layer) selects per step.
  tiered_kv_cache(slow_tier_type slow, fast_tier_type fast, cache_options options = {},
                  predictor_type predictor = {}, kernel_type kernel = {})
      : slow_(std::move(slow)),
        fast_(std::move(fast)),
        options_(options),
        layout_(slow_.layout()),
        capacity_(static_cast<std::size_t>(slow_.num_slots())),
        summaries_(make_summaries(layout_, slow_.num_slots())),
        entry_of_(compact_summaries ? slow_.num_slots() : 0, no_entry),
        predictor_(std::move(predictor)),
        kernel_(std::move(kernel)),
        engine_(make_engine(slow_)),
        scheduler_(fast_, slow_, engine_, {options.max_evictions_per_step}) {
    if (!(fast_.layout() == layout_)) [[unlikely]] {
      detail::raise(errc::layout_mismatch, "tiered_kv_cache: fast and slow tier layouts differ");
    }
    if constexpr (compact_summaries) {
      const std::size_t tiles = (std::size_t{summaries_.capacity()} + entry_run - 1) / entry_run;
      free_entries_.reserve(summaries_.capacity());
      free_pos_.assign(summaries_.capacity(), no_entry);
      free_tiles_.reserve(tiles);
      tile_free_.assign(tiles, 0);
      tile_listed_.assign(tiles, 0);
    }
    if constexpr (requires { slow_.read_only_slots(); }) {
      static_assert(
          requires(allocator_type & a, slot_id x) { a.take(x); },
          "oasiskv: a capacity tier with read-only slots needs an allocator with "
          "take(slot) (free_list_allocator has it)");
      read_only_slots_ = slow_.read_only_slots();
      for (slot_id s = 0; s < read_only_slots_; ++s) {
        capacity_.reserve(s);  // only `adopt` may hand these out
      }
    }
    const std::uint32_t budget = budget_blocks();
    if (options_.budget_tokens == 0 || budget < options_.sink_blocks + options_.recent_blocks)
        [[unlikely]] {
      detail::raise(errc::invalid_argument,
                    "tiered_kv_cache: budget_tokens = ", options_.budget_tokens, " (", budget,
                    " blocks) is smaller than sink_blocks + ",
                    "recent_blocks = ", options_.sink_blocks + options_.recent_blocks);
    }
    if (budget + 1 > fast_.num_slots()) [[unlikely]] {
      detail::raise(errc::invalid_argument, "tiered_kv_cache: the fast tier's ", fast_.num_slots(),
                    " slots cannot stage one selection of ", budget,
                    " blocks plus the block being appended to");
    }
  }

  const kv_layout& layout() const noexcept { return layout_; }
  const cache_options& options() const noexcept { return options_; }
  std::uint32_t budget_blocks() const noexcept {
    return layout_.blocks_for(options_.budget_tokens);
  }

  // -- sequences ------------------------------------------------------------------------------

  sequence_id add_sequence() {
    std::lock_guard lock(mutex_);
    const sequence_id id{next_sequence_++};
    sequences_.emplace(id, sequence_state(layout_.num_layers));
    return id;
  }

  //! @brief A new sequence sharing every block of `parent` (prefix sharing: no copy until one of
  //! them appends into the shared partial block, which is then copied for the writer).
  sequence_id fork(sequence_id parent) {
    std::lock_guard lock(mutex_);
    const sequence_state& p = find(parent, "fork");
    sequence_state child = p;
    for (auto& layer : child.layers) {
      layer.pending.reset();
      for (slot_id s : layer.blocks) {
        capacity_.retain(s);
      }
    }
    const sequence_id id{next_sequence_++};
    sequences_.emplace(id, std::move(child));
    return id;
  }

  //! @brief Adds a sequence of `tokens` tokens whose blocks already lie in the capacity tier.
  //! `slots` is `[num_layers][blocks_for(tokens)]` capacity slots, layer-major (block `b` of layer
  //! `l` at `l * blocks + b`); the last block of each layer holds the remaining tokens. Each slot
  //! must be free (or reserved: a read-only slot) and appear once; the cache then holds it like
  //! a slot it allocated (forks share it, `remove` lets it go).
  //!
  //! `summaries`, if not empty, is `[num_layers][blocks][summary_type::wire_bytes()]`: entries
  //! computed where the blocks were written (`loadable_summary`; for `minmax_summary`, the f16
  //! max/min of `disagg::summarize_block`). Without them, or for a summary that cannot load, the
  //! cache reads every adopted block to summarise it (a remote tier then reads the whole KV).
  //!
  //! The sink blocks and the full blocks of the recent window start staging now (selective
  //! admission); with the `all_resident` scheduler, every full block (dense admission).
  //! Errors, with nothing changed: `errc::invalid_argument` for a slot count or summary size
  //! that does not match, or a slot already in use (named); `errc::invalid_slot` for a slot
  //! outside the capacity tier; `errc::out_of_range` past `max_tokens_per_sequence`. O(blocks).
  sequence_id adopt(std::uint32_t tokens, std::span<const slot_id> slots,
                    std::span<const std::byte> summaries = {}) {
    static_assert(
        requires(allocator_type & a, slot_id x) { a.take(x); },
        "oasiskv: adopt needs an allocator with take(slot) (free_list_allocator has it)");
    std::lock_guard lock(mutex_);
    const std::uint32_t blocks = layout_.blocks_for(tokens);
    const std::size_t total = std::size_t{layout_.num_layers} * blocks;
    if (tokens > options_.max_tokens_per_sequence) [[unlikely]] {
      detail::raise(errc::out_of_range, "adopt: ", tokens,
                    " tokens pass max_tokens_per_sequence = ", options_.max_tokens_per_sequence);
    }
    if (slots.size() != total) [[unlikely]] {
      detail::raise(errc::invalid_argument, "adopt: ", slots.size(), " slots for ", tokens,
                    " tokens; expected ", layout_.num_layers, " layers x ", blocks,
                    " blocks = ", total);
    }
    bool load = false;
    if constexpr (loads_summaries) {
      if (!summaries.empty()) {
        const std::size_t want = total * summaries_.wire_bytes();
        if (summaries.size() != want) [[unlikely]] {
          detail::raise(errc::invalid_argument, "adopt: ", summaries.size(), " summary bytes for ",
                        total, " blocks; expected ", total, " x ", summaries_.wire_bytes(), " = ",
                        want);
        }
        load = true;
      }
    }
    reserve_entries(total);  // the only step that may allocate: before any slot is held
    std::size_t held = 0;
    try {
      for (; held < total; ++held) {
        capacity_.adopt(slots[held]);
        bind_entry(slots[held], held % blocks == 0 ? null_slot : slots[held - 1], false);
      }
      if constexpr (has_summary) {
        summarize_adopted(tokens, blocks, slots, summaries, load);
      }
    } catch (...) {
      for (std::size_t i = 0; i < held; ++i) {
        unbind_entry(slots[i]);
        capacity_.deallocate(slots[i]);
      }
      throw;
    }
    sequence_state st(layout_.num_layers);
    for (std::uint32_t l = 0; l < layout_.num_layers; ++l) {
      layer_state& ls = st.layers[l];
      ls.tokens = tokens;
      ls.blocks.assign(slots.begin() + static_cast<std::ptrdiff_t>(std::size_t{l} * blocks),
                       slots.begin() + static_cast<std::ptrdiff_t>(std::size_t{l + 1} * blocks));
    }
    // Stage now what every step attends to (the sinks and the full blocks of the recent
    // window), or, for the dense baseline, every full block. The partial last block is left to
    // the first append or attend: an append moves it first when it lies in read-only memory.
    sources_.clear();
    const std::uint32_t full = tokens / layout_.tokens_per_block;
    for (const layer_state& ls : st.layers) {
      if constexpr (stages_everything) {
        for (std::uint32_t b = 0; b < full; ++b) {
          sources_.push_back(ls.blocks[b]);
        }
      } else {
        const std::uint32_t sinks = std::min(options_.sink_blocks, full);
        const std::uint32_t recent_from =
            std::max(sinks, blocks > options_.recent_blocks ? blocks - options_.recent_blocks : 0);
        for (std::uint32_t b = 0; b < sinks; ++b) {
          sources_.push_back(ls.blocks[b]);
        }
        for (std::uint32_t b = recent_from; b < full; ++b) {
          sources_.push_back(ls.blocks[b]);
        }
      }
    }
    if (!sources_.empty()) {
      try {
        scheduler_.prefetch(sources_);
      } catch (...) {
        for (slot_id x : slots) {
          release_capacity_slot(x);
        }
        throw;
      }
    }
    const sequence_id id{next_sequence_++};
    sequences_.emplace(id, std::move(st));
    return id;
  }

  //! @brief Slots `[0, read_only_slots())` of the capacity tier are adopted only, never written.
  std::uint32_t read_only_slots() const noexcept { return read_only_slots_; }

  //! @brief Drops the sequence and returns the blocks only it held.
  void remove(sequence_id seq) {
    std::lock_guard lock(mutex_);
    sequence_state& st = find(seq, "remove");
    for (auto& layer : st.layers) {
      for (slot_id s : layer.blocks) {
        release_capacity_slot(s);
      }
    }
    sequences_.erase(seq);
  }

  //! @brief Tokens of `seq` in `layer`.
  std::uint32_t length(sequence_id seq, std::uint32_t layer = 0) const {
    std::lock_guard lock(mutex_);
    return find(seq, "length").layer(layer, layout_).tokens;
  }
  //! @brief The capacity-tier slot of each block of (seq, layer), in block order.
  std::vector<slot_id> block_slots(sequence_id seq, std::uint32_t layer) const {
    std::lock_guard lock(mutex_);
    return find(seq, "block_slots").layer(layer, layout_).blocks;
  }
  std::size_t num_sequences() const {
    std::lock_guard lock(mutex_);
    return sequences_.size();
  }

  //! @brief Blocks until the background work the cache started has finished: every prefetch in
  //! flight is staged (or, where its transfer failed, dropped, as `attend` would find it) and,
  //! where the capacity tier writes behind (`file_tier`), its writes have reached the device.
  //! Decode never needs it; a benchmark calls it so that one measurement's transfers do not run
  //! into the next one's clock, and an engine before it checkpoints or measures.
  void drain() {
    std::lock_guard lock(mutex_);
    if constexpr (requires { scheduler_.drain(); }) {
      scheduler_.drain();
    }
    if constexpr (requires { slow_.flush(); }) {
      slow_.flush();
    }
  }

  // -- the decode step --------------------------------------------------------------------------

  //! @brief Appends `n` tokens to `seq` in `layer`. `k` and `v` are `[n][num_kv_heads][head_dim]`
  //! elements of the layout's dtype (one token after another, as a layer computes them).
  //! All or nothing: where a capacity-tier write fails or no capacity slot is left part-way, the
  //! error propagates and (seq, layer) holds exactly the tokens it held before, its new blocks
  //! released.
  void append(sequence_id seq, std::uint32_t layer, const void* k, const void* v, std::uint32_t n) {
    std::lock_guard lock(mutex_);
    sequence_state& st = find(seq, "append");
    layer_state& ls = st.layer(layer, layout_);
    if (n == 0) {
      return;
    }
    if (k == nullptr || v == nullptr) [[unlikely]] {
      detail::raise(errc::invalid_argument, "append: null keys or values for sequence ",
                    static_cast<std::uint64_t>(seq));
    }
    if (std::uint64_t{ls.tokens} + n > options_.max_tokens_per_sequence) [[unlikely]] {
      detail::raise(
          errc::out_of_range, "append: ", n, " tokens to sequence ",
          static_cast<std::uint64_t>(seq), " layer ", layer, " (", ls.tokens,
          " tokens) would pass max_tokens_per_sequence = ", options_.max_tokens_per_sequence);
    }
    const std::size_t token_bytes = std::size_t{layout_.num_kv_heads} * layout_.row_bytes();
    const auto* kb = static_cast<const std::byte*>(k);
    const auto* vb = static_cast<const std::byte*>(v);
    append_undo undo{ls.tokens, ls.blocks.size(), false, {}};
    try {
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
        if constexpr (stages_everything) {
          if (offset + count == layout_.tokens_per_block) {
            scheduler_.prefetch(std::span<const slot_id>(&slot, 1));  // full: stage it now
          }
        }
        ls.tokens += count;
        done += count;
      }
    } catch (...) {
      undo_append(ls, undo);
      throw;
    }
  }

  //! @brief Predicts the blocks the next `attend` of (seq, layer) will need from the lookahead
  //! queries and starts staging them. A no-op for predictors that run at attention time.
  void lookahead(sequence_id seq, std::uint32_t layer, query_view queries) {
    if constexpr (predictor_type::timing == prediction_timing::lookahead) {
      std::lock_guard lock(mutex_);
      layer_state& ls = find(seq, "lookahead").layer(layer, layout_);
      check_queries(queries, "lookahead");
      if (ls.tokens == 0) [[unlikely]] {
        detail::raise(errc::invalid_argument, "lookahead: sequence ",
                      static_cast<std::uint64_t>(seq), " layer ", layer, " holds no tokens");
      }
      ls.pending.emplace();
      predict(ls, queries, *ls.pending);
      sources_.clear();
      collect_sources(ls, *ls.pending, sources_);
      scheduler_.prefetch(sources_);
      ++stats_.lookaheads;
    } else {
      (void)seq, (void)layer, (void)queries;
    }
  }

  //! @brief Attention of `q_len` new tokens per sequence in `layer` over the blocks selected for
  //! them. `q` is `[seqs][q_len][num_q_heads][head_dim]`; `out` likewise; `lse` is
  //! `[seqs][q_len][num_q_heads]` (may be null). The new tokens must already be appended.
  //! `attended`, where given, receives the blocks each sequence's tables read.
  void attend(std::span<const sequence_id> seqs, std::uint32_t layer, const float* q,
              std::uint32_t q_len, float* out, float* lse = nullptr,
              attended_blocks* attended = nullptr) {
    if (seqs.empty() || q == nullptr || out == nullptr) [[unlikely]] {
      detail::raise(errc::invalid_argument, "attend: no sequences, or null q or out");
    }
    const std::size_t rows = seqs.size() * std::size_t{q_len} * layout_.num_q_heads;
    step_scratch& sc = scratch_for_call();
    {
      std::lock_guard lock(mutex_);
      sc.refs.clear();
      sc.offsets.assign(1, 0);
      sc.lens.clear();
      sc.fast.clear();
      sc.tables_per_seq = 0;
      if (q_len == 0 || q_len > max_query_tokens) [[unlikely]] {
        detail::raise(errc::invalid_argument, "attend: q_len = ", q_len, " must be in [1, 16]");
      }
      try {
        for (std::size_t i = 0; i < seqs.size(); ++i) {
          layer_state& ls = find(seqs[i], "attend").layer(layer, layout_);
          if (ls.tokens < q_len) [[unlikely]] {
            detail::raise(errc::invalid_argument, "attend: sequence ",
                          static_cast<std::uint64_t>(seqs[i]), " layer ", layer, " holds ",
                          ls.tokens, " tokens, fewer than q_len = ", q_len);
          }
          const float* qs = q + i * std::size_t{q_len} * layout_.num_q_heads * layout_.head_dim;
          stage_sequence(ls, query_view{qs, nullptr, q_len}, sc);
          sc.lens.push_back(ls.tokens);
        }
        if (attended != nullptr) {
          attended->blocks.resize(sc.refs.size());
          for (std::size_t i = 0; i < sc.refs.size(); ++i) {
            attended->blocks[i] = sc.refs[i].index;
          }
          attended->offsets.assign(sc.offsets.begin(), sc.offsets.end());
          attended->tables_per_seq = sc.tables_per_seq;
        }
      } catch (...) {
        scheduler_.release(sc.fast);  // the pins of the sequences staged before the failure
        throw;
      }
    }
    if (lse == nullptr && !host_table_kernel) {
      sc.lse.resize(rows);
      lse = sc.lse.data();
    }
    decode_params p;
    p.q = q;
    p.pool = fast_.view();
    p.table = {sc.refs.data(), sc.offsets.data(), static_cast<std::uint32_t>(seqs.size()),
               sc.tables_per_seq};
    p.seq_lens = sc.lens.data();
    p.out = out;
    p.lse = lse;
    p.num_seqs = static_cast<std::uint32_t>(seqs.size());
    p.q_len = q_len;
    p.scale = options_.scale > 0.0f ? options_.scale
                                    : 1.0f / std::sqrt(static_cast<float>(layout_.head_dim));
    try {
      if constexpr (host_table_kernel) {
        kernel_.decode_host_tables(p);  // a device kernel: it uploads the host-built tables
      } else {
        kernel_.decode(p);
      }
    } catch (...) {
      std::lock_guard lock(mutex_);
      scheduler_.release(sc.fast);
      throw;
    }
    std::lock_guard lock(mutex_);
    scheduler_.release(sc.fast);
  }

  // -- observation ------------------------------------------------------------------------------

  cache_stats stats() const {
    std::lock_guard lock(mutex_);
    cache_stats s = stats_;
    const scheduler_stats& ss = scheduler_.stats();
    s.bytes_prefetched = ss.bytes_prefetched;
    s.bytes_evicted = ss.bytes_evicted;
    s.blocks_evicted = ss.blocks_evicted;
    s.failed_transfers = ss.failed_transfers;
    s.resident_blocks = scheduler_.resident_blocks();
    return s;
  }

  //! @brief How many sequences of `seq_len` tokens a fast tier of `fast_bytes` admits, dense
  //! (every block resident) vs OasisKV (a selection per layer, double-buffered for prefetch, plus
  //! the summaries).
  admission_report admission(std::uint64_t seq_len, std::uint64_t fast_bytes) const {
    admission_report r;
    const std::uint64_t blocks = layout_.blocks_for(seq_len);
    r.dense_bytes_per_sequence = blocks * layout_.num_layers * layout_.block_bytes();
    std::uint64_t summary_bytes = 0;
    if constexpr (has_summary) {
      summary_bytes = summaries_.bytes_per_block();
    }
    const std::uint64_t staged = std::min<std::uint64_t>(blocks, 2ull * budget_blocks());
    r.oasis_bytes_per_sequence =
        layout_.num_layers * (staged * layout_.block_bytes() + blocks * summary_bytes);
    r.dense_sequences = fast_bytes / std::max<std::uint64_t>(1, r.dense_bytes_per_sequence);
    r.oasis_sequences = fast_bytes / std::max<std::uint64_t>(1, r.oasis_bytes_per_sequence);
    return r;
  }

  //! @brief Bytes of the block-summary store: with `compact_summaries`, entries for the
  //! capacity slots in use (plus growth slack), else one entry per capacity slot.
  std::uint64_t summary_bytes() const {
    std::lock_guard lock(mutex_);
    if constexpr (has_summary) {
      return std::uint64_t{summaries_.capacity()} * summaries_.bytes_per_block();
    } else {
      return 0;
    }
  }

  //! @brief Checks every invariant: the scheduler's bookkeeping, residency within the fast tier,
  //! one summary entry per capacity slot in use, and every staged block byte-equal to the
  //! capacity tier's copy. Returns the blocks compared. O(everything): for tests and debugging.
  std::size_t audit() {
    std::lock_guard lock(mutex_);
    scheduler_.check_invariants();
    check_entries();
    if (scheduler_.resident_blocks() > fast_.num_slots()) [[unlikely]] {
      detail::raise(errc::capacity_exceeded, "audit: ", scheduler_.resident_blocks(),
                    " blocks resident in a fast tier of ", fast_.num_slots());
    }
    std::size_t compared = 0;
    std::vector<std::byte> buffer(layout_.block_bytes()), fast_buffer;
    for (auto& [id, st] : sequences_) {
      for (auto& ls : st.layers) {
        for (slot_id s : ls.blocks) {
          const auto f = scheduler_.settle(s);
          if (!f) {
            continue;
          }
          const std::byte* fast_bytes = nullptr;
          if constexpr (host_accessible_tier<fast_tier_type>) {
            fast_bytes = fast_.slot_data(*f);
          } else if constexpr (block_io_tier<fast_tier_type>) {
            fast_buffer.resize(layout_.block_bytes());
            fast_.read_block(*f, fast_buffer.data());
            fast_bytes = fast_buffer.data();
          } else {
            continue;  // bookkeeping only: the CPU cannot read this tier
          }
          const std::byte* slow_bytes = read_capacity(s, buffer);
          if (std::memcmp(fast_bytes, slow_bytes, layout_.block_bytes()) != 0) [[unlikely]] {
            detail::raise(errc::invalid_argument, "audit: staged copy of capacity slot ", s,
                          " (fast slot ", *f, ") differs from the capacity tier");
          }
          ++compared;
        }
      }
    }
    return compared;
  }

  const scheduler_type& scheduler() const noexcept { return scheduler_; }
  slow_tier_type& capacity_tier() noexcept { return slow_; }
  fast_tier_type& fast_tier() noexcept { return fast_; }

 private:
  struct layer_state {
    std::uint32_t tokens = 0;
    std::vector<slot_id> blocks;       // block index -> capacity slot
    std::optional<selection> pending;  // the last lookahead's selection
    std::vector<std::byte> tail;       // the partial block, for block-I/O capacity tiers
  };
  struct sequence_state {
    explicit sequence_state(std::uint32_t num_layers) : layers(num_layers) {}
    std::vector<layer_state> layers;
    layer_state& layer(std::uint32_t l, const kv_layout& layout) {
      check_layer(l, layout);
      return layers[l];
    }
    const layer_state& layer(std::uint32_t l, const kv_layout& layout) const {
      check_layer(l, layout);
      return layers[l];
    }
    static void check_layer(std::uint32_t l, const kv_layout& layout) {
      if (l >= layout.num_layers) [[unlikely]] {
        detail::raise(errc::out_of_range, "layer ", l, " is outside the model's ",
                      layout.num_layers, " layers");
      }
    }
  };
  struct step_scratch {
    std::vector<block_ref> refs;
    std::vector<std::uint32_t> offsets;
    std::vector<std::uint32_t> lens;
    std::vector<slot_id> fast;
    std::vector<slot_id> sources;
    std::vector<slot_id> staged;
    std::vector<float> lse;
    selection sel;
    std::uint32_t tables_per_seq = 0;
  };
  struct empty_summaries {};
  static constexpr std::uint32_t no_entry = ~std::uint32_t{0};
  static constexpr std::uint32_t initial_entries = 64;
  using summary_store = std::conditional_t<has_summary, summary_type, empty_summaries>;

  static transfer_type make_engine(slow_tier_type& slow) {
    if constexpr (std::is_constructible_v<transfer_type, slow_tier_type&>) {
      return transfer_type(slow);
    } else {
      (void)slow;
      return transfer_type();
    }
  }

  // The summaries of adopted blocks: loaded from `summaries` (`load`), else computed from the
  // blocks, read in batches.
  void summarize_adopted(std::uint32_t tokens, std::uint32_t blocks, std::span<const slot_id> slots,
                         std::span<const std::byte> summaries, bool load) {
    const std::uint32_t tpb = layout_.tokens_per_block;
    auto filled = [&](std::size_t i) {
      const std::uint32_t b = static_cast<std::uint32_t>(i % blocks);
      return b + 1 < blocks ? tpb : tokens - b * tpb;
    };
    if constexpr (loads_summaries) {
      if (load) {
        const std::size_t wb = summaries_.wire_bytes();
        for (std::size_t i = 0; i < slots.size(); ++i) {
          summaries_.load(entry(slots[i]), summaries.subspan(i * wb, wb), filled(i));
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
        summaries_.update(entry(s), block, 0, filled(first + i));  // bind_entry emptied it
      }
    }
  }

  static summary_store make_summaries(const kv_layout& l, std::uint32_t n) {
    l.validate();
    if constexpr (compact_summaries) {
      return summary_type(l, std::min(n, initial_entries));
    } else if constexpr (has_summary) {
      return summary_type(l, n);
    } else {
      return {};
    }
  }

  sequence_state& find(sequence_id seq, const char* what) {
    auto it = sequences_.find(seq);
    if (it == sequences_.end()) [[unlikely]] {
      detail::raise(errc::unknown_sequence, what, ": sequence ", static_cast<std::uint64_t>(seq),
                    " is not in the cache");
    }
    return it->second;
  }
  const sequence_state& find(sequence_id seq, const char* what) const {
    return const_cast<tiered_kv_cache*>(this)->find(seq, what);
  }

  void check_queries(const query_view& q, const char* what) const {
    if (q.data == nullptr || q.num_tokens == 0 || q.num_tokens > max_query_tokens) [[unlikely]] {
      detail::raise(errc::invalid_argument, what, ": queries must be 1 to 16 tokens of ",
                    layout_.num_q_heads, " x ", layout_.head_dim, " floats (got ", q.num_tokens,
                    " tokens", q.data == nullptr ? ", null data)" : ")");
    }
  }

  step_scratch& scratch_for_call() {
    // One scratch per calling thread: calls for different sequences may run concurrently.
    thread_local std::unordered_map<const void*, step_scratch> per_cache;
    return per_cache[this];
  }

  // The capacity slot of the block that token `offset` of the next append goes to, made
  // private (copy-on-write) if a fork shares it.
  slot_id writable_block(layer_state& ls, std::uint32_t offset) {
    if (offset == 0) {
      const auto s = capacity_.allocate();
      if (!s) [[unlikely]] {
        detail::raise(errc::capacity_exceeded, "append: the capacity tier's ", slow_.num_slots(),
                      " slots are all in use");
      }
      try {
        bind_entry(*s, ls.blocks.empty() ? null_slot : ls.blocks.back());
        ls.blocks.push_back(*s);
      } catch (...) {
        unbind_entry(*s);
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
        unbind_entry(*fresh);
        capacity_.deallocate(*fresh);
        throw;
      }
      release_capacity_slot(current);
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
        unbind_entry(cow->slot);
        capacity_.deallocate(cow->slot);
        throw;
      }
      current = cow->slot;
    }
    return current;
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

  void undo_append(layer_state& ls, append_undo& undo) noexcept {
    while (ls.blocks.size() > undo.blocks) {
      const slot_id s = ls.blocks.back();
      ls.blocks.pop_back();
      try {
        release_capacity_slot(s);
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
          summaries_.reset(entry(s));
          summaries_.update(entry(s), bytes, 0, filled);
        } catch (...) {
        }
      }
    }
  }

  // Copies the first `filled` tokens' block from `from` into `to`, a slot just allocated (its
  // summary entry is bound here).
  void copy_capacity_block(slot_id from, slot_id to, std::uint32_t filled) {
    bind_entry(to);
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
      summaries_.update(entry(to), src, 0, filled);
    }
  }

  // A block the cache has just created is staged from memory rather than fetched: a fast slot
  // gets its content (the capacity slot's bytes where the CPU reaches them, else the zeroed tail
  // buffer), and `write_rows` keeps it exact. Otherwise the first attention over every new block
  // would miss and read back from the capacity tier what the cache had just written there.
  void stage_created(layer_state& ls, slot_id slot) {
    if constexpr (host_accessible_tier<fast_tier_type> &&
                  requires { scheduler_.stage_new(slot); }) {
      const auto f = scheduler_.stage_new(slot);
      if (!f) {
        return;  // no room: the step fetches it as before
      }
      if constexpr (host_accessible_tier<slow_tier_type>) {
        std::memcpy(fast_.slot_data(*f), std::as_const(slow_).slot_data(slot),
                    layout_.block_bytes());
      } else {
        std::memcpy(fast_.slot_data(*f), ls.tail.data(), layout_.block_bytes());
      }
    } else {
      (void)ls, (void)slot;
    }
  }

  // Writes `count` tokens at `offset` of capacity slot `slot` (and of its staged copy).
  void write_rows(layer_state& ls, slot_id slot, std::uint32_t offset, std::uint32_t count,
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
      } else {
        // Device memory: stage the updated block again through the engine rather than write
        // rows the CPU cannot reach.
        scheduler_.forget(slot);
        scheduler_.prefetch(std::span<const slot_id>(&slot, 1));
      }
    }
    if constexpr (has_summary) {
      summaries_.update(entry(slot), block, offset, count);
    }
  }

  const std::byte* read_capacity(slot_id s, std::vector<std::byte>& buffer) const {
    if constexpr (host_accessible_tier<slow_tier_type>) {
      (void)buffer;
      return slow_.slot_data(s);
    } else {
      slow_.read_block(s, buffer.data());
      return buffer.data();
    }
  }

  void release_capacity_slot(slot_id s) {
    if (capacity_.use_count(s) == 1) {
      scheduler_.forget(s);
      unbind_entry(s);
    }
    capacity_.deallocate(s);
  }

  // -- summary entries --------------------------------------------------------------------------
  // With `compact_summaries`, `entry_of_[slot]` is the summary entry of each capacity slot in
  // use (`no_entry` otherwise). Entries are kept in runs: a layer's next block takes the entry
  // after its previous block's when that one is free and in the same tile of `entry_run` (the
  // summaries' tiles: consecutive entries in a tile are scored with one pass over the tile,
  // where a layer's entries interleaved with the other layers' would cost a tile each). A new
  // run starts on a whole free tile, else on a whole tile of the entries never handed out (the
  // store grows by at least a quarter for it, up to one entry per slot), else at the start of
  // any free stretch. Otherwise a slot's entry is the slot itself.

  static constexpr std::uint32_t entry_run = summary_tile_entries_v<summary_type>;

  std::uint32_t entry(slot_id s) const noexcept {
    if constexpr (compact_summaries) {
      return entry_of_[s];
    } else {
      return s;
    }
  }

  // Makes room for `n` more entries than are in use. May allocate (the store is rebuilt).
  void reserve_entries(std::size_t n) {
    if constexpr (compact_summaries) {
      const std::size_t in_use = entries_used_ - free_entries_.size();
      const std::size_t cap = summaries_.capacity();
      if (in_use + n <= cap) {
        return;
      }
      grow_entries(in_use + n);
    } else {
      (void)n;
    }
  }

  // Grows the store to at least `n` entries and by at least a quarter, within one per slot.
  void grow_entries(std::size_t n) {
    if constexpr (compact_summaries) {
      const std::size_t cap = summaries_.capacity();
      const std::size_t want = std::max(n, cap + std::max<std::size_t>(cap / 4, entry_run));
      const auto grown = static_cast<std::uint32_t>(std::min<std::size_t>(want, entry_of_.size()));
      if (grown <= cap) {
        return;
      }
      const std::size_t tiles = (std::size_t{grown} + entry_run - 1) / entry_run;
      // Every container that `unbind_entry` (noexcept) touches has room for the new entries.
      free_entries_.reserve(grown);
      free_tiles_.reserve(tiles);
      free_pos_.resize(grown, no_entry);
      tile_free_.resize(tiles, 0);
      tile_listed_.resize(tiles, 0);
      summaries_.grow(grown);
    } else {
      (void)n;
    }
  }

  void check_entries() const {
    if constexpr (compact_summaries) {
      std::vector<std::uint8_t> seen(entries_used_, 0);
      for (slot_id s = 0; s < entry_of_.size(); ++s) {
        const std::uint32_t e = entry_of_[s];
        const bool held = capacity_.use_count(s) != 0;
        if (held != (e != no_entry) ||
            (held && (e >= entries_used_ || seen[e]++ != 0 || free_pos_[e] != no_entry)))
            [[unlikely]] {
          detail::raise(errc::invalid_argument, "audit: capacity slot ", s, " (",
                        capacity_.use_count(s), " holders) has summary entry ",
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
        ++free_in_tile[e / entry_run];
      }
      for (std::size_t t = 0; t < tile_free_.size(); ++t) {
        if (free_in_tile[t] != tile_free_[t] ||
            (tile_free_[t] == entry_run && tile_listed_[t] == 0)) [[unlikely]] {
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
    }
  }

  // Gives slot `s` (just allocated or adopted) an empty entry. `after`: the slot of the block
  // before `s`'s in the same (sequence, layer), or `null_slot`. `may_grow`: the store may grow
  // to start a run on a tile boundary (not while adopting: `adopt` reserved what it needs).
  void bind_entry(slot_id s, slot_id after = null_slot, bool may_grow = true) {
    if constexpr (compact_summaries) {
      std::uint32_t e = no_entry;
      if (after != null_slot && entry_of_[after] != no_entry &&
          (entry_of_[after] + 1) % entry_run != 0) {  // the next entry, in the same tile
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
        if (tile_free_[t] == entry_run) {
          e = t * entry_run;
          take_free(e);
        }
      }
      if (e == no_entry) {  // or a whole tile of the entries never handed out
        const std::uint32_t aligned = (entries_used_ + entry_run - 1) / entry_run * entry_run;
        if (may_grow && std::size_t{aligned} + entry_run > summaries_.capacity()) {
          grow_entries(std::size_t{aligned} + entry_run);
        }
        if (std::size_t{aligned} + entry_run <= summaries_.capacity()) {
          while (entries_used_ < aligned) {
            push_free(entries_used_++);
          }
          e = entries_used_++;
        }
      }
      if (e == no_entry && !free_entries_.empty()) {  // else the start of a free stretch
        e = free_entries_.back();
        while (e % entry_run != 0 && free_pos_[e - 1] != no_entry) {
          --e;
        }
        take_free(e);
      }
      if (e == no_entry) {
        if (entries_used_ == summaries_.capacity()) {
          reserve_entries(1);
        }
        e = entries_used_++;
      }
      entry_of_[s] = e;
      summaries_.reset(e);
    } else if constexpr (has_summary) {
      (void)after, (void)may_grow;
      summaries_.reset(s);
    } else {
      (void)s, (void)after, (void)may_grow;
    }
  }

  // Returns the entry of slot `s` (its last holder let go); a no-op for a slot without one.
  void unbind_entry(slot_id s) noexcept {
    if constexpr (compact_summaries) {
      if (entry_of_[s] != no_entry) {
        push_free(entry_of_[s]);
        entry_of_[s] = no_entry;
      }
    } else {
      (void)s;
    }
  }

  // The free entries: a list with each entry's position, so that any one leaves it in O(1).
  // Neither allocates: `free_entries_` has room for every entry, `free_pos_` one per entry.
  // A tile whose entries are all free goes on `free_tiles_` (once), where new runs start.
  void push_free(std::uint32_t e) noexcept {
    free_pos_[e] = static_cast<std::uint32_t>(free_entries_.size());
    free_entries_.push_back(e);
    const std::uint32_t t = e / entry_run;
    if (++tile_free_[t] == entry_run && tile_listed_[t] == 0) {
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
    --tile_free_[e / entry_run];
  }

  void predict(const layer_state& ls, query_view queries, selection& out) {
    prediction_input<summary_type> in;
    in.layout = layout_;
    in.seq_len = ls.tokens;
    if constexpr (has_summary) {
      in.summaries = &summaries_;
    }
    if constexpr (compact_summaries) {
      summary_ids_.resize(ls.blocks.size());
      for (std::size_t i = 0; i < ls.blocks.size(); ++i) {
        summary_ids_[i] = entry_of_[ls.blocks[i]];
      }
      in.summary_ids = summary_ids_;
    } else {
      in.summary_ids = ls.blocks;
    }
    in.queries = queries;
    if constexpr (addressable_tier<slow_tier_type>) {
      in.keys = slow_.view();
      in.key_slots = ls.blocks;
    }
    const selection_params sp{budget_blocks(), options_.sink_blocks, options_.recent_blocks};
    const auto start = std::chrono::steady_clock::now();
    predictor_.select(in, sp, out);
    stats_.predict_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  // Unique capacity slots of the selection, plus the always-kept window of the current length.
  void collect_sources(const layer_state& ls, selection& sel, std::vector<slot_id>& out) {
    keep_window(ls, sel);
    for (std::uint32_t b : sel.blocks) {
      out.push_back(ls.blocks[b]);
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
  }

  // A lookahead made before the accepted tokens were appended may miss the newest blocks: the
  // sinks and the recent window of the current length are added to every table.
  void keep_window(const layer_state& ls, selection& sel) {
    const std::uint32_t n = static_cast<std::uint32_t>(ls.blocks.size());
    const std::uint32_t sinks = std::min(options_.sink_blocks, n);
    const std::uint32_t recent_from = n > options_.recent_blocks ? n - options_.recent_blocks : 0;
    std::vector<std::uint32_t> merged, offsets{0};
    for (std::uint32_t t = 0; t < sel.tables; ++t) {
      const auto table = sel.table(t);
      std::size_t start = merged.size();
      for (std::uint32_t b : table) {
        if (b < n) {
          merged.push_back(b);
        }
      }
      for (std::uint32_t b = 0; b < sinks; ++b) {
        merged.push_back(b);
      }
      for (std::uint32_t b = recent_from; b < n; ++b) {
        merged.push_back(b);
      }
      std::sort(merged.begin() + static_cast<std::ptrdiff_t>(start), merged.end());
      merged.erase(std::unique(merged.begin() + static_cast<std::ptrdiff_t>(start), merged.end()),
                   merged.end());
      offsets.push_back(static_cast<std::uint32_t>(merged.size()));
    }
    sel.blocks = std::move(merged);
    sel.offsets = std::move(offsets);
  }

  // Chooses the step's blocks for one sequence, stages them and appends its tables to `sc`.
  void stage_sequence(layer_state& ls, query_view q, step_scratch& sc) {
    selection* sel = nullptr;
    if (predictor_type::timing == prediction_timing::lookahead && ls.pending) {
      sel = &*ls.pending;
    } else {
      if (predictor_type::timing == prediction_timing::lookahead) {
        ++stats_.unpredicted;  // no lookahead for this step: predict from the current query
      }
      predict(ls, q, sc.sel);
      sel = &sc.sel;
    }
    sc.sources.clear();
    collect_sources(ls, *sel, sc.sources);
    sc.staged.resize(sc.sources.size());
    const acquire_stats st = scheduler_.acquire(sc.sources, sc.staged);
    stats_.step += st;
    ++stats_.sequence_steps;
    const std::uint32_t tables = sel->tables;
    if (sc.tables_per_seq != 0 && sc.tables_per_seq != tables) [[unlikely]] {
      detail::raise(errc::invalid_argument, "attend: sequences of one call selected with ",
                    "different granularities");
    }
    sc.tables_per_seq = tables;
    for (std::uint32_t t = 0; t < tables; ++t) {
      for (std::uint32_t b : sel->table(t)) {
        const slot_id src = ls.blocks[b];
        const auto it = std::lower_bound(sc.sources.begin(), sc.sources.end(), src);
        const slot_id fast = sc.staged[static_cast<std::size_t>(it - sc.sources.begin())];
        if (fast != null_slot) {
          sc.refs.push_back({fast, b});
        }
      }
      stats_.selected_blocks += sel->table(t).size();
      sc.offsets.push_back(static_cast<std::uint32_t>(sc.refs.size()));
    }
    sc.fast.insert(sc.fast.end(), sc.staged.begin(), sc.staged.end());
    ls.pending.reset();
  }

  mutable std::mutex mutex_;
  slow_tier_type slow_;
  fast_tier_type fast_;
  cache_options options_;
  kv_layout layout_;
  refcounted_allocator<allocator_type> capacity_;
  summary_store summaries_;
  std::vector<std::uint32_t> entry_of_;      // compact_summaries: capacity slot -> entry
  std::vector<std::uint32_t> free_entries_;  // compact_summaries: entries to reuse
  std::vector<std::uint32_t> free_pos_;      // compact_summaries: entry -> its place there
  std::vector<std::uint32_t> free_tiles_;    // compact_summaries: tiles once seen all free
  std::vector<std::uint8_t> tile_free_;      // compact_summaries: free entries per tile
  std::vector<std::uint8_t> tile_listed_;    // compact_summaries: tile is on free_tiles_
  std::uint32_t entries_used_ = 0;           // compact_summaries: entries ever handed out
  std::vector<std::uint32_t> summary_ids_;   // predict's scratch (under the mutex)
  predictor_type predictor_;
  kernel_type kernel_;
  transfer_type engine_;
  scheduler_type scheduler_;  // after the tiers and the engine it references
  std::unordered_map<sequence_id, sequence_state> sequences_;
  std::uint64_t next_sequence_ = 1;
  std::vector<slot_id> sources_;
  cache_stats stats_{};
  std::uint32_t read_only_slots_ = 0;
};

}  // namespace oasiskv
