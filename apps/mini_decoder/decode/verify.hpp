// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief A verification pass's attention beyond the cache, shared by the single-sequence
//! decoder and the batched engine.
//!
//! A round verifies n = g + 1 tokens at positions p..p+g: the pending token (committed already,
//! appended before the pass) and g drafts (never appended before acceptance). The library's
//! attend treats its q_len queries as the last q_len cached positions, so query j sees cached
//! positions <= p - g + j; the g positions it also needs (the last g - 1 committed tokens, the
//! pending token and the drafts up to itself) come from a side buffer and are merged exactly
//! through the attention's log-sum-exp.
#pragma once

#include <cstdint>
#include <vector>

#include <mini_decoder/model/model.hpp>

namespace mini_decoder {

//! One sequence's side buffer: the last committed tokens' K,V of each layer, newest last.
class verify_side {
 public:
  //! The most tokens a verification holds (`transformer::max_step_tokens`), and so the most
  //! committed tokens kept per layer.
  static constexpr std::uint32_t max_tokens = 16;

  verify_side() = default;
  explicit verify_side(const model_config& c);

  //! Appends `n` committed tokens' K,V of `layer` (f32, f16-rounded: what the cache holds),
  //! `[n][kv_dim]`; keeps the last `max_tokens`.
  void push(std::uint32_t layer, const float* k, const float* v, std::uint32_t n);

  //! Completes the cache's attention of a verification's n rows in `layer`: `q` and `out` are
  //! `[n][q_heads][head_dim]`, `lse` `[n][q_heads]` (the cache's, over positions up to
  //! p - g + j for row j); `k`, `v` the n rows' own K,V `[n][kv_dim]`. Row j then attends the
  //! union exactly. Nothing to do for n = 1.
  void merge(std::uint32_t layer, const float* q, const float* k, const float* v, std::uint32_t n,
             float* out, const float* lse);

 private:
  std::uint32_t heads_ = 0, kv_heads_ = 0, head_dim_ = 0, kv_dim_ = 0;
  float scale_ = 1.0f;
  std::vector<std::vector<float>> k_, v_;         // per layer, [<= max_tokens][kv_dim]
  std::vector<float> side_k_, side_v_, s_, acc_;  // merge's scratch
};

}  // namespace mini_decoder
