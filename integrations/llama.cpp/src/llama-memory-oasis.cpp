// SPDX-License-Identifier: Apache-2.0
// OasisKV as llama.cpp's KV cache: the memory's creation, and how it splits, plans and applies
// batches (llama-memory-oasis-impl.h).
#include "llama-memory-oasis-impl.h"

#include "llama-cparams.h"
#include "llama-hparams.h"
#include "llama-impl.h"
#include "llama-model.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace llama_oasis {

llama_memory_oasis::llama_memory_oasis(const llama_model& model, const llama_cparams& cparams,
                                       std::unique_ptr<oasiskv_bridge::cache> cache, ggml_type type)
    : n_layer(model.hparams.n_layer()),
      n_head(model.hparams.n_head(0)),
      n_head_kv(model.hparams.n_head_kv(0)),
      head_dim(model.hparams.n_embd_head_k(0)),
      type(type),
      type_size(ggml_type_size(type)),
      base_scale(1.0f / std::sqrt(float(model.hparams.n_embd_head_k(0)))),
      layer_ops(n_layer),
      n_seq_max(std::max(1u, cparams.n_seq_max)),
      max_tokens(cache->config().max_tokens),
      cache(std::move(cache)),
      seqs(n_seq_max) {
  for (uint32_t il = 0; il < n_layer; ++il) {
    layer_ops[il].mem = this;
    layer_ops[il].layer = il;
  }
}

llama_memory_oasis::~llama_memory_oasis() {
  try {
    const oasiskv_bridge::cache_report r = cache->report();
    LLAMA_LOG_INFO(
        "%s: OasisKV: %llu attention steps, %llu predicted ahead (lookahead), %llu at attention "
        "time; blocks staged in time %llu, fetched late %llu; %.3f s predicting\n",
        __func__, (unsigned long long)r.steps, (unsigned long long)r.lookaheads,
        (unsigned long long)r.unpredicted, (unsigned long long)r.hits, (unsigned long long)r.misses,
        r.predict_seconds);
  } catch (...) {
    // a destructor reports what it can
  }
}

//
// llama_memory_oasis
//

llama_memory_context_ptr llama_memory_oasis::init_batch(llama_batch_allocr& balloc,
                                                        uint32_t n_ubatch, bool embd_all) {
  GGML_UNUSED(embd_all);

  // first as the stock cache splits; a dense ubatch that mixes sequences whose cells would
  // pass one context is split again, one sequence set per ubatch
  for (int attempt = 0; attempt < 2; ++attempt) {
    balloc.split_reset();

    std::vector<llama_ubatch> ubatches;
    while (true) {
      auto ubatch = attempt == 0 ? balloc.split_simple(n_ubatch) : balloc.split_seq(n_ubatch);
      if (ubatch.n_tokens == 0) {
        break;
      }
      ubatches.push_back(std::move(ubatch));
    }

    if (balloc.get_n_used() < balloc.get_n_tokens()) {
      break;
    }

    std::vector<oasis_shape> shapes;
    std::string why;
    switch (plan(ubatches, shapes, why)) {
      case plan_result::ok:
        return std::make_unique<llama_memory_oasis_context>(this, std::move(ubatches),
                                                            std::move(shapes));
      case plan_result::split_by_sequence:
        continue;
      case plan_result::no_room:
        LLAMA_LOG_WARN("%s: OasisKV: %s\n", __func__, why.c_str());
        return std::make_unique<llama_memory_oasis_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE);
      case plan_result::invalid:
        LLAMA_LOG_ERROR("%s: OasisKV: %s\n", __func__, why.c_str());
        return std::make_unique<llama_memory_oasis_context>(LLAMA_MEMORY_STATUS_FAILED_COMPUTE);
    }
  }

  return std::make_unique<llama_memory_oasis_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE);
}

