// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `remote_sequence`: a request admitted to a decode node from an exporter, densely
//! (`full`: the whole KV copied at admission) or selectively (`selective`: the block summaries,
//! the sink and recent blocks at admission; each step's other blocks fetched on demand into a
//! budget-sized local pool). Tokens the decode node generates go to local tail blocks: the
//! exporter's memory is read-only to it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "oasiskv/cache/admission.hpp"
#include "oasiskv/core/ids.hpp"
#include "oasiskv/core/kept_window.hpp"
#include "oasiskv/disagg/ucx_remote_tier.hpp"
#include "oasiskv/disagg/wire_summary.hpp"
#include "oasiskv/tier/host_tier.hpp"

namespace oasiskv::disagg {

//! @brief `full` (dense baseline): every block copied at admission; `selective`: the
//! summaries, the sinks and the recent window at admission, the rest on demand.
using oasiskv::admission_mode;

struct admission_options {
  admission_mode mode = admission_mode::selective;
  std::uint32_t budget_tokens = 2048;  //!< remote blocks attended per layer and step (selective)
  std::uint32_t sink_blocks = 1;
  std::uint32_t recent_blocks = 2;
  std::uint32_t max_new_tokens = 256;  //!< decode-side appends the local tail can hold
  std::uint32_t slack_percent = 25;    //!< local cache beyond the budget, in % of the budget
};

struct remote_sequence_stats {
  std::uint64_t admitted_bytes = 0;  //!< KV and summaries read at admission
  std::uint64_t fetched_bytes = 0;   //!< KV read after admission (on demand)
  std::uint64_t fetched_blocks = 0;
  std::uint64_t reused_blocks = 0;  //!< selected blocks already resident
  std::uint64_t host_bytes = 0;     //!< decode-side memory reserved for this request's KV
};

//! @brief One admitted request. Not thread-safe: one decode loop drives it.
class remote_sequence {
 public:
  remote_sequence(ucx_remote_tier& tier, std::uint64_t seq, admission_options options)
      : tier_(&tier), seq_(seq), options_(options), layout_(tier.layout()) {
    const bool selective = options_.mode == admission_mode::selective;
    opened_ = tier.open(seq, selective);
    prompt_tokens_ = opened_.tokens;
    const std::uint32_t tpb = layout_.tokens_per_block;
    remote_blocks_ = prompt_tokens_ / tpb;  // full blocks; a partial last one becomes local
    const std::uint32_t tail_blocks =
        layout_.blocks_for(std::uint64_t{prompt_tokens_ % tpb} + options_.max_new_tokens);
    budget_blocks_ = layout_.blocks_for(options_.budget_tokens);
    // The previous step's blocks are unpinned before the next selection is fetched, so the
    // pool needs the budget, the always-kept blocks, and some slack that keeps recently
    // evicted blocks for reuse (fewer refetches).
    per_layer_ =
        selective ? static_cast<std::uint32_t>(cache::admission::with_slack(
                                                   layout_, budget_blocks_, options_.slack_percent,
                                                   options_.sink_blocks, options_.recent_blocks, 0)
                                                   .staged_blocks(remote_blocks_))
                  : remote_blocks_;
    const std::uint32_t layers = layout_.num_layers;
    pool_.emplace(layout_, std::max<std::uint32_t>(1, layers * (per_layer_ + tail_blocks)));
    tail_per_layer_ = tail_blocks;
    layers_.resize(layers);
    for (std::uint32_t l = 0; l < layers; ++l) {
      layer_state& ls = layers_[l];
      ls.resident.assign(remote_blocks_, null_slot);
      ls.last_use.assign(per_layer_, 0);
      ls.owner.assign(per_layer_, none);
      for (std::uint32_t i = 0; i < per_layer_; ++i) {
        ls.free.push_back(l * per_layer_ + per_layer_ - 1 - i);
      }
      ls.tokens = prompt_tokens_;
    }
    stats_.host_bytes = pool_->bytes() + opened_.summaries.size();
    stats_.admitted_bytes = opened_.summaries.size();
    try {
      admit();  // on failure it has waited for every batch: no get still writes into pool_
    } catch (...) {
      try {
        tier_->release(seq_);  // the destructor will not run: give the lease back now
      } catch (...) {
        // The exporter is gone or dropped the request: it reclaims the blocks itself.
      }
      throw;
    }
  }
  remote_sequence(const remote_sequence&) = delete;
  remote_sequence& operator=(const remote_sequence&) = delete;
  ~remote_sequence() {
    for (auto& ls : layers_) {
      if (ls.pending) {
        try {
          tier_->engine().wait(*ls.pending);
        } catch (const error&) {
        }
      }
    }
    try {
      tier_->release(seq_);
    } catch (const error&) {
      // The exporter is gone or the lease lapsed: it reclaims the blocks itself.
    }
  }

