// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief One sequence's KV cache behind a small virtual interface, so that the decode loop is
//! written once and each `--mode` picks a different `tiered_kv_cache<Policies>` bundle.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "oasiskv/core/layout.hpp"
#include "oasiskv/kv_cache_types.hpp"

namespace mini_decoder {

enum class attention_mode : std::uint8_t { dense, oasis, quest, recency, on_demand };
const char* to_string(attention_mode m);
attention_mode parse_mode(const std::string& s);  // throws decoder_error on an unknown name

//! The block summary the predicting modes (oasis, on-demand) score blocks with (`--summary`):
//! min/max bounds in f16 (`minmax`) or int8 (`qminmax`), int8 or int4 copies of every key
//! (`int8`, `int4`), or a two-stage one: `cascade` (`qminmax_int4_cascade`: the int8 bounds pick
//! four times the budget in contenders, the int4 keys score those) or `int2`
//! (`qminmax_int2_summary`: the same bounds pick, 2-bit codes between them score). Quest keeps
//! the f16 bounds (its published form).
enum class summary_kind : std::uint8_t { minmax, qminmax, int8, int4, cascade, int2 };
const char* to_string(summary_kind k);
summary_kind parse_summary(const std::string& s);  // throws decoder_error on an unknown name
//! Every `summary_kind`'s name, '|'-separated (for help texts and errors).
const char* summary_names();
//! The default: the best measured quality (docs/accuracy.md) at a select() cost the CPU carries.
inline constexpr summary_kind default_summary = summary_kind::int2;

struct cache_config {
  attention_mode mode = attention_mode::dense;
  std::uint32_t num_layers = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  std::uint32_t block_tokens = 16;
  std::uint32_t budget_tokens = 1024;  // per (sequence, layer); ignored by dense
  std::uint32_t max_tokens = 0;        // the context
  unsigned attention_threads = 1;
  summary_kind summary = default_summary;  // the predicting modes' block summary
};

//! The calls the decode loop makes; one virtual call per layer and step, nothing per token.
class kv_backend {
 public:
  virtual ~kv_backend() = default;
  //! k, v: [n][kv_heads][head_dim] f16 bit patterns.
  virtual void append(std::uint32_t layer, const std::uint16_t* k, const std::uint16_t* v,
                      std::uint32_t n) = 0;
  //! Queries of the lookahead (drafted) tokens, [n][q_heads][head_dim].
  virtual void lookahead(std::uint32_t layer, const float* q, std::uint32_t n) = 0;
  //! q, out: [q_len][q_heads][head_dim]; lse: [q_len][q_heads]. `attended`, where given, gets
  //! the blocks the step attended (`tiered_kv_cache::attend`'s report).
  virtual void attend(std::uint32_t layer, const float* q, std::uint32_t q_len, float* out,
                      float* lse, oasiskv::attended_blocks* attended) = 0;
  virtual std::uint32_t length(std::uint32_t layer) const = 0;
  virtual oasiskv::cache_stats stats() const = 0;
  virtual const oasiskv::kv_layout& layout() const = 0;
  //! Bytes of the fast tier (the staging pool) and of the capacity tier.
  virtual std::uint64_t fast_tier_bytes() const = 0;
  virtual std::uint64_t capacity_tier_bytes() const = 0;
  //! Bytes of the block summaries held beside the fast tier (0 for modes without a summary).
  virtual std::uint64_t summary_bytes() const = 0;
  virtual std::uint32_t budget_tokens() const = 0;
};

std::unique_ptr<kv_backend> make_kv_backend(const cache_config& c);

//! Makes the target model's KV backend; the decoder's default is `make_kv_backend`. An engine
//! puts its own store behind the decode loop through this (the tests put a logging wrapper and
//! an independent reference there).
using kv_backend_factory = std::function<std::unique_ptr<kv_backend>(const cache_config&)>;

}  // namespace mini_decoder
