// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `tiered_kv_cache<Policies>`: the facade an engine's decode loop calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include "oasiskv/cache/admission.hpp"
#include "oasiskv/cache/audit.hpp"
#include "oasiskv/cache/block_writer.hpp"
#include "oasiskv/cache/bundle_traits.hpp"
#include "oasiskv/cache/options.hpp"
#include "oasiskv/cache/sequence_table.hpp"
#include "oasiskv/cache/step_planner.hpp"
#include "oasiskv/cache/step_predictor.hpp"
#include "oasiskv/cache/summary_entry_store.hpp"
#include "oasiskv/concepts/sparse_attention_kernel.hpp"
#include "oasiskv/kv_cache_types.hpp"

namespace oasiskv {

//! @brief Keeps the full KV cache of every sequence in a capacity tier and a budget of blocks
//! in a fast tier; predicts each step's blocks, stages them ahead, and runs sparse attention.
//!
//! An engine's decode loop, per layer: `append` the new tokens' K and V; `lookahead` with the
//! drafted tokens' queries (the next step's blocks are predicted and start staging; it returns
//! at once); `attend` (waits only for the step's blocks, runs the kernel). `adopt` takes in a
//! sequence already in the capacity tier. The class holds the lock, the sequences and the
//! policies, and delegates to the parts in `cache/` (docs/architecture.md).
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
  using scheduler_type = typename cache::bound_scheduler<Policies>::type;
  // The optional paths the policies take (cache/bundle_traits.hpp): shipped summaries, a
  // summary store only for the slots in use, tables uploaded by a device kernel, dense staging.
  static constexpr bool has_summary = cache::has_summary_v<summary_type>;
  static constexpr bool loads_summaries = cache::loads_summaries_v<summary_type>;
  static constexpr bool compact_summaries = cache::compact_summaries_v<summary_type>;
  static constexpr bool host_table_kernel = oasiskv::host_table_kernel<kernel_type>;
  static constexpr bool stages_everything = cache::stages_everything_v<scheduler_type>;
  static constexpr bool predicts_ahead = predictor_type::timing == prediction_timing::lookahead;

  //! @brief Takes ownership of both tiers (their layouts must agree). The fast tier's slots are
  //! the staging budget shared by every sequence and layer; `options.budget_tokens` is what one
  //! (sequence, layer) selects per step. Bad options raise (`cache::check_options`).
  tiered_kv_cache(slow_tier_type slow, fast_tier_type fast, cache_options options = {},
                  predictor_type predictor = {}, kernel_type kernel = {})
      : slow_(std::move(slow)),
        fast_(std::move(fast)),
        options_(options),
        limits_(cache::check_options(options, slow_.layout(), fast_.layout(), fast_.num_slots())),
        layout_(slow_.layout()),
        capacity_(static_cast<std::size_t>(slow_.num_slots())),
        entries_(layout_, slow_.num_slots()),
        predictor_(std::move(predictor), entries_, slow_),
        kernel_(std::move(kernel)),
        engine_(cache::make_engine<transfer_type>(slow_)),
        scheduler_(fast_, slow_, engine_, {options.max_evictions_per_step}),
        writer_(layout_, slow_, fast_, scheduler_, capacity_, entries_),
        planner_(scheduler_),
        sequences_(layout_.num_layers) {
    read_only_slots_ = writer_.reserve_read_only_slots();
  }

  const kv_layout& layout() const noexcept { return layout_; }
  const cache_options& options() const noexcept { return options_; }
  std::uint32_t budget_blocks() const noexcept { return limits_.budget_blocks; }

  // -- sequences ------------------------------------------------------------------------------

  sequence_id add_sequence() {
    std::lock_guard lock(mutex_);
    return sequences_.insert_empty();
  }

  //! @brief A new sequence sharing every block of `parent` (prefix sharing: the shared partial
  //! block is copied only when one of them appends to it).
  sequence_id fork(sequence_id parent) {
    std::lock_guard lock(mutex_);
    std::vector<cache::layer_state> child = sequences_.layers(parent, "fork");
    for (auto& layer : child) {
      layer.pending.reset();
      writer_.share(layer);
    }
    return sequences_.insert(std::move(child));
  }

  //! @brief `fork` of the first `tokens` tokens of `parent` (llama.cpp's `seq_cp` of a prefix).
  sequence_id fork(sequence_id parent, std::uint32_t tokens) {
    const sequence_id child = fork(parent);
    try {
      truncate(child, tokens);
    } catch (...) {
      remove(child);
      throw;
    }
    return child;
  }