  const kv_layout& layout() const noexcept { return layout_; }
  std::uint32_t length(std::uint32_t layer) const { return layer_at(layer, "length").tokens; }
  std::uint32_t prompt_tokens() const noexcept { return prompt_tokens_; }
  const remote_sequence_stats& stats() const noexcept { return stats_; }
  block_pool_view pool() const noexcept { return pool_->view(); }

  //! @brief The remote blocks step `q` (`[num_q_heads][head_dim]`) attends in `layer`: every
  //! one (full), or the sinks, the recent window and the top-scoring rest under the budget by
  //! their summaries (selective). Ascending. The local tail blocks come on top (see `stage`).
  void select(std::uint32_t layer, const float* q, std::vector<std::uint32_t>& out) const {
    layer_at(layer, "select");
    if (q == nullptr) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "remote_sequence ", seq_,
                             ": select: null query for layer ", layer);
    }
    out.clear();
    const std::uint32_t n = remote_blocks_;
    if (options_.mode == admission_mode::full || n <= budget_blocks_) {
      out.resize(n);
      std::iota(out.begin(), out.end(), 0u);
      return;
    }
    const block_window w = kept_window(n, options_);
    const std::uint32_t sinks = w.sinks, recent_from = w.recent_from, keep = w.kept();
    const std::uint32_t picks = budget_blocks_ > keep ? budget_blocks_ - keep : 0;
    const std::size_t sb = opened_.summary_bytes;
    scores_.resize(recent_from - sinks);
    score_summaries(layout_,
                    opened_.summaries.data() + (std::size_t{layer} * n_blocks() + sinks) * sb,
                    scores_.size(), q, scores_.data());
    std::vector<std::pair<float, std::uint32_t>> scored;
    scored.reserve(scores_.size());
    for (std::uint32_t b = sinks; b < recent_from; ++b) {
      scored.push_back({scores_[b - sinks], b});
    }
    const std::size_t k = std::min<std::size_t>(picks, scored.size());
    std::nth_element(scored.begin(), scored.begin() + static_cast<std::ptrdiff_t>(k), scored.end(),
                     [](const auto& a, const auto& b) { return a.first > b.first; });
    for (std::uint32_t b = 0; b < sinks; ++b) {
      out.push_back(b);
    }
    for (std::size_t i = 0; i < k; ++i) {
      out.push_back(scored[i].second);
    }
    for (std::uint32_t b = recent_from; b < n; ++b) {
      out.push_back(b);
    }
    std::sort(out.begin(), out.end());
  }

  //! @brief Starts fetching the blocks of `sel` that `layer` does not hold (one batch); returns
  //! at once. Evicts the least recently used blocks outside `sel`.
  void prefetch(std::uint32_t layer, std::span<const std::uint32_t> sel) {
    layer_state& ls = layer_at(layer, "prefetch");
    check_remote_blocks(layer, sel, "prefetch");
    settle(ls);
    ++ls.clock;
    std::vector<block_copy> copies;
    try {
      for (std::uint32_t b : sel) {
        if (ls.resident[b] != null_slot) {
          ls.last_use[ls.resident[b] - layer * per_layer_] = ls.clock;
          ++stats_.reused_blocks;
          continue;
        }
        const slot_id s = take_slot(ls, layer);
        ls.resident[b] = s;
        ls.owner[s - layer * per_layer_] = b;
        ls.last_use[s - layer * per_layer_] = ls.clock;
        copies.push_back({remote_slot(layer, b), s});
      }
      if (!copies.empty()) {
        ls.pending = tier_->engine().submit(*tier_, *pool_, copies);
        ls.pending_blocks = copies.size();
      }
    } catch (...) {
      // Nothing was fetched into the slots taken for `copies` (the engine refused the batch,
      // or the selection ran out of slots): they must not read as resident.
      for (const block_copy& c : copies) {
        drop_local(ls, c.dst - layer * per_layer_);
      }
      throw;
    }
  }

  //! @brief Makes `sel` of `layer` resident (waiting for its prefetch, fetching what is still
  //! missing) and writes its table for a kernel: the selected remote blocks, then the local tail.
  //! A failed fetch throws `errc::transfer_failed`; the blocks it was to fill are dropped.
  void stage(std::uint32_t layer, std::span<const std::uint32_t> sel, std::vector<block_ref>& out) {
    layer_state& ls = layer_at(layer, "stage");
    check_remote_blocks(layer, sel, "stage");
    prefetch(layer, sel);  // no-op for what the lookahead already asked for
    settle(ls);
    for (std::uint32_t b : sel) {
      out.push_back({ls.resident[b], b});
    }
    const std::uint32_t first = remote_blocks_;
    for (std::uint32_t i = 0; i < ls.tail.size(); ++i) {
      out.push_back({ls.tail[i], first + i});
    }
  }

  //! @brief Appends one token's keys and values (`[num_kv_heads][head_dim]` each) to `layer`'s
  //! local tail.
  void append(std::uint32_t layer, const void* k, const void* v) {
    layer_state& ls = layer_at(layer, "append");
    const std::uint32_t tpb = layout_.tokens_per_block;
    const std::uint32_t block = ls.tokens / tpb - remote_blocks_;
    if (block >= tail_per_layer_) [[unlikely]] {
      oasiskv::detail::raise(errc::capacity_exceeded, "remote_sequence ", seq_, ": more than ",
                             options_.max_new_tokens, " decode tokens");
    }
    if (block == ls.tail.size()) {
      ls.tail.push_back(tail_slot(layer, block));
    }
    std::byte* dst = pool_->slot_data(ls.tail[block]);
    const std::size_t row = layout_.row_bytes();
    const std::uint32_t t = ls.tokens % tpb;
    for (std::uint32_t h = 0; h < layout_.num_kv_heads; ++h) {
      std::memcpy(dst + layout_.key_offset(h) + t * row, static_cast<const std::byte*>(k) + h * row,
                  row);
      std::memcpy(dst + layout_.value_offset(h) + t * row,
                  static_cast<const std::byte*>(v) + h * row, row);
    }
    ++ls.tokens;
  }

 private:
  static constexpr std::uint32_t none = ~0u;
  struct layer_state {
    std::vector<slot_id> resident;        // remote block -> local slot
    std::vector<std::uint32_t> owner;     // local slot (of this layer) -> remote block
    std::vector<std::uint64_t> last_use;  // local slot -> clock
    std::vector<slot_id> free;
    std::vector<slot_id> tail;  // local tail blocks, in order
    std::optional<ucx_engine::ticket> pending;
    std::size_t pending_blocks = 0;
    std::uint64_t clock = 0;
    std::uint32_t tokens = 0;
  };

  template <class Self>
  static auto& layer_at(Self& self, std::uint32_t layer, const char* what) {
    if (layer >= self.layers_.size()) [[unlikely]] {
      oasiskv::detail::raise(errc::out_of_range, "remote_sequence ", self.seq_, ": ", what,
                             ": layer ", layer, " of a ", self.layers_.size(), "-layer sequence");
    }
    return self.layers_[layer];
  }
  layer_state& layer_at(std::uint32_t layer, const char* what) {
    return layer_at(*this, layer, what);
  }
  const layer_state& layer_at(std::uint32_t layer, const char* what) const {
    return layer_at(*this, layer, what);
  }
  // A selection names remote blocks only: the prompt's partial last block and the decoded
  // tokens are local tail blocks, which `stage` adds itself.
  void check_remote_blocks(std::uint32_t layer, std::span<const std::uint32_t> sel,
                           const char* what) const {
    for (const std::uint32_t b : sel) {
      if (b >= remote_blocks_) [[unlikely]] {
        oasiskv::detail::raise(errc::out_of_range, "remote_sequence ", seq_, ": ", what, ": block ",
                               b, " of layer ", layer, " is not one of its ", remote_blocks_,
                               " remote blocks (the partial last block and decoded tokens are "
                               "local; stage adds them)");
      }
    }
  }

  std::uint32_t n_blocks() const noexcept { return opened_.blocks_per_layer; }
  slot_id remote_slot(std::uint32_t layer, std::uint32_t b) const {
    return opened_.blocks[std::size_t{layer} * n_blocks() + b].slot;
  }
  slot_id tail_slot(std::uint32_t layer, std::uint32_t i) const {
    return layout_.num_layers * per_layer_ + layer * tail_per_layer_ + i;
  }

  void settle(layer_state& ls) {
    if (!ls.pending) {
      return;
    }
    const auto t = *ls.pending;
    ls.pending.reset();
    try {
      tier_->engine().wait(t);
    } catch (const error&) {
      // Nothing of the batch can be trusted: forget every block it was to fill.
      for (std::uint32_t i = 0; i < ls.owner.size(); ++i) {
        if (ls.owner[i] != none && ls.last_use[i] == ls.clock) {
          drop_local(ls, i);
        }
      }
      throw;
    }
    stats_.fetched_blocks += ls.pending_blocks;
    stats_.fetched_bytes += ls.pending_blocks * layout_.block_bytes();
  }

  void drop_local(layer_state& ls, std::uint32_t i) {
    const slot_id s = ls.resident[ls.owner[i]];
    ls.resident[ls.owner[i]] = null_slot;
    ls.owner[i] = none;
    ls.free.push_back(s);
  }

  slot_id take_slot(layer_state& ls, std::uint32_t layer) {
    if (ls.free.empty()) {
      std::uint32_t victim = none;
      for (std::uint32_t i = 0; i < ls.owner.size(); ++i) {
        if (ls.owner[i] != none && ls.last_use[i] < ls.clock &&
            (victim == none || ls.last_use[i] < ls.last_use[victim])) {
          victim = i;
        }
      }
      if (victim == none) [[unlikely]] {
        oasiskv::detail::raise(errc::capacity_exceeded, "remote_sequence ", seq_, " layer ", layer,
                               ": the selection exceeds the ", per_layer_, " local slots");
      }
      drop_local(ls, victim);
    }
    const slot_id s = ls.free.back();
    ls.free.pop_back();
    return s;
  }

  // full: every remote block; selective: sinks and recent ones. Both: the partial last block
  // into the local tail, where decode tokens will follow it.
  void admit() {
    const std::uint32_t layers = layout_.num_layers;
    std::vector<std::uint32_t> sel;
    std::vector<block_copy> partial;
    std::optional<ucx_engine::ticket> tail_ticket;
    try {
      for (std::uint32_t l = 0; l < layers; ++l) {
        sel.clear();  // the partial last block is not remote: it goes to the tail below
        cache::admission::initial_blocks(kept_window(remote_blocks_, options_), remote_blocks_,
                                         options_.mode, sel);
        prefetch(l, sel);
      }
      if (prompt_tokens_ % layout_.tokens_per_block != 0) {
        for (std::uint32_t l = 0; l < layers; ++l) {
          layers_[l].tail.push_back(tail_slot(l, 0));
          partial.push_back(
              {opened_.blocks[std::size_t{l} * n_blocks() + remote_blocks_].slot, tail_slot(l, 0)});
        }
      }
      if (!partial.empty()) {
        tail_ticket = tier_->engine().submit(*tier_, *pool_, partial);
      }
      for (auto& ls : layers_) {
        settle(ls);
      }
      if (tail_ticket) {
        tier_->engine().wait(*std::exchange(tail_ticket, std::nullopt));
      }
    } catch (...) {
      // One batch failed (or was refused) while others may still be writing into the pool:
      // wait for them all before the error leaves the constructor and frees the pool.
      for (auto& ls : layers_) {
        if (ls.pending) {
          try {
            tier_->engine().wait(*std::exchange(ls.pending, std::nullopt));
          } catch (...) {
          }
        }
      }
      if (tail_ticket) {
        try {
          tier_->engine().wait(*tail_ticket);
        } catch (...) {
        }
      }
      throw;
    }
    stats_.admitted_bytes += (stats_.fetched_blocks + partial.size()) * layout_.block_bytes();
    stats_.fetched_blocks = stats_.fetched_bytes = 0;
  }

  ucx_remote_tier* tier_;
  std::uint64_t seq_;
  admission_options options_;
  kv_layout layout_;
  opened_msg opened_;
  std::uint32_t prompt_tokens_ = 0;
  std::uint32_t remote_blocks_ = 0;
  std::uint32_t budget_blocks_ = 0;
  std::uint32_t per_layer_ = 0;
  std::uint32_t tail_per_layer_ = 0;
  std::optional<host_tier> pool_;
  std::vector<layer_state> layers_;
  remote_sequence_stats stats_{};
  mutable std::vector<float> scores_;
};

}  // namespace oasiskv::disagg
