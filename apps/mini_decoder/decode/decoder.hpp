// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The decode loop: prefill, then rounds of draft -> verify (one target pass over the
//! pending token and the drafts) -> accept, with attention through OasisKV and the drafted
//! tokens' queries handed to `lookahead` as each layer computes them.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <mini_decoder/decode/draft.hpp>
#include <mini_decoder/decode/sampler.hpp>
#include <mini_decoder/decode/self_draft.hpp>
#include <mini_decoder/decode/verify.hpp>
#include <mini_decoder/kv/kv_backend.hpp>
#include <mini_decoder/model/model.hpp>
#include <mini_decoder/model/transformer.hpp>

namespace mini_decoder {

struct decoder_options {
  attention_mode mode = attention_mode::dense;
  summary_kind summary = default_summary;  // oasis, on-demand: the block summary
  std::uint32_t budget_tokens = 1024;
  std::uint32_t block_tokens = 16;
  draft_kind draft = draft_kind::none;
  std::uint32_t draft_len = 4;     // g: tokens drafted per round (1-15); adaptive: the most
  bool adaptive_draft = false;     // adapt g to the recent acceptance (`draft_length`)
  std::uint32_t draft_layers = 6;  // self-speculation: the first N layers are the draft model
  float temperature = 0.0f;
  float top_p = 1.0f;
  std::uint64_t seed = 42;
  std::uint32_t max_tokens = 256;  // tokens to generate
  bool ignore_eos = false;         // generate past the end token (speed runs of equal length)
  std::uint32_t context = 0;       // 0: the model's context length
  float rope_scale = 1.0f;
  unsigned attention_threads = 1;
  //! The target model's KV backend (the draft model's own cache is always `make_kv_backend`'s);
  //! empty: `make_kv_backend` for `mode`.
  kv_backend_factory backend;
  //! Called during prefill (per layer) and decode (about 4 times a second): phase, done, total,
  //! seconds since the phase began.
  std::function<void(const char*, std::uint32_t, std::uint32_t, double)> progress;
};

struct generation_report {
  std::uint32_t prompt_tokens = 0, generated = 0, rounds = 0, drafted = 0, accepted = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  oasiskv::cache_stats cache{};
  std::uint64_t fast_tier_bytes = 0;      // the staging pool OasisKV holds in fast memory
  std::uint64_t dense_kv_bytes = 0;       // every block of every layer at the final length
  std::uint64_t capacity_tier_bytes = 0;  // the capacity tier's pool
  std::uint64_t summary_bytes = 0;        // the block summaries, resident beside the fast tier
  double decode_tokens_per_second() const {
    return decode_seconds > 0 ? (generated > 0 ? generated - 1 : 0) / decode_seconds : 0.0;
  }
  double acceptance_rate() const { return drafted == 0 ? 0.0 : double(accepted) / drafted; }
};

//! A prompt's prefill, kept to start several generations from (the prefill is the same dense
//! pass in every mode): each layer's K,V as f16 bits, and the last token's logits.
struct prefilled_prompt {
  std::vector<int> prompt;
  std::vector<std::vector<std::uint16_t>> k, v;  // per layer, [prompt tokens][kv_dim]
  std::vector<float> logits;                     // [vocab]
  double seconds = 0;                            // the prefill's
};

class decoder {
 public:
  decoder(const model& m, decoder_options o);
  ~decoder();
  //! Generates after `prompt` (token ids, BOS included if the model wants one). `on_token` sees
  //! each committed token; returning false stops. Returns the generated tokens (no end token,
  //! unless `ignore_eos`: then end tokens are kept and generation goes on).
  std::vector<int> generate(const std::vector<int>& prompt,
                            const std::function<bool(int)>& on_token = {});
  //! The same after a prefill done once (`prefill`): the caches are filled from its K,V, and
  //! the tokens equal `generate(p.prompt)`'s. `report().prefill_seconds` is the kept prefill's.
  std::vector<int> generate(const prefilled_prompt& p,
                            const std::function<bool(int)>& on_token = {});
  //! The prompt's prefill (with this decoder's model and RoPE scaling), to generate from twice.
  prefilled_prompt prefill(const std::vector<int>& prompt);
  const generation_report& report() const { return report_; }
  const decoder_options& options() const { return o_; }

 private:
  void begin(const std::vector<int>& prompt, std::uint32_t ctx);
  void commit_prompt(std::uint32_t l, const float* k, const float* v, std::uint32_t n);
  std::vector<int> decode(const std::vector<int>& prompt, std::uint32_t ctx,
                          const std::function<bool(int)>& on_token);
  void verify_attend(std::uint32_t l, std::uint32_t n, const float* q, const float* k,
                     const float* v, float* out);
  void append_f16(kv_backend& c, std::uint32_t l, const float* k, const float* v, std::uint32_t n);

  const model& m_;
  decoder_options o_;
  transformer tf_;
  std::unique_ptr<kv_backend> cache_;
  std::unique_ptr<self_drafter> drafter_;  // draft == self
  oasiskv::sequence_id draft_seq_{};
  verify_side side_;
  std::vector<std::vector<float>> verify_k_, verify_v_;  // this round's K,V per layer
  std::vector<float> lse_, logits_;
  std::vector<std::uint16_t> k16_, v16_;
  std::uint32_t kv_dim_ = 0;
  generation_report report_;
};

}  // namespace mini_decoder