llama_memory_oasis::plan_result llama_memory_oasis::plan(const std::vector<llama_ubatch>& ubatches,
                                                         std::vector<oasis_shape>& shapes,
                                                         std::string& why) const {
  std::vector<uint32_t> len(n_seq_max);
  for (uint32_t s = 0; s < n_seq_max; ++s) {
    len[s] = seqs[s].used ? seqs[s].n : 0;
  }

  const uint64_t n_kv_max = GGML_PAD(max_tokens, kv_pad);

  shapes.clear();
  for (const auto& ub : ubatches) {
    if (ub.n_pos != 1) {
      why = "a ubatch with " + std::to_string(ub.n_pos) + " positions per token";
      return plan_result::invalid;
    }

    // the tokens of each sequence, and those each attends as its own
    std::map<llama_seq_id, std::vector<uint32_t>> tok, own;
    for (uint32_t i = 0; i < ub.n_tokens; ++i) {
      if (ub.n_seq_id[i] < 1) {
        why = "a token without a sequence";
        return plan_result::invalid;
      }
      for (int32_t k = 0; k < ub.n_seq_id[i]; ++k) {
        const llama_seq_id s = ub.seq_id[i][k];
        if (!valid_seq(s)) {
          why = "sequence id " + std::to_string(s) + " is outside [0, " +
                std::to_string(n_seq_max) + ")";
          return plan_result::invalid;
        }
        if (ub.pos[i] != (llama_pos)len[s]) {
          why = "a token at position " + std::to_string(ub.pos[i]) + " of sequence " +
                std::to_string(s) + ", which holds " + std::to_string(len[s]) +
                " tokens: a sequence grows only at its end";
          return plan_result::invalid;
        }
        if (++len[s] > max_tokens) {
          why = "sequence " + std::to_string(s) + " would pass its context of " +
                std::to_string(max_tokens) + " tokens";
          return plan_result::no_room;
        }
        tok[s].push_back(i);
      }
      own[ub.seq_id[i][0]].push_back(i);
    }

    oasis_shape shape;
    shape.decode = true;
    uint64_t n_kv = 0;
    for (const auto& [s, o] : own) {
      const auto& t = tok[s];
      // decode attends a sequence's last tokens, at most 16 of them
      shape.decode = shape.decode && o.size() <= max_query_tokens &&
                     std::equal(o.begin(), o.end(), t.end() - (ptrdiff_t)o.size());
      n_kv += len[s];
    }
    if (!shape.decode) {
      if (n_kv > n_kv_max) {
        if (own.size() > 1) {
          return plan_result::split_by_sequence;
        }
        why = "a ubatch reads back " + std::to_string(n_kv) + " cells, more than the context";
        return plan_result::invalid;
      }
      shape.n_kv_pad = GGML_PAD(n_kv, kv_pad);
    }
    shapes.push_back(shape);
  }

  return plan_result::ok;
}

oasis_shape llama_memory_oasis::reserve_shape(const llama_ubatch& ub) const {
  oasis_shape shape;
  shape.decode = ub.n_tokens <= ub.n_seqs;
  shape.n_kv_pad = shape.decode ? 0 : GGML_PAD(max_tokens, kv_pad);
  return shape;
}

llama_memory_context_ptr llama_memory_oasis::init_full() {
  return std::make_unique<llama_memory_oasis_context>(this);
}

llama_memory_context_ptr llama_memory_oasis::init_update(llama_context* lctx, bool optimize) {
  GGML_UNUSED(lctx);
  GGML_UNUSED(optimize);

  // sequence operations take effect at once: nothing is ever pending
  return std::make_unique<llama_memory_oasis_context>(LLAMA_MEMORY_STATUS_NO_UPDATE);
}

