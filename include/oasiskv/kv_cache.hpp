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
#include "oasiskv/concepts/block_allocator.hpp"
#include "oasiskv/concepts/block_summary.hpp"
#include "oasiskv/concepts/growable_summary.hpp"
#include "oasiskv/concepts/loadable_summary.hpp"
#include "oasiskv/concepts/policy_bundle.hpp"
#include "oasiskv/concepts/prefetch_scheduler.hpp"
#include "oasiskv/concepts/sparse_attention_kernel.hpp"
#include "oasiskv/concepts/tier_backend.hpp"
#include "oasiskv/concepts/transfer_engine.hpp"
#include "oasiskv/core/decode_params.hpp"
#include "oasiskv/core/selection.hpp"
#include "oasiskv/detail/block_writer.hpp"
#include "oasiskv/detail/summary_entry_store.hpp"
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
  static constexpr bool host_table_kernel = oasiskv::host_table_kernel<kernel_type>;
  //! True for the dense baseline (`all_resident`): every block is staged as soon as it fills.
  static constexpr bool stages_everything = [] {
    if constexpr (moded_scheduler<scheduler_type>) {
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
        entries_(layout_, slow_.num_slots()),
        predictor_(std::move(predictor)),
        kernel_(std::move(kernel)),
        engine_(make_engine(slow_)),
        scheduler_(fast_, slow_, engine_, {options.max_evictions_per_step}),
        writer_(layout_, slow_, fast_, scheduler_, capacity_, entries_) {
    if (!(fast_.layout() == layout_)) [[unlikely]] {
      detail::raise(errc::layout_mismatch, "tiered_kv_cache: fast and slow tier layouts differ");
    }
    if constexpr (read_only_slot_tier<slow_tier_type>) {
      static_assert(claimable_allocator<allocator_type>,
                    "oasiskv: a capacity tier with read-only slots needs an allocator with "
                    "take(slot) (free_list_allocator has it)");
      read_only_slots_ = slow_.read_only_slots();
      writer_.set_read_only_slots(read_only_slots_);
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
    const float target = options_.target_mass;
    if (target != 0.0f) {
      if (!(target > 0.0f && target <= 1.0f)) [[unlikely]] {
        detail::raise(errc::invalid_argument, "tiered_kv_cache: target_mass = ", target,
                      " must be 0 (the fixed budget) or in (0, 1]");
      }
      // The default cap: twice the budget (what `admission` plans for), within what the fast
      // tier can stage beside the block being appended to.
      block_cap_ = options_.max_selected_blocks != 0
                       ? options_.max_selected_blocks
                       : std::min<std::uint32_t>(2 * budget, fast_.num_slots() - 1);
      if (block_cap_ < budget) [[unlikely]] {
        detail::raise(errc::invalid_argument, "tiered_kv_cache: max_selected_blocks = ", block_cap_,
                      " is below the budget of ", budget, " blocks");
      }
      if (std::uint64_t{block_cap_} + 1 > fast_.num_slots()) [[unlikely]] {
        detail::raise(errc::invalid_argument, "tiered_kv_cache: the fast tier's ",
                      fast_.num_slots(), " slots cannot stage a selection of up to ", block_cap_,
                      " blocks (max_selected_blocks) plus the block being appended to");
      }
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
    static_assert(claimable_allocator<allocator_type>,
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
        const std::size_t want = total * entries_.summaries().wire_bytes();
        if (summaries.size() != want) [[unlikely]] {
          detail::raise(errc::invalid_argument, "adopt: ", summaries.size(), " summary bytes for ",
                        total, " blocks; expected ", total, " x ",
                        entries_.summaries().wire_bytes(), " = ", want);
        }
        load = true;
      }
    }
    writer_.adopt(tokens, blocks, slots, summaries, load);
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
          writer_.release(x);
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
        writer_.release(s);
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
    if constexpr (drainable_scheduler<scheduler_type>) {
      scheduler_.drain();
    }
    if constexpr (flushable_tier<slow_tier_type>) {
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
    writer_.append(ls, static_cast<const std::byte*>(k), static_cast<const std::byte*>(v), n);
  }

  //! @brief `append` of `n` tokens to each of several sequences in one layer: `k` and `v` are
  //! `[seqs][n][num_kv_heads][head_dim]`, sequence i's rows after sequence i - 1's. All or
  //! nothing over the batch: every sequence is checked (unknown, repeated, past
  //! `max_tokens_per_sequence`; null `k` or `v`) before any is written, and should a write fail
  //! part-way every sequence holds exactly the tokens it held before. Where the fast tier queues
  //! writes (`async_slot_io_tier`, as `cuda::device_tier` does) and the capacity tier is host
  //! memory, the write-through to staged copies is queued for the whole batch and waited for
  //! once, instead of once per sequence: a batched decoder's one call per layer.
  void append(std::span<const sequence_id> seqs, std::uint32_t layer, const void* k, const void* v,
              std::uint32_t n) {
    std::lock_guard lock(mutex_);
    append_batch_.clear();
    for (const sequence_id seq : seqs) {
      layer_state& ls = find(seq, "append").layer(layer, layout_);
      if (std::find(append_batch_.begin(), append_batch_.end(), &ls) != append_batch_.end())
          [[unlikely]] {
        detail::raise(errc::invalid_argument, "append: sequence ", static_cast<std::uint64_t>(seq),
                      " appears more than once");
      }
      if (std::uint64_t{ls.tokens} + n > options_.max_tokens_per_sequence) [[unlikely]] {
        detail::raise(
            errc::out_of_range, "append: ", n, " tokens to sequence ",
            static_cast<std::uint64_t>(seq), " layer ", layer, " (", ls.tokens,
            " tokens) would pass max_tokens_per_sequence = ", options_.max_tokens_per_sequence);
      }
      append_batch_.push_back(&ls);
    }
    if (n == 0 || seqs.empty()) {
      return;
    }
    if (k == nullptr || v == nullptr) [[unlikely]] {
      detail::raise(errc::invalid_argument, "append: null keys or values for ", seqs.size(),
                    " sequences");
    }
    writer_.append_many(std::span<detail::layer_blocks* const>(append_batch_),
                        static_cast<const std::byte*>(k), static_cast<const std::byte*>(v), n);
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

  //! @brief `lookahead` for several sequences in one layer: `q` is
  //! `[seqs][q_len][num_q_heads][head_dim]`, sequence i's queries predicting its next `attend`.
  //! A predictor that scores a batch together (`select_many`, as `lookahead_predictor` does)
  //! scores every (sequence, KV head) pair in one loop on its thread pool, so a batch keeps the
  //! threads busy where one sequence's few KV heads would not; otherwise each sequence is
  //! predicted in turn. The selections equal those of one `lookahead` per sequence, in order.
  //! Every sequence is checked and every prediction made before any is kept: on an error from
  //! either (an unknown or repeated sequence, an empty layer, bad queries) no sequence's pending
  //! prediction changes. The prefetches then start in sequence order. A no-op for predictors
  //! that run at attention time.
  void lookahead(std::span<const sequence_id> seqs, std::uint32_t layer, const float* q,
                 std::uint32_t q_len) {
    if constexpr (predictor_type::timing == prediction_timing::lookahead) {
      if (seqs.empty() || q == nullptr) [[unlikely]] {
        detail::raise(errc::invalid_argument, "lookahead: no sequences, or null queries");
      }
      const std::size_t stride = std::size_t{q_len} * layout_.num_q_heads * layout_.head_dim;
      std::lock_guard lock(mutex_);
      batch_.states.clear();
      for (std::size_t i = 0; i < seqs.size(); ++i) {
        layer_state& ls = find(seqs[i], "lookahead").layer(layer, layout_);
        check_queries(query_view{q + i * stride, nullptr, q_len}, "lookahead");
        if (ls.tokens == 0) [[unlikely]] {
          detail::raise(errc::invalid_argument, "lookahead: sequence ",
                        static_cast<std::uint64_t>(seqs[i]), " layer ", layer, " holds no tokens");
        }
        if (std::find(batch_.states.begin(), batch_.states.end(), &ls) != batch_.states.end())
            [[unlikely]] {
          detail::raise(errc::invalid_argument, "lookahead: sequence ",
                        static_cast<std::uint64_t>(seqs[i]), " appears more than once");
        }
        batch_.states.push_back(&ls);
      }
      const std::size_t n = seqs.size();
      if (batch_.selections.size() < n) {
        batch_.selections.resize(n);
        batch_.ids.resize(n);
      }
      const auto start = std::chrono::steady_clock::now();
      if constexpr (requires(std::span<const prediction_input<summary_type>> in,
                             std::span<selection* const> out) {
                      predictor_.select_many(in, step_selection_params(), out);
                    }) {
        batch_.inputs.clear();
        batch_.outs.clear();
        for (std::size_t i = 0; i < n; ++i) {
          batch_.inputs.push_back(input_for(
              *batch_.states[i], query_view{q + i * stride, nullptr, q_len}, batch_.ids[i]));
          batch_.outs.push_back(&batch_.selections[i]);
        }
        predictor_.select_many(std::span<const prediction_input<summary_type>>(batch_.inputs),
                               step_selection_params(), std::span<selection* const>(batch_.outs));
      } else {
        for (std::size_t i = 0; i < n; ++i) {
          predictor_.select(input_for(*batch_.states[i], query_view{q + i * stride, nullptr, q_len},
                                      batch_.ids[i]),
                            step_selection_params(), batch_.selections[i]);
        }
      }
      stats_.predict_seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      for (std::size_t i = 0; i < n; ++i) {
        layer_state& ls = *batch_.states[i];
        ls.pending.emplace();
        std::swap(*ls.pending, batch_.selections[i]);
        sources_.clear();
        collect_sources(ls, *ls.pending, sources_);
        scheduler_.prefetch(sources_);
        ++stats_.lookaheads;
      }
    } else {
      (void)seqs, (void)layer, (void)q, (void)q_len;
    }
  }

  //! @brief Attention of `q_len` new tokens per sequence in `layer` over the blocks selected for
  //! them. `q` is `[seqs][q_len][num_q_heads][head_dim]`; `out` likewise; `lse` is
  //! `[seqs][q_len][num_q_heads]` (may be null). The new tokens must already be appended.
  //! `attended`, where given, receives the blocks each sequence's tables read.
  //!
  //! `q`, `out` and `lse` live where the kernel reads and writes them: host memory for a CPU
  //! kernel; device memory for a device kernel (`host_table_kernel`), to which the step's block
  //! tables and lengths, built on the host, are copied once per call into device buffers the
  //! kernel owns and grows as needed (a null `lse` then uses one of the kernel's). The predictor
  //! reads queries on the host, so with a device kernel every sequence's selection must come
  //! from `lookahead` (host queries) for this step: a sequence without one, or a predictor that
  //! selects at attention time, is `errc::invalid_argument` before anything is staged.
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
          if constexpr (host_table_kernel) {
            if (predictor_type::timing != prediction_timing::lookahead || !ls.pending)
                [[unlikely]] {
              detail::raise(errc::invalid_argument, "attend: sequence ",
                            static_cast<std::uint64_t>(seqs[i]), " layer ", layer,
                            " has no lookahead selection for this step; the queries of a device ",
                            "kernel are device memory, which the predictor cannot read (call ",
                            "lookahead with host queries first)");
            }
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

  //! @brief The predictor, for its own settings (e.g. `set_thread_pool` of the summary-scoring
  //! predictors). Change them only while no `lookahead` or `attend` call is running.
  predictor_type& predictor() noexcept { return predictor_; }
  //! @brief The predictor (const).
  const predictor_type& predictor() const noexcept { return predictor_; }

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
      summary_bytes = entries_.summaries().bytes_per_block();
    }
    // Double-buffered: two selections of the budget; an adaptive budget averages the budget
    // but a table may take up to its cap.
    const std::uint64_t staged = std::min<std::uint64_t>(
        blocks, std::max<std::uint64_t>(2ull * budget_blocks(), block_cap_));
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
    return entries_.bytes();
  }

  //! @brief Checks every invariant: the scheduler's bookkeeping, residency within the fast tier,
  //! one summary entry per capacity slot in use, and every staged block byte-equal to the
  //! capacity tier's copy. A fast tier the CPU must not address (`slot_io_tier`) is read through
  //! `read_slot` into a host buffer; one it can neither address nor read is checked for its
  //! bookkeeping only. Returns the blocks compared. O(everything): for tests and debugging.
  std::size_t audit() {
    std::lock_guard lock(mutex_);
    scheduler_.check_invariants();
    entries_.check([this](slot_id s) { return capacity_.use_count(s); });
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
          } else if constexpr (slot_io_tier<fast_tier_type>) {
            fast_buffer.resize(layout_.block_bytes());  // device memory: copied out first
            std::as_const(fast_).read_slot(*f, 0, fast_buffer.data(), layout_.block_bytes());
            fast_bytes = fast_buffer.data();
          } else if constexpr (block_io_tier<fast_tier_type>) {
            fast_buffer.resize(layout_.block_bytes());
            fast_.read_block(*f, fast_buffer.data());
            fast_bytes = fast_buffer.data();
          } else {
            continue;  // bookkeeping only: the CPU cannot read this tier
          }
          const std::byte* slow_bytes = writer_.read(s, buffer);
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
  using entry_store_type = detail::summary_entry_store<summary_type>;
  using writer_type = detail::block_writer<slow_tier_type, fast_tier_type, scheduler_type,
                                           allocator_type, entry_store_type, stages_everything>;
  struct layer_state : detail::layer_blocks {
    std::optional<selection> pending;  // the last lookahead's selection
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

  static transfer_type make_engine(slow_tier_type& slow) {
    if constexpr (tier_bound_engine<transfer_type, slow_tier_type>) {
      return transfer_type(slow);
    } else {
      (void)slow;
      return transfer_type();
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

  prediction_input<summary_type> input_for(const layer_state& ls, query_view queries,
                                           std::vector<std::uint32_t>& ids) {
    prediction_input<summary_type> in;
    in.layout = layout_;
    in.seq_len = ls.tokens;
    if constexpr (has_summary) {
      in.summaries = &entries_.summaries();
    }
    in.summary_ids = entries_.entries_of(ls.blocks, ids);
    in.queries = queries;
    if constexpr (addressable_tier<slow_tier_type>) {
      in.keys = slow_.view();
      in.key_slots = ls.blocks;
    }
    return in;
  }

  selection_params step_selection_params() const {
    return {budget_blocks(), options_.sink_blocks, options_.recent_blocks, options_.target_mass,
            block_cap_};
  }

  void predict(const layer_state& ls, query_view queries, selection& out) {
    const prediction_input<summary_type> in = input_for(ls, queries, summary_ids_);
    const auto start = std::chrono::steady_clock::now();
    predictor_.select(in, step_selection_params(), out);
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
  entry_store_type entries_;                // the summaries, one entry per slot held
  std::vector<std::uint32_t> summary_ids_;  // predict's scratch (under the mutex)
  // The batched lookahead's scratch (under the mutex).
  struct batch_scratch {
    std::vector<layer_state*> states;
    std::vector<selection> selections;
    std::vector<std::vector<std::uint32_t>> ids;
    std::vector<prediction_input<summary_type>> inputs;
    std::vector<selection*> outs;
  };
  batch_scratch batch_;
  std::vector<detail::layer_blocks*> append_batch_;  // the batched append's layers
  predictor_type predictor_;
  kernel_type kernel_;
  transfer_type engine_;
  scheduler_type scheduler_;  // after the tiers and the engine it references
  writer_type writer_;        // after everything it references
  std::unordered_map<sequence_id, sequence_state> sequences_;
  std::uint64_t next_sequence_ = 1;
  std::vector<slot_id> sources_;
  cache_stats stats_{};
  std::uint32_t read_only_slots_ = 0;
  std::uint32_t block_cap_ = 0;  // adaptive budgets: the most blocks a table takes; else 0
};

}  // namespace oasiskv
