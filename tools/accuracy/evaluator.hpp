// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Scores every predictor configuration at one (step, layer) against the oracle: the
//! top blocks by the true next query's exact attention mass. Everything a predictor sees was
//! known one step early (the previous step's pending-token and drafted-token queries); only
//! the oracle and the metrics read the true query.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "oasiskv/core/layout.hpp"
#include "oasiskv/predictor/aggregation.hpp"
#include "oasiskv/predictor/block_selector.hpp"
#include "oasiskv/summary/minmax_summary.hpp"
#include "oasiskv/summary/quantized_key_summary.hpp"
#include "oasiskv/summary/quantized_minmax_summary.hpp"

namespace accuracy {

//! Sums of one configuration's metrics over (step, layer) samples.
struct metric_sums {
  double agree_all = 0, agree_free = 0, recall = 0, rel_recall = 0, l2 = 0;
  //! Agreement with the selection the same scoring and aggregation make from the true next
  //! query (Quest's, for the summary): "the true next-step selection" of a deployment.
  double agree_next = 0;
  std::uint64_t n = 0, n_free = 0;
};

struct eval_config {
  std::string name;  // pred/scoring/agg/gran/bT/budget
  std::string pred, scoring, agg, gran;
  std::uint32_t block = 16, budget = 0;
  metric_sums sums;
};

struct eval_shape {
  std::uint32_t num_layers = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  std::uint32_t capacity_tokens = 0;  // the context
};

class evaluator {
 public:
  evaluator(const eval_shape& s, std::vector<std::uint32_t> block_sizes,
            std::vector<std::uint32_t> budgets, std::uint64_t seed);

  //! Folds the key of position `pos` (`[kv_heads][head_dim]`, f16-rounded) of `layer` into
  //! every block size's min/max, int8 and int4 key summaries, as the cache does on append.
  void append(std::uint32_t layer, std::uint32_t pos, const float* k);

  //! One sample: `len` committed keys/values `[len][kv_heads][head_dim]` of `layer` (the true
  //! next token's included), its true query `[q_heads][head_dim]`, and the previous step's
  //! queries `[n_prev][q_heads][head_dim]` (pending token, then drafts) with their confidence.
  void evaluate(std::uint32_t layer, std::uint32_t len, const float* keys, const float* values,
                const float* q_true, const float* q_prev, std::uint32_t n_prev,
                const float* w_prev);

  const std::vector<eval_config>& configs() const { return configs_; }
  std::uint64_t samples() const { return samples_; }

 private:
  struct per_block_size;  // the state of one block size
  using table_set = std::vector<std::vector<std::uint32_t>>;
  void score_and_record(per_block_size& bs, std::uint32_t nb, std::uint32_t len);
  void record(std::size_t config, const table_set& sel, const table_set& oracle,
              const table_set& next, std::uint32_t nb, const per_block_size& bs);

  eval_shape s_;
  std::vector<std::uint32_t> block_sizes_, budgets_;
  std::vector<eval_config> configs_;
  std::vector<std::vector<oasiskv::minmax_summary<>>> summaries_;    // [block size][layer]
  std::vector<std::vector<oasiskv::quantized_minmax_summary>> qmm_;  // [block size][layer]
  std::vector<std::vector<oasiskv::int8_key_summary>> int8_;         // [block size][layer]
  std::vector<std::vector<oasiskv::int4_key_summary>> int4_;         // [block size][layer]
  std::vector<std::byte> slot_;                                      // one f16 block, for update()
  std::vector<std::uint32_t> ids_;                                   // 0, 1, 2, ... entries
  std::mt19937_64 rng_;
  std::uint64_t samples_ = 0;
  // scratch of one sample
  std::vector<float> qrows_, logits_, probs_, raw_sum_, raw_max_, raw_lse_, sub_, acc_;
  std::vector<float> raw_i8max_, raw_i8lse_;  // the int8 key summary: max, log-mass
  std::vector<float> raw_i4max_, raw_i4lse_;  // the int4 key summary: max, log-mass
  std::vector<float> raw_qmm_;                // the int8 min/max summary's bound
  std::vector<float> mass_, numer_, dense_out_, sparse_out_;
  std::uint32_t ntok_ = 0, len_ = 0;
  const float* values_ = nullptr;
  oasiskv::block_selector selector_;
  oasiskv::max_aggregation max_agg_;
  oasiskv::softmax_mass_aggregation mass_agg_;
  oasiskv::confidence_weighted_aggregation conf_agg_;
  std::vector<float> weights_;
};

}  // namespace accuracy