bool llama_memory_oasis::apply(const llama_ubatch& ub, const oasis_shape& shape) {
  if (failed()) {
    {
      std::lock_guard<std::mutex> lock(failure_mutex);
      LLAMA_LOG_ERROR("%s: OasisKV: the previous batch failed: %s\n", __func__, failure.c_str());
      failure.clear();
    }
    resync();
    failed_.store(false, std::memory_order_release);
    return false;
  }

  try {
    step = {};
    step.shape = shape;
    step.first_of.assign(ub.n_tokens, -1);

    std::vector<int32_t> index(n_seq_max, -1);
    for (uint32_t i = 0; i < ub.n_tokens; ++i) {
      for (int32_t k = 0; k < ub.n_seq_id[i]; ++k) {
        const llama_seq_id s = ub.seq_id[i][k];
        if (index[s] < 0) {
          index[s] = (int32_t)step.targets.size();
          oasis_target t;
          t.id = s;
          t.before = seqs[s].used ? seqs[s].n : 0;
          step.targets.push_back(std::move(t));
        }
        step.targets[index[s]].tok.push_back(i);
      }
      const int32_t first = index[ub.seq_id[i][0]];
      step.targets[first].own.push_back(i);
      step.first_of[i] = first;
    }

    // a sequence that takes exactly another's tokens, held the same blocks and attends none
    // of them is not written: it becomes a fork of the other once the ubatch is done
    for (auto& t : step.targets) {
      if (!t.own.empty()) {
        continue;
      }
      const int32_t p = step.first_of[t.tok[0]];
      const oasis_target& o = step.targets[p];
      const oasis_seq& a = seqs[t.id];
      const oasis_seq& b = seqs[o.id];
      if (o.tok == t.tok && o.own == t.tok && t.before == o.before &&
          (t.before == 0 || (a.used && b.used && cache->same_blocks(a.h, b.h)))) {
        t.alias = p;
      }
    }

    uint32_t offset = 0;
    for (auto& t : step.targets) {
      oasis_seq& s = seqs[t.id];
      if (t.alias < 0 && !s.used) {
        s.h = cache->add_sequence();
        s.used = true;
        s.n = 0;
      }
      t.h = s.h;
      if (!t.own.empty()) {
        t.offset = offset;
        offset += t.before + (uint32_t)t.tok.size();
      }
    }
    step.n_kv = offset;

    std::map<size_t, std::vector<size_t>> appends, attends;
    for (size_t i = 0; i < step.targets.size(); ++i) {
      const oasis_target& t = step.targets[i];
      seqs[t.id].n = t.before + (uint32_t)t.tok.size();
      if (t.alias < 0) {
        appends[t.tok.size()].push_back(i);
      }
      if (!t.own.empty()) {
        attends[t.own.size()].push_back(i);
      }
    }
    step.appends.assign(appends.begin(), appends.end());
    step.attends.assign(attends.begin(), attends.end());
  } catch (const std::exception& e) {
    LLAMA_LOG_ERROR("%s: OasisKV: %s\n", __func__, e.what());
    step = {};
    return false;
  }

  return true;
}

// after the last layer: the sequences that shared the ubatch's tokens become forks
void llama_memory_oasis::finish_ubatch() {
  for (const auto& t : step.targets) {
    if (t.alias < 0) {
      continue;
    }
    const oasis_target& o = step.targets[t.alias];
    oasis_seq& s = seqs[t.id];
    if (s.used) {
      cache->remove(s.h);
      s.used = false;
    }
    s.h = cache->fork(o.h, o.before + (uint32_t)o.tok.size());
    s.used = true;
    s.n = o.before + (uint32_t)o.tok.size();
  }
}

void llama_memory_oasis::fail(const char* what) {
  std::lock_guard<std::mutex> lock(failure_mutex);
  if (failure.empty()) {
    failure = what;
    LLAMA_LOG_ERROR("OasisKV: %s\n", what);
  }
  failed_.store(true, std::memory_order_release);
}

// after a failed batch: every sequence keeps the tokens all its layers hold
void llama_memory_oasis::resync() {
  for (auto& s : seqs) {
    if (!s.used) {
      continue;
    }
    try {
      uint32_t n = std::numeric_limits<uint32_t>::max();
      for (uint32_t il = 0; il < n_layer; ++il) {
        n = std::min(n, cache->length(s.h, il));
      }
      cache->truncate(s.h, n);
      s.n = n;
    } catch (const std::exception& e) {
      LLAMA_LOG_ERROR("%s: OasisKV: %s\n", __func__, e.what());
    }
  }
}

}  // namespace llama_oasis

using namespace llama_oasis;

