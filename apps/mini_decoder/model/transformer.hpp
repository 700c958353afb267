// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The Llama forward pass: RMSNorm, RoPE, GQA attention (supplied by the caller: the KV
//! cache lives outside), SwiGLU, tied or separate LM head.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include <mini_decoder/model/model.hpp>

namespace mini_decoder {

//! Attention of `n` new tokens in `layer`: q is [n][heads][hd]; k, v are [n][kv_heads][hd]
//! (already rounded to the cache's f16, so a copy of them equals what the cache holds); out is
//! [n][heads][hd]. The callee owns the KV cache: it appends what it commits and attends.
using attention_fn = std::function<void(std::uint32_t layer, std::uint32_t n, const float* q,
                                        const float* k, const float* v, float* out)>;
//! Receives one layer's keys and values of a prefill, [n][kv_heads][hd], f16-rounded.
using kv_sink_fn =
    std::function<void(std::uint32_t layer, const float* k, const float* v, std::uint32_t n)>;
//! Writes the keys and values of positions `[0, n)` of `layer` (the earlier chunks of a chunked
//! prefill, f16-rounded as they were appended) to `k` and `v`, `[n][kv_heads][hd]` each.
using kv_source_fn = std::function<void(std::uint32_t layer, std::uint32_t n, float* k, float* v)>;
//! Attention of one batched step in `layer`: token i of the n belongs to the i-th sequence of
//! the batch (its own position and cache); q, k, v and out are laid out as for `attention_fn`,
//! one row per token.
using batch_attention_fn = attention_fn;

class transformer {
 public:
  static constexpr std::uint32_t max_step_tokens = 16;  // what the library's attend takes

  //! `rope_scale` multiplies RoPE's theta (longer contexts than the model was trained for).
  transformer(const model& m, float rope_scale = 1.0f);

  const model_config& config() const { return m_.config; }

  //! Runs `n` (<= 16) tokens at positions `pos0`.. through the first `layers` layers, the final
  //! norm and the LM head: `logits` is [n][vocab]. Quantized weights stay quantized.
  void step(const int* tokens, std::uint32_t n, std::uint32_t pos0, std::uint32_t layers,
            const attention_fn& attend, float* logits);

  //! Any `n >= 1` rows (the scratch grows to the largest batch), row i token `tokens[i]` at
  //! `positions[i]`, through the first `layers` layers (all: 0), the final norm and the LM head:
  //! `logits` is [n][vocab]. Rows may be one token of each of n sequences or several consecutive
  //! tokens of some (a batched verification); the attention callback knows which. Each weight
  //! matrix is read once for all n rows. Every row's numbers equal what `step` computes for it
  //! alone at its position.
  void step_batch(const int* tokens, const std::uint32_t* positions, std::uint32_t n,
                  const batch_attention_fn& attend, float* logits, std::uint32_t layers = 0);

  //! The prompt, all layers, dense causal attention computed here (prefill is exact in every
  //! mode); `sink` gets each layer's K,V to append. `logits` gets the last token's [vocab].
  void prefill(const int* tokens, std::uint32_t n, const kv_sink_fn& sink, float* logits);
  //! One chunk of a prefill: tokens `[pos0, pos0 + n)` of a prompt whose first `pos0` tokens
  //! went through earlier chunks (`past` gives their keys and values, layer by layer). The
  //! attention's query rows are blocked at multiples of `prefill_rows` positions, so chunks that
  //! start at such multiples attend exactly as the whole prompt in one `prefill`; the products
  //! (sgemm over the chunk's rows) agree up to rounding, exactly where the BLAS computes a row
  //! alike for any number of rows. A later chunk (`pos0 > 0`) of fewer than `prefill_rows`
  //! tokens takes the decode rows' products instead (`matmul_quantized`: int8 activations by
  //! default), which cost per row what decoding does, where sgemm would first expand every
  //! weight matrix to f32. `logits` gets the chunk's last token's [vocab].
  void prefill(const int* tokens, std::uint32_t n, std::uint32_t pos0, const kv_source_fn& past,
               const kv_sink_fn& sink, float* logits);
  //! The row block of the prefill's attention; chunk boundaries at its multiples attend as a
  //! whole prefill does.
  static constexpr std::uint32_t prefill_rows = 64;

 private:
  void rope(float* x, std::uint32_t heads, std::uint32_t n, std::uint32_t pos0) const;
  void rope_at(float* x, std::uint32_t heads, std::uint32_t n,
               const std::uint32_t* positions) const;
  void reserve_tokens(std::uint32_t n);
  void forward(const int* tokens, const std::uint32_t* positions, std::uint32_t n,
               std::uint32_t layers, const attention_fn& attend, float* logits);
  void rmsnorm(float* out, const float* x, const float* w, std::uint32_t n) const;
  void embed(const int* tokens, std::uint32_t n, float* x) const;
  void attention_prefill(const float* q, const float* k, const float* v, std::uint32_t n,
                         std::uint32_t pos0, float* out);

  const model& m_;
  std::vector<float> inv_freq_;  // [hd/2]
  // decode scratch, [tokens][...]: 16 tokens, grown by step_batch
  std::uint32_t scratch_tokens_ = 0;
  std::vector<float> x_, xb_, q_, k_, v_, att_, hb_, hb2_;
  std::vector<std::uint32_t> positions_;
  // prefill scratch
  std::vector<float> px_, pxb_, pq_, pk_, pv_, patt_, phb_, phb2_, wscratch_, scores_;
};

//! Rounds to f16 and back: what the cache will store.
void round_to_f16(float* x, std::size_t n);
//! The f16 bit patterns of `n` values already rounded to f16 (exact), into `k16` and `v16` for
//! the K and V rows a cache appends; the vectors are resized to `n`.
void to_f16_bits(const float* k, const float* v, std::size_t n, std::vector<std::uint16_t>& k16,
                 std::vector<std::uint16_t>& v16);

}  // namespace mini_decoder
