// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Many sequences in one `tiered_kv_cache` behind a small virtual interface, one
//! implementation per mode: the batched engine's cache (dense or OasisKV) and the
//! self-speculative draft model's (dense). Every call takes a batch of sequences, so a batched
//! step costs one virtual call per layer, nothing per sequence.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include <mini_decoder/kv/kv_backend.hpp>

#include "oasiskv/core/ids.hpp"
#include "oasiskv/core/layout.hpp"
#include "oasiskv/kv_cache_types.hpp"

namespace mini_decoder {

//! The calls an engine makes on a cache its sequences share.
class shared_kv_cache {
 public:
  virtual ~shared_kv_cache() = default;
  virtual oasiskv::sequence_id add() = 0;
  virtual void remove(oasiskv::sequence_id seq) = 0;
  //! `n` tokens to each of `seqs` in `layer`; k, v: [seqs][n][kv_heads][head_dim] f16 bits.
  virtual void append(std::span<const oasiskv::sequence_id> seqs, std::uint32_t layer,
                      const std::uint16_t* k, const std::uint16_t* v, std::uint32_t n) = 0;
  //! The lookahead queries of each of `seqs`, q [seqs][q_len][q_heads][head_dim]: predicts each
  //! one's next step's blocks in `layer` (all of them scored together) and starts staging them.
  virtual void lookahead(std::span<const oasiskv::sequence_id> seqs, std::uint32_t layer,
                         const float* q, std::uint32_t q_len) = 0;
  //! Attention of the last `q_len` cached positions of each of `seqs`: q, out
  //! [seqs][q_len][q_heads][head_dim]; lse [seqs][q_len][q_heads].
  virtual void attend(std::span<const oasiskv::sequence_id> seqs, std::uint32_t layer,
                      const float* q, std::uint32_t q_len, float* out, float* lse) = 0;
  //! Drops every token of `seq` past its first `tokens`, in every layer
  //! (`tiered_kv_cache::truncate`: the rejected drafts).
  virtual void truncate(oasiskv::sequence_id seq, std::uint32_t tokens) = 0;
  //! The keys and values of the first `tokens` positions of (seq, layer), from the capacity
  //! tier, widened to f32: k, v [tokens][kv_heads][head_dim].
  virtual void read(oasiskv::sequence_id seq, std::uint32_t layer, std::uint32_t tokens, float* k,
                    float* v) = 0;
  virtual std::uint32_t length(oasiskv::sequence_id seq, std::uint32_t layer) const = 0;
  virtual oasiskv::cache_stats stats() const = 0;
  //! `tiered_kv_cache::audit`: the blocks compared. O(everything): for tests.
  virtual std::size_t audit() = 0;
  virtual std::size_t sequences() const = 0;
};

//! How a shared cache is built: host tiers of `capacity_slots` and `fast_slots` blocks of
//! `layout`, the cache's options, and the attention kernel's threads.
struct shared_cache_config {
  attention_mode mode = attention_mode::dense;  //!< dense or oasis
  summary_kind summary = default_summary;       //!< oasis: the block summary
  oasiskv::kv_layout layout{};
  std::uint32_t capacity_slots = 0, fast_slots = 0;
  oasiskv::cache_options options{};
  unsigned attention_threads = 1;
};

//! Throws `decoder_error` for a mode other than dense or oasis, or options the cache refuses.
std::unique_ptr<shared_kv_cache> make_shared_kv_cache(const shared_cache_config& c);

}  // namespace mini_decoder