llama_memory_i* llama_memory_oasis_create(const llama_model& model,
                                          const llama_memory_params& params,
                                          const llama_cparams& cparams) {
  const llama_hparams& hp = model.hparams;
  const auto refuse = [&](const std::string& why) {
    throw std::runtime_error("OasisKV (--oasis-budget " + std::to_string(params.oasis_budget) +
                             "): " + why);
  };

  switch (model.arch) {
    case LLM_ARCH_LLAMA:
    case LLM_ARCH_QWEN2:
    case LLM_ARCH_QWEN3:
    case LLM_ARCH_SMOLLM3:
    case LLM_ARCH_MISTRAL3:
    case LLM_ARCH_GRANITE:
      break;
    default:
      refuse(std::string("the ") + llm_arch_name(model.arch) +
             " architecture is not supported (llama, qwen2, qwen3, smollm3, mistral3 and granite "
             "are)");
  }
  if (params.ctx_type != LLAMA_CONTEXT_TYPE_DEFAULT) {
    refuse("only a default context (no MTP head) can use it");
  }
  if (hp.swa_type != LLAMA_SWA_TYPE_NONE || hp.n_layer_nextn > 0 || hp.use_alibi ||
      hp.attn_soft_cap) {
    refuse("the model has sliding-window, next-token-prediction, ALiBi or soft-capped attention");
  }
  if (hp.n_pos_per_embd() != 1) {
    refuse("the model takes several positions per token (M-RoPE)");
  }
  if (!cparams.causal_attn) {
    refuse("attention is not causal");
  }
  for (uint32_t il = 0; il < hp.n_layer(); ++il) {
    if (hp.n_head(il) != hp.n_head(0) || hp.n_head_kv(il) != hp.n_head_kv(0) ||
        hp.n_embd_head_k(il) != hp.n_embd_head_k(0) ||
        hp.n_embd_head_v(il) != hp.n_embd_head_k(0)) {
      refuse("the layers' attention heads differ in number or size");
    }
  }
  oasiskv_bridge::kv_dtype dtype;
  if (params.type_k != params.type_v) {
    refuse("K and V must have one type (--cache-type-k, --cache-type-v)");
  }
  switch (params.type_k) {
    case GGML_TYPE_F16:
      dtype = oasiskv_bridge::kv_dtype::f16;
      break;
    case GGML_TYPE_BF16:
      dtype = oasiskv_bridge::kv_dtype::bf16;
      break;
    case GGML_TYPE_F32:
      dtype = oasiskv_bridge::kv_dtype::f32;
      break;
    default:
      refuse(std::string("the cache type ") + ggml_type_name(params.type_k) +
             " is not supported (f16, bf16, f32 are)");
  }

  oasiskv_bridge::cache_config c;
  c.layers = hp.n_layer();
  c.q_heads = hp.n_head(0);
  c.kv_heads = hp.n_head_kv(0);
  c.head_dim = hp.n_embd_head_k(0);
  c.dtype = dtype;
  c.block_tokens = block_tokens;
  c.budget_tokens = params.oasis_budget;
  c.max_tokens = cparams.n_ctx_seq;
  c.max_sequences = std::max(1u, cparams.n_seq_max);
  c.capacity = params.oasis_capacity && *params.oasis_capacity ? params.oasis_capacity : "host";
  c.summary = params.oasis_summary && *params.oasis_summary ? params.oasis_summary : "int2";
  if (c.budget_tokens < 2 * block_tokens) {
    refuse("a budget below " + std::to_string(2 * block_tokens) +
           " tokens (a sink and a recent block of " + std::to_string(block_tokens) + ")");
  }

  std::unique_ptr<oasiskv_bridge::cache> cache;
  try {
    cache = oasiskv_bridge::cache::create(c);
  } catch (const std::exception& e) {
    refuse(e.what());
  }
  const oasiskv_bridge::cache_report r = cache->report();
  LLAMA_LOG_INFO(
      "%s: OasisKV: %u tokens per sequence and layer, %s capacity tier, %s summary, "
      "%u sequences of %u tokens, staging pool %.2f MiB\n",
      __func__, c.budget_tokens, c.capacity.c_str(), c.summary.c_str(), c.max_sequences,
      c.max_tokens, r.fast_bytes / 1048576.0);

  return new llama_memory_oasis(model, cparams, std::move(cache), params.type_k);
}
