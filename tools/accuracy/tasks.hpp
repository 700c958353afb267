// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Task-level accuracy, free-running (docs/accuracy.md): needle-in-a-haystack retrieval
//! (`--task needle`: a pass key at depths 10%-90% of filler or real text, asked for through the
//! chat template, answered greedily with dense and with each sparse configuration) and
//! free-running agreement (`--task agree`: greedy continuations of text windows, sparse and a
//! dense noise baseline against dense: tokens before the first divergence).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <mini_decoder/model/model.hpp>

namespace accuracy {

//! The task modes' own options (the model, --rope-scale, --context, --e2e, --blocks, --text,
//! --seed, --draft-len, --json and --expect are the harness's).
struct task_options {
  std::string task;                                         // empty: the harness's predictor run
  std::vector<std::uint32_t> contexts{2048, 4096, 8192};    // needle
  std::uint32_t depths = 10, keys = 3, answer_tokens = 12;  // needle
  std::string haystack = "filler";                          // needle: filler or text (--text)
  std::uint32_t prompts = 20, decode = 64;                  // agree
  std::vector<std::string> corpora;         // agree: one source each, files by commas
  std::vector<std::string> noise{"order"};  // agree: order, f32act
};

void add_task_options(CLI::App& app, task_options& o);

//! What the task modes take from the harness's options.
struct task_inputs {
  const mini_decoder::model* model = nullptr;
  float rope_scale = 1.0f;
  std::uint32_t context = 4096, draft_len = 4, block = 16;
  std::uint64_t seed = 1;
  std::vector<std::string> text_files, e2e_specs, expects;
  std::string json_path;
  float contender_factor = 4.0f;  //!< cascade scorings without a factor of their own
};

//! Runs `o.task`: prints its table, writes the JSON, checks the expectations; the exit status.
int run_task(const task_options& o, const task_inputs& in);

}  // namespace accuracy
