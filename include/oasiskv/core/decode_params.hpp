// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `decode_params`: one call of a sparse decode-attention kernel over a batch.
#pragma once

#include <cstdint>
#include <type_traits>

#include "oasiskv/config.hpp"
#include "oasiskv/core/views.hpp"

namespace oasiskv {

//! @brief The most query tokens per sequence a decode call takes (plain decode: 1; speculative
//! verification: the drafted tokens plus one).
inline constexpr std::uint32_t max_query_tokens = 16;

//! @brief Decode attention of `q_len` new tokens per sequence over the staged blocks of
//! `table`. The new tokens are the last `q_len` of each sequence and already sit in its blocks;
//! query token `j` of sequence `s` is at position `seq_lens[s] - q_len + j` and sees only the
//! tokens at or before it (causal among the new tokens). Scores are `scale * dot(q, k)`.
struct decode_params {
  const float* q = nullptr;                 // [num_seqs][q_len][num_q_heads][head_dim]
  block_pool_view pool{};                   // where the staged blocks live
  block_table_view table{};                 // which blocks each sequence (or KV head) attends to
  const std::uint32_t* seq_lens = nullptr;  // [num_seqs] tokens, the q_len new ones included
  float* out = nullptr;                     // [num_seqs][q_len][num_q_heads][head_dim]
  float* lse = nullptr;                     // [num_seqs][q_len][num_q_heads] natural log of the
                                            // softmax denominator; -inf where nothing was seen
  std::uint32_t num_seqs = 0;
  std::uint32_t q_len = 1;
  float scale = 1.0f;

  //! @brief Offset of query/output row (seq, token, q head), in floats.
  OASISKV_HOST_DEVICE std::size_t q_row(std::uint32_t seq, std::uint32_t tok,
                                        std::uint32_t head) const noexcept {
    return ((std::size_t{seq} * q_len + tok) * pool.layout.num_q_heads + head) *
           pool.layout.head_dim;
  }
  //! @brief Offset of the log-sum-exp of (seq, token, q head).
  OASISKV_HOST_DEVICE std::size_t lse_index(std::uint32_t seq, std::uint32_t tok,
                                            std::uint32_t head) const noexcept {
    return (std::size_t{seq} * q_len + tok) * pool.layout.num_q_heads + head;
  }
};

static_assert(std::is_trivially_copyable_v<decode_params>);

}  // namespace oasiskv