  //! @brief Drops every token of `seq` past its first `tokens`, in every layer that holds more
  //! (rejected drafts; a cached prompt cut to the prefix the next request shares). Blocks past
  //! the end are let go (staged copies dropped, prefetches in flight waited for), a new
  //! partial block is summarised again, a fork's shared blocks stay as they are for it; a
  //! pending lookahead's selection is kept. All or nothing (`cache::block_writer::truncate`).
  void truncate(sequence_id seq, std::uint32_t tokens) {
    std::lock_guard lock(mutex_);
    sequences_.gather(seq, "truncate", blocks_);
    writer_.truncate(blocks_, tokens);
  }

  //! @brief Adds a sequence of `tokens` tokens whose blocks already lie in the capacity tier:
  //! `slots` is `[num_layers][blocks_for(tokens)]`, each free (or read-only) and named once;
  //! `summaries` the `loadable_summary` entries shipped with them, if any (else the blocks are
  //! read). The kept blocks start staging (`all_resident`: every full block). Errors change
  //! nothing (`cache::block_writer::adopt`; `errc::out_of_range` past `max_tokens_per_sequence`).
  sequence_id adopt(std::uint32_t tokens, std::span<const slot_id> slots,
                    std::span<const std::byte> summaries = {}) {
    static_assert(claimable_allocator<allocator_type>,
                  "oasiskv: adopt needs an allocator with take(slot) (free_list_allocator has it)");
    std::lock_guard lock(mutex_);
    if (tokens > options_.max_tokens_per_sequence) [[unlikely]] {
      detail::raise(errc::out_of_range, "adopt: ", tokens,
                    " tokens pass max_tokens_per_sequence = ", options_.max_tokens_per_sequence);
    }
    const std::uint32_t blocks = writer_.adopt(tokens, slots, summaries);
    try {
      std::vector<cache::layer_state> layers = sequences_.adopted(tokens, slots, blocks);
      for (const cache::layer_state& ls : layers) {
        planner_.admit(ls.blocks, limits_.window(blocks), tokens / layout_.tokens_per_block,
                       stages_everything ? admission_mode::full : admission_mode::selective);
      }
      return sequences_.insert(std::move(layers));
    } catch (...) {
      for (slot_id x : slots) {
        writer_.release(x);
      }
      throw;
    }
  }

  //! @brief Slots `[0, read_only_slots())` of the capacity tier are adopted only, never written.
  std::uint32_t read_only_slots() const noexcept { return read_only_slots_; }

  //! @brief Drops the sequence and returns the blocks only it held.
  void remove(sequence_id seq) {
    std::lock_guard lock(mutex_);
    for (const auto& layer : sequences_.layers(seq, "remove")) {
      writer_.release(layer);
    }
    sequences_.erase(seq);
  }

  //! @brief Tokens of `seq` in `layer`.
  std::uint32_t length(sequence_id seq, std::uint32_t layer = 0) const {
    std::lock_guard lock(mutex_);
    return sequences_.at(seq, layer, "length").tokens;
  }
  //! @brief The capacity-tier slot of each block of (seq, layer), in block order.
  std::vector<slot_id> block_slots(sequence_id seq, std::uint32_t layer) const {
    std::lock_guard lock(mutex_);
    return sequences_.at(seq, layer, "block_slots").blocks;
  }
  std::size_t num_sequences() const {
    std::lock_guard lock(mutex_);
    return sequences_.size();
  }

  //! @brief Waits for the background work the cache started: prefetches in flight are staged
  //! (or dropped where they failed), a write-behind capacity tier's writes reach the device.
  void drain() {
    std::lock_guard lock(mutex_);
    if constexpr (drainable_scheduler<scheduler_type>) {
      scheduler_.drain();
    }
    if constexpr (flushable_tier<slow_tier_type>) {
      slow_.flush();
    }
  }

  // -- the decode step --------------------------------------------------------------------------

  //! @brief Appends `n` tokens to `seq` in `layer`: `k`, `v` are `[n][num_kv_heads][head_dim]`
  //! elements of the layout's dtype. All or nothing: on a failed write or a full capacity tier
  //! (seq, layer) holds the tokens it held before.
  void append(sequence_id seq, std::uint32_t layer, const void* k, const void* v, std::uint32_t n) {
    append(std::span<const sequence_id>(&seq, 1), layer, k, v, n);
  }

