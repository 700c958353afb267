// SPDX-License-Identifier: Apache-2.0
//
// OasisKV as llama.cpp's KV cache: a memory type (llama_memory_i) whose tokens live in an OasisKV
// tiered_kv_cache, and the graph hooks that send attention through it. Prefill stays dense
// (llama.cpp's own attention over the keys and values read back from the cache); a ubatch in
// which every sequence brings at most 16 tokens (decode, speculative verification) attends
// through OasisKV's block-sparse decode, a ggml custom operation per layer, whose queries then
// predict the next step's blocks (lookahead).
//
// This header is C++17 and is included by llama-model.cpp and llama-graph.cpp; OasisKV itself
// (C++20) stays behind oasiskv-bridge.h.
#pragma once

#include "llama-graph.h"
#include "llama-memory.h"

struct llama_cparams;
struct llama_model;

// The memory of a context created with llama_context_params::oasis_budget > 0. Throws
// std::runtime_error naming what the model or the settings lack (the context is then not made).
llama_memory_i* llama_memory_oasis_create(const llama_model& model,
                                          const llama_memory_params& params,
                                          const llama_cparams& cparams);

// llm_graph_context::build_attn_inp_kv: the attention input of an OasisKV memory, or nullptr
// when the graph's memory is not OasisKV's.
llm_graph_input_attn_kv* llama_memory_oasis_build_attn_inp(const llm_graph_context& g);

// llm_graph_context::build_attn over that input: the attention output after wo, or nullptr when
// `inp` is not OasisKV's.
ggml_tensor* llama_memory_oasis_build_attn(const llm_graph_context& g, llm_graph_input_attn_kv* inp,
                                           ggml_tensor* wo, ggml_tensor* wo_b, ggml_tensor* wo_s,
                                           ggml_tensor* q_cur, ggml_tensor* k_cur,
                                           ggml_tensor* v_cur, ggml_tensor* kq_b,
                                           ggml_tensor* sinks, float kq_scale, int il);
