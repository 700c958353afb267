// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Self-speculation: the model's first layers, with the final norm and the LM head, draft
//! greedily for any number of sequences at once. The draft model keeps a dense cache of its own
//! (its attention over the committed tokens is exact, whatever the target's mode); each drafting
//! position is one batched pass over every sequence still drafting, and the drafted tokens'
//! K,V are cut off the cache again (`tiered_kv_cache::truncate`) once the round is drafted.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include <mini_decoder/kv/shared_cache.hpp>
#include <mini_decoder/model/model.hpp>
#include <mini_decoder/model/transformer.hpp>

namespace mini_decoder {

class self_drafter {
 public:
  //! The first `layers` layers of `m` draft (`layers` in [1, num_layers)); the cache holds
  //! `slots` blocks of `block_tokens` tokens per layer-block (`slots_for` what one sequence
  //! needs), each sequence at most `max_tokens` tokens. Throws `decoder_error` for bad values.
  self_drafter(const model& m, std::uint32_t layers, std::uint32_t block_tokens,
               std::uint32_t max_tokens, std::uint64_t slots, float rope_scale = 1.0f,
               unsigned attention_threads = 1);
  ~self_drafter();
  self_drafter(const self_drafter&) = delete;
  self_drafter& operator=(const self_drafter&) = delete;

  //! Blocks the draft cache holds for one sequence of `tokens` tokens (drafts never pass the
  //! sequence's final length: a round drafts no more than it may still generate).
  static std::uint64_t slots_for(std::uint32_t layers, std::uint32_t block_tokens,
                                 std::uint64_t tokens);

  std::uint32_t layers() const { return layers_; }
  oasiskv::sequence_id add();
  void remove(oasiskv::sequence_id seq);
  //! Appends `n` committed tokens' K,V of `layer` (< `layers()`; others are ignored): `k`, `v`
  //! `[n][kv_dim]` f32, f16-rounded.
  void append(oasiskv::sequence_id seq, std::uint32_t layer, const float* k, const float* v,
              std::uint32_t n);

  //! One sequence's round: `count` greedy drafts after `token` at position `pos` (the
  //! sequence's cache holds `pos` committed tokens) go to `drafts`.
  struct job {
    oasiskv::sequence_id seq{};
    int token = 0;
    std::uint32_t pos = 0, count = 0;
    std::vector<int> drafts;
  };
  //! Drafts every job: drafting position j is one batched pass over the jobs with count > j.
  //! Each job's cache is back at `pos` tokens afterwards.
  void draft(std::span<job> jobs);

  std::size_t audit() { return cache_->audit(); }
  std::size_t sequences() const { return cache_->sequences(); }

 private:
  const model& m_;
  std::uint32_t layers_, kv_dim_;
  transformer tf_;
  std::unique_ptr<shared_kv_cache> cache_;
  // draft scratch
  std::vector<int> tokens_;
  std::vector<std::uint32_t> positions_;
  std::vector<oasiskv::sequence_id> seqs_;
  std::vector<std::size_t> rows_;  // the job of each row
  std::vector<float> logits_, lse_;
  std::vector<std::uint16_t> k16_, v16_;
};

}  // namespace mini_decoder
