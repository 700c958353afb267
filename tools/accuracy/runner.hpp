// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Decode loops over one prefilled context: the dense greedy run that feeds the
//! evaluator, and teacher-forced runs (dense or with block-sparse attention in the loop) that
//! give next-token agreement and perplexity. One prefill serves every run: prefill is dense in
//! every mode (as in the mini-decoder), so all runs start from the same KV.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <mini_decoder/model/model.hpp>
#include <mini_decoder/model/transformer.hpp>

#include "evaluator.hpp"
#include "oasiskv/summary/cascade_summary.hpp"

namespace accuracy {

//! Block-sparse attention in the loop: at step i, layer l attends the blocks the predictor
//! selected from step i-1's queries of layer l (pending token + drafts), through the library's
//! `lookahead_predictor<S, Agg>` (the deployed path), or Quest / recency; `S` is
//! `minmax_summary<f16>` (scoring "summary"), `quantized_minmax_summary` ("qminmax": the same
//! bounds in int8), `int8_key_summary` ("int8"), `int4_key_summary` ("int4") or a two-stage
//! `cascade_summary`: the int8 bounds keep `contender_factor` x the budget's blocks, scored by
//! int4 ("cascade4": `qminmax_int4_cascade`) or int8 ("cascade8") key copies; or
//! `qminmax_int2_summary` ("cascade2": the same bounds, 2-bit codes between them score).
struct sparse_config {
  std::string pred = "la4";         // la1 la2 la4 prev cur recency
  std::string agg = "max";          // max mass conf
  std::string scoring = "summary";  // summary, qminmax, int8, int4, cascade4/8/2
  std::uint32_t budget = 1024, block = 16;
  float contender_factor = oasiskv::cascade_params{}.contender_factor;  // the cascades
  //! pred/scoring/agg/shared/bT/budget; a cascade's scoring also names its factor
  //! (`cascade4x2`).
  // 0: every (step, layer) takes `budget` tokens of blocks; in (0, 1]: an adaptive budget, the
  // fewest blocks covering that share of the predicted mass, `budget` on average (the
  // predictor's ledger spans the run's layers and steps; selection_params::target_mass).
  float target_mass = 0;
  std::string name() const;
};

//! Parses an `--e2e` spec, `pred:agg:budget[:scoring[:factor][:tMASS]]`: a cascade scoring may
//! name its contender factor (else `default_factor`), and `tMASS` (e.g. `t0.9`) asks for an
//! adaptive budget covering MASS of the predicted mass. Fails with the spec named.
sparse_config parse_sparse_config(const std::string& spec, float default_factor);

//! One `--expect`, `<config>:<metric>>=<value>` (or `<=`).
struct expectation {
  std::string key, metric;
  bool at_most = false;  // "<=" rather than ">="
  double value = 0;
};
//! Parses an `--expect`; fails with it named.
expectation parse_expect(const std::string& s);

struct run_result {
  std::vector<int> tokens;  // the committed tokens x_0 .. x_{N-1}
  std::vector<int> argmax;  // the model's argmax after each committed token
  double nll = 0;           // summed -log p(teacher[i+1]) (teacher-forced runs)
  std::uint32_t scored = 0, drafted = 0, accepted = 0;
  // Sparse runs: blocks each (step, layer) attends that the same layer's previous step did
  // not, and all blocks attended after the first step: what a prefetcher must move per step.
  std::uint64_t churn_new = 0, churn_all = 0;
  // Sparse runs: blocks attended over the (step, layer)s that attended a prediction, and how
  // many those were (the mean compares fixed and adaptive budgets at equal cost).
  std::uint64_t selected_blocks = 0, selections = 0;
};

//! Called once per step of a run with the step's index and the logits of its committed token
//! (`[vocab]`: the next-token distribution the step scores), valid during the call only.
using logits_fn = std::function<void(std::uint32_t step, const float* logits)>;

class runner {
 public:
  //! `draft_layers` 0: n-gram drafts (prompt lookup); else self-speculative drafts, greedy
  //! through the model's first `draft_layers` layers and its head, attending densely.
  runner(const mini_decoder::model& m, float rope_scale, std::uint32_t context,
         std::uint32_t draft_len, std::uint32_t draft_layers = 0);
  //! Dense prefill of `prompt`, kept for every later run.
  void prefill(const std::vector<int>& prompt);
  //! Dense greedy decoding of `n` tokens; when `ev` is set, every `eval_every`-th step is
  //! evaluated (all layers) before its attention. `on_logits`, when set, sees every step's.
  run_result dense_greedy(std::uint32_t n, evaluator* ev, std::uint32_t eval_every,
                          const logits_fn& on_logits = {});
  //! Teacher-forced: commits `teacher[i]` at step i, scores the model's prediction of
  //! `teacher[i+1]`. `sparse` null: dense attention. `on_logits`, when set, sees every step's.
  run_result forced(const std::vector<int>& teacher, const sparse_config* sparse,
                    const logits_fn& on_logits = {});
  //! Free-running greedy decoding of `n` tokens, dense (`sparse` null) or with block-sparse
  //! attention in the loop. `reversed`: dense attention over the blocks in reverse order (the
  //! same keys, another summation order): a noise baseline for the dense run.
  run_result greedy(std::uint32_t n, const sparse_config* sparse, bool reversed = false);
  std::uint32_t prompt_tokens() const { return static_cast<std::uint32_t>(prompt_.size()); }

 private:
  struct sparse_state;
  run_result loop(const std::vector<int>* teacher, std::uint32_t n, const sparse_config* sparse,
                  evaluator* ev, std::uint32_t eval_every, const logits_fn& on_logits = {});
  std::vector<int> self_draft(std::vector<std::vector<float>>& K,
                              std::vector<std::vector<float>>& V, int x, std::uint32_t pos,
                              std::uint32_t g);

  const mini_decoder::model& m_;
  mini_decoder::transformer tf_;
  std::uint32_t context_, draft_len_, draft_layers_, kv_dim_;
  bool reversed_ = false;  // greedy(..., reversed): dense blocks attended last to first
  std::vector<float> draft_logits_, draft_scores_;
  std::vector<int> prompt_;
  std::vector<float> first_logits_;
  std::vector<std::vector<float>> prefill_k_, prefill_v_;  // [layer][pos][kv_dim]
};

}  // namespace accuracy