  //! @brief `append` of `n` tokens to each of `seqs` in one layer: `k`, `v` are
  //! `[seqs][n][num_kv_heads][head_dim]`. All or nothing over the batch: every sequence is
  //! checked (unknown, repeated, past `max_tokens_per_sequence`) before any is written. A fast
  //! tier that queues writes (`async_slot_io_tier`) is waited for once per batch.
  void append(std::span<const sequence_id> seqs, std::uint32_t layer, const void* k, const void* v,
              std::uint32_t n) {
    std::lock_guard lock(mutex_);
    sequences_.gather(seqs, layer, "append", batch_);
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      limits_.check_room(batch_[i]->tokens, n, "append", seqs[i], layer);
    }
    if (n == 0 || seqs.empty()) {
      return;
    }
    if (k == nullptr || v == nullptr) [[unlikely]] {
      detail::raise(errc::invalid_argument, "append: null keys or values for ",
                    seqs.size() == 1 ? "sequence " : "",
                    seqs.size() == 1 ? static_cast<std::uint64_t>(seqs[0]) : seqs.size(),
                    seqs.size() == 1 ? "" : " sequences");
    }
    const auto *kb = static_cast<const std::byte*>(k), *vb = static_cast<const std::byte*>(v);
    blocks_.assign(batch_.begin(), batch_.end());
    seqs.size() == 1 ? writer_.append(*blocks_[0], kb, vb, n)  // written through at once
                     : writer_.append(blocks_, kb, vb, n);     // a queued write-through: once
  }

  //! @brief Predicts the blocks the next `attend` of (seq, layer) needs from the lookahead
  //! queries and starts staging them; returns at once. A no-op for at-attention predictors.
  void lookahead(sequence_id seq, std::uint32_t layer, query_view queries) {
    if constexpr (!predicts_ahead) {
      return;
    }
    std::lock_guard lock(mutex_);
    cache::layer_state& ls = sequences_.at(seq, layer, "lookahead");
    cache::check_lookahead(layout_, queries, ls.tokens, seq, layer);
    ls.pending.emplace();
    predictor_.select(ls, queries, limits_.selection(), *ls.pending);
    planner_.prefetch(ls.blocks, window_of(ls), *ls.pending);
    ++stats_.lookaheads;
  }

  //! @brief `lookahead` for several sequences in one layer: `q` is
  //! `[seqs][q_len][num_q_heads][head_dim]`. A predictor with `select_many` scores the whole
  //! batch in one parallel loop. The selections equal one `lookahead` per sequence; every check
  //! and prediction is made before any is kept, so on an error no pending selection changes.
  void lookahead(std::span<const sequence_id> seqs, std::uint32_t layer, const float* q,
                 std::uint32_t q_len) {
    if constexpr (!predicts_ahead) {
      return;
    }
    if (seqs.empty() || q == nullptr) [[unlikely]] {
      detail::raise(errc::invalid_argument, "lookahead: no sequences, or null queries");
    }
    const std::size_t stride = std::size_t{q_len} * layout_.num_q_heads * layout_.head_dim;
    std::lock_guard lock(mutex_);
    sequences_.gather(seqs, layer, "lookahead", batch_);
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      cache::check_lookahead(layout_, query_view{q + i * stride, nullptr, q_len}, batch_[i]->tokens,
                             seqs[i], layer);
    }
    predictor_.select_ahead(batch_, q, stride, q_len, limits_.selection());
    for (cache::layer_state* ls : batch_) {
      planner_.prefetch(ls->blocks, window_of(*ls), *ls->pending);
      ++stats_.lookaheads;
    }
  }

  //! @brief Attention of `q_len` new tokens per sequence in `layer` over the blocks selected for
  //! them: `q`, `out` are `[seqs][q_len][num_q_heads][head_dim]`, `lse`
  //! `[seqs][q_len][num_q_heads]` (may be null); the new tokens must already be appended. The
  //! selection is the lookahead's, or made now (counted as `unpredicted`), with the kept window of
  //! the current length added. `attended`, where given, receives the blocks each table read. With a
  //! device kernel
  //! (`host_table_kernel`) `q`, `out`, `lse` are device memory and every sequence's selection
  //! must come from `lookahead` (docs/cuda.md).
  void attend(std::span<const sequence_id> seqs, std::uint32_t layer, const float* q,
              std::uint32_t q_len, float* out, float* lse = nullptr,
              attended_blocks* attended = nullptr) {
    if (seqs.empty() || q == nullptr || out == nullptr) [[unlikely]] {
      detail::raise(errc::invalid_argument, "attend: no sequences, or null q or out");
    }
    if (q_len == 0 || q_len > max_query_tokens) [[unlikely]] {
      detail::raise(errc::invalid_argument, "attend: q_len = ", q_len, " must be in [1, 16]");
    }
    auto plan = [&] {
      std::lock_guard lock(mutex_);
      return planner_.build([&](cache::step_plan& p) {
        for (std::size_t i = 0; i < seqs.size(); ++i) {
          cache::layer_state& ls = sequences_.at(seqs[i], layer, "attend");
          cache::check_step(ls.tokens, predicts_ahead && ls.pending, host_table_kernel, q_len,
                            seqs[i], layer);
          const float* qs = q + i * std::size_t{q_len} * layout_.num_q_heads * layout_.head_dim;
          selection& sel = predictor_.for_step(ls, {qs, nullptr, q_len}, limits_.selection(),
                                               p.predicted, stats_.unpredicted);
          planner_.add(p, ls, window_of(ls), sel, stats_);
          ls.pending.reset();
        }
        if (attended != nullptr) {
          planner_.describe(p, *attended);
        }
      });
    }();
    planner_.run(std::move(plan), mutex_, [&](cache::step_plan& p) {
      if (lse == nullptr && !host_table_kernel) {
        p.lse.resize(seqs.size() * std::size_t{q_len} * layout_.num_q_heads);
        lse = p.lse.data();
      }
      const decode_params params{q,   fast_.view(),  p.table(), p.lens.data(), out,
                                 lse, p.sequences(), q_len,     limits_.scale};
      if constexpr (host_table_kernel) {
        kernel_.decode_host_tables(params);  // a device kernel: it uploads the host-built tables
      } else {
        kernel_.decode(params);
      }
    });
  }

  // -- observation ------------------------------------------------------------------------------

  //! @brief The predictor, for its settings (e.g. `set_thread_pool`): change them between steps.
  predictor_type& predictor() noexcept { return predictor_.predictor(); }
  const predictor_type& predictor() const noexcept { return predictor_.predictor(); }

  cache_stats stats() const {
    std::lock_guard lock(mutex_);
    cache_stats s = stats_;
    s.predict_seconds = predictor_.seconds();
    return s.add_transfers(scheduler_.stats(), scheduler_.resident_blocks());
  }

  //! @brief How many sequences of `seq_len` tokens a fast tier of `fast_bytes` admits, dense
  //! vs OasisKV (two selections per layer, for prefetch, plus the summaries).
  admission_report admission(std::uint64_t seq_len, std::uint64_t fast_bytes) const {
    std::uint64_t summary_bytes = 0;
    if constexpr (has_summary) {
      summary_bytes = entries_.summaries().bytes_per_block();
    }
    return cache::admission::double_buffered(layout_, limits_.budget_blocks, limits_.block_cap,
                                             summary_bytes)
        .report(seq_len, fast_bytes);
  }

  //! @brief Bytes of the block-summary store.
  std::uint64_t summary_bytes() const {
    std::lock_guard lock(mutex_);
    return entries_.bytes();
  }

  //! @brief Checks every invariant and compares every staged block with the capacity tier's
  //! copy (`cache::audit`); returns the blocks compared. For tests and debugging.
  std::size_t audit() {
    std::lock_guard lock(mutex_);
    return cache::audit(scheduler_, fast_, writer_, entries_, capacity_, layout_.block_bytes(),
                        [&](auto&& visit) { sequences_.for_each_layer(visit); });
  }

  const scheduler_type& scheduler() const noexcept { return scheduler_; }
  slow_tier_type& capacity_tier() noexcept { return slow_; }
  fast_tier_type& fast_tier() noexcept { return fast_; }

 private:
  using entry_store_type = cache::summary_entry_store<summary_type>;
  using writer_type = cache::block_writer<slow_tier_type, fast_tier_type, scheduler_type,
                                          allocator_type, entry_store_type, stages_everything>;

  block_window window_of(const cache::layer_state& ls) const noexcept {
    return limits_.window(static_cast<std::uint32_t>(ls.blocks.size()));
  }

  mutable std::mutex mutex_;
  slow_tier_type slow_;
  fast_tier_type fast_;
  cache_options options_;
  cache::step_limits limits_;
  kv_layout layout_;
  refcounted_allocator<allocator_type> capacity_;
  entry_store_type entries_;  // the summaries, one entry per slot held
  cache::step_predictor<predictor_type, entry_store_type, slow_tier_type> predictor_;
  kernel_type kernel_;
  transfer_type engine_;
  scheduler_type scheduler_;  // after the tiers and the engine it references
  writer_type writer_;        // after everything it references
  cache::step_planner<scheduler_type> planner_;
  cache::sequence_table sequences_;
  cache_stats stats_{};
  std::uint32_t read_only_slots_ = 0;
  // Scratch of the batched calls (under the mutex).
  std::vector<cache::layer_state*> batch_;
  std::vector<cache::layer_blocks*> blocks_;
};

}  // namespace oasiskv
