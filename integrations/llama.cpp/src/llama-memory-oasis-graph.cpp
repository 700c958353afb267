// SPDX-License-Identifier: Apache-2.0
// OasisKV as llama.cpp's KV cache: the graph hooks, the dense ubatches' mask and the custom
// operations that append, attend and read back through the cache.
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
#include <thread>

namespace llama_oasis {

//
// op_team
//

namespace {
void cpu_relax(unsigned& spins) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
  // a long wait (thread 0 reading a missed block from a file): let other work have the core
  if (++spins % 4096 == 0) {
    std::this_thread::yield();
  }
}
}  // namespace

bool op_team::claim(std::size_t& item) {
  uint64_t w = word_.load(std::memory_order_acquire);
  while ((w & mask) < ((w >> bits) & mask)) {
    if (word_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel,
                                    std::memory_order_acquire)) {
      item = (std::size_t)(w & mask);
      return true;
    }
  }
  return false;
}

void op_team::work(std::size_t item) {
  try {
    fn_(ctx_, item);
  } catch (...) {
    std::lock_guard<std::mutex> lock(failure_mutex_);
    if (!failure_) {
      failure_ = std::current_exception();
    }
  }
  remaining_.fetch_sub(1, std::memory_order_acq_rel);
}

void op_team::run(std::size_t n, void (*fn)(void* ctx, std::size_t i), void* ctx) {
  GGML_ASSERT(n < mask);
  fn_ = fn;
  ctx_ = ctx;
  failure_ = nullptr;
  remaining_.store(n, std::memory_order_relaxed);
  generation_ = (generation_ + 1) & ((uint64_t{1} << (64 - 2 * bits)) - 1);
  word_.store((generation_ << (2 * bits)) | (uint64_t{n} << bits), std::memory_order_release);
  std::size_t item;
  while (claim(item)) {
    work(item);
  }
  unsigned spins = 0;
  while (remaining_.load(std::memory_order_acquire) != 0) {
    cpu_relax(spins);
  }
  if (failure_) {
    std::rethrow_exception(failure_);
  }
}

void op_team::serve(uint64_t ticket) {
  unsigned spins = 0;
  while (done_.load(std::memory_order_acquire) < ticket) {
    std::size_t item;
    if (claim(item)) {
      work(item);
    } else {
      cpu_relax(spins);
    }
  }
}

void llama_memory_oasis::fill_mask(ggml_tensor* mask, const llama_ubatch& ub) const {
  GGML_ASSERT(ggml_backend_buffer_is_host(mask->buffer));
  const int64_t n_kv = mask->ne[0];

  auto fill = [&](auto* data, auto zero, auto ninf) {
    for (uint32_t i = 0; i < ub.n_tokens; ++i) {
      auto* row = data + i * n_kv;
      std::fill(row, row + n_kv, ninf);
      const oasis_target& t = step.targets[step.first_of[i]];
      // the token sees the cells of its sequence up to its own position
      std::fill(row + t.offset, row + t.offset + ub.pos[i] + 1, zero);
    }
  };

  if (mask->type == GGML_TYPE_F16) {
    fill((ggml_fp16_t*)mask->data, ggml_fp32_to_fp16(0.0f), ggml_fp32_to_fp16(-INFINITY));
  } else {
    fill((float*)mask->data, 0.0f, -INFINITY);
  }
}

//
// the custom operations
//

// row `tok` of q (f32, [head_dim, heads, tokens]) times `factor`, as [heads][head_dim], rounded
// to the cache's type as the stock attention rounds it before its products with the keys (both
// the flash and the matrix path): OasisKV then differs from the stock cache by the order and
// precision of its sums only
void llama_memory_oasis::rows_f32(const ggml_tensor* t, uint32_t tok, float factor,
                                  float* out) const {
  const int64_t d = t->ne[0], heads = t->ne[1];
  for (int64_t h = 0; h < heads; ++h) {
    const char* src = (const char*)t->data + h * t->nb[1] + tok * t->nb[2];
    float* o = out + h * d;
    for (int64_t e = 0; e < d; ++e) {
      const float x = *(const float*)(src + e * t->nb[0]) * factor;
      switch (type) {
        case GGML_TYPE_F16:
          o[e] = ggml_fp16_to_fp32(ggml_fp32_to_fp16(x));
          break;
        case GGML_TYPE_BF16:
          o[e] = ggml_bf16_to_fp32(ggml_fp32_to_bf16(x));
          break;
        default:
          o[e] = x;
          break;
      }
    }
  }
}

// row `tok` of k or v (f32) in the cache's type, as [kv_heads][head_dim]; the conversion is the
// CPU backend's, as the stock cache's store does it
void llama_memory_oasis::rows_kv(const ggml_tensor* t, uint32_t tok, uint8_t* out) const {
  const int64_t d = t->ne[0], heads = t->ne[1];
  std::vector<float> tmp;
  for (int64_t h = 0; h < heads; ++h) {
    const char* src = (const char*)t->data + h * t->nb[1] + tok * t->nb[2];
    const float* row = (const float*)src;
    if (t->nb[0] != sizeof(float)) {
      tmp.resize(d);
      for (int64_t e = 0; e < d; ++e) {
        tmp[e] = *(const float*)(src + e * t->nb[0]);
      }
      row = tmp.data();
    }
    uint8_t* o = out + h * d * type_size;
    switch (type) {
      case GGML_TYPE_F16:
        ggml_cpu_fp32_to_fp16(row, (ggml_fp16_t*)o, d);
        break;
      case GGML_TYPE_BF16:
        ggml_cpu_fp32_to_bf16(row, (ggml_bf16_t*)o, d);
        break;
      default:
        std::memcpy(o, row, d * sizeof(float));
        break;
    }
  }
}

// every written sequence gets its tokens' K and V; sequences with equal counts in one call
void llama_memory_oasis::append_targets(const ggml_tensor* k, const ggml_tensor* v,
                                        uint32_t layer) {
  const size_t row = (size_t)n_head_kv * head_dim * type_size;
  for (const auto& [n, group] : step.appends) {
    kbuf.resize(group.size() * n * row);
    vbuf.resize(group.size() * n * row);
    hbuf.clear();
    size_t r = 0;
    for (size_t i : group) {
      const oasis_target& t = step.targets[i];
      hbuf.push_back(t.h);
      for (uint32_t tok : t.tok) {
        rows_kv(k, tok, kbuf.data() + r * row);
        rows_kv(v, tok, vbuf.data() + r * row);
        ++r;
      }
    }
    cache->append(hbuf.data(), (uint32_t)hbuf.size(), layer, kbuf.data(), vbuf.data(), (uint32_t)n);
  }
}

// decode: append, attend through OasisKV, and predict the next step's blocks from these queries
// (in speculative decoding, the verification queries of the drafted tokens)
void llama_memory_oasis::op_decode(ggml_tensor* dst, int ith, int nth, void* userdata) {
  auto& op = *static_cast<oasis_layer_op*>(userdata);
  auto& mem = *op.mem;
  const uint64_t ticket = mem.compute * mem.n_layer + op.layer + 1;
  if (ith != 0) {
    mem.team.serve(ticket);  // lend this thread to the attention kernel
    return;
  }
  mem.team.open((unsigned)nth);
  struct closer {
    op_team& team;
    uint64_t ticket;
    ~closer() { team.close(ticket); }
  } close{mem.team, ticket};
  const ggml_tensor* q = dst->src[0];
  const size_t q_row = (size_t)mem.n_head * mem.head_dim;
  if (mem.failed()) {
    std::memset(dst->data, 0, ggml_nbytes(dst));
    return;
  }
  try {
    mem.append_targets(dst->src[1], dst->src[2], op.layer);

    for (const auto& [q_len, group] : mem.step.attends) {
      mem.qbuf.resize(group.size() * q_len * q_row);
      mem.obuf.resize(mem.qbuf.size());
      mem.hbuf.clear();
      size_t r = 0;
      for (size_t i : group) {
        const oasis_target& t = mem.step.targets[i];
        mem.hbuf.push_back(t.h);
        for (uint32_t tok : t.own) {
          mem.rows_f32(q, tok, op.q_factor, mem.qbuf.data() + (r++) * q_row);
        }
      }
      const auto n = (uint32_t)mem.hbuf.size();
      mem.cache->attend(mem.hbuf.data(), n, op.layer, mem.qbuf.data(), (uint32_t)q_len,
                        mem.obuf.data(), nth > 1 ? &mem.team : nullptr);
      r = 0;
      for (size_t i : group) {
        for (uint32_t tok : mem.step.targets[i].own) {
          std::memcpy((char*)dst->data + tok * dst->nb[2], mem.obuf.data() + (r++) * q_row,
                      q_row * sizeof(float));
        }
      }
      mem.cache->lookahead(mem.hbuf.data(), n, op.layer, mem.qbuf.data(), (uint32_t)q_len,
                           nth > 1 ? &mem.team : nullptr);
    }

    if (op.layer + 1 == mem.n_layer) {
      mem.finish_ubatch();
    }
  } catch (const std::exception& e) {
    mem.fail(e.what());
    std::memset(dst->data, 0, ggml_nbytes(dst));
  }
}

// dense ubatch, part 1: append, and let the last queries of each sequence predict the first
// decode step's blocks
void llama_memory_oasis::op_store(ggml_tensor* dst, int ith, int nth, void* userdata) {
  GGML_UNUSED(nth);
  GGML_UNUSED(dst);
  if (ith != 0) {
    return;
  }
  auto& op = *static_cast<oasis_layer_op*>(userdata);
  auto& mem = *op.mem;
  if (mem.failed()) {
    return;
  }
  const ggml_tensor* q = dst->src[0];
  const size_t q_row = (size_t)mem.n_head * mem.head_dim;
  try {
    mem.append_targets(dst->src[1], dst->src[2], op.layer);

    for (const auto& t : mem.step.targets) {
      if (t.own.empty()) {
        continue;
      }
      const size_t n = std::min<size_t>(t.own.size(), max_query_tokens);
      mem.qbuf.resize(n * q_row);
      for (size_t j = 0; j < n; ++j) {
        mem.rows_f32(q, t.own[t.own.size() - n + j], op.q_factor, mem.qbuf.data() + j * q_row);
      }
      mem.cache->lookahead(&t.h, 1, op.layer, mem.qbuf.data(), (uint32_t)n, nullptr);
    }

    if (op.layer + 1 == mem.n_layer) {
      mem.finish_ubatch();
    }
  } catch (const std::exception& e) {
    mem.fail(e.what());
  }
}

// dense ubatch, part 2: the cells attention reads, back from the cache: K as
// [cells][kv_heads][head_dim], then V the same or transposed ([kv_heads][head_dim][cells])
void llama_memory_oasis::op_read(ggml_tensor* dst, int ith, int nth, void* userdata) {
  auto& op = *static_cast<oasis_layer_op*>(userdata);
  auto& mem = *op.mem;
  const oasis_step& st = mem.step;
  const size_t es = mem.type_size;
  const size_t n_kv_pad = st.shape.n_kv_pad;
  const size_t row = (size_t)mem.n_head_kv * mem.head_dim * es;
  const bool v_trans = dst->op_params[v_trans_param] != 0;
  char* kd = (char*)dst->data;
  char* vd = kd + n_kv_pad * row;

  if (ith == 0) {
    // the padding cells are masked; zeros keep NaN out of the products
    std::memset(kd + st.n_kv * row, 0, (n_kv_pad - st.n_kv) * row);
    if (!v_trans) {
      std::memset(vd + st.n_kv * row, 0, (n_kv_pad - st.n_kv) * row);
    } else {
      for (size_t r = 0; r < (size_t)mem.n_head_kv * mem.head_dim; ++r) {
        std::memset(vd + (r * n_kv_pad + st.n_kv) * es, 0, (n_kv_pad - st.n_kv) * es);
      }
    }
  }
  if (mem.failed()) {
    return;
  }

  // whole blocks of the attending sequences, split over the threads
  size_t n_items = 0;
  for (const auto& t : st.targets) {
    if (!t.own.empty()) {
      n_items += (t.before + t.tok.size() + block_tokens - 1) / block_tokens;
    }
  }
  const size_t first = n_items * ith / nth, last = n_items * (ith + 1) / nth;
  try {
    size_t item = 0;
    for (const auto& t : st.targets) {
      if (t.own.empty()) {
        continue;
      }
      const uint32_t len = t.before + (uint32_t)t.tok.size();
      for (uint32_t b = 0; b * block_tokens < len; ++b, ++item) {
        if (item < first || item >= last) {
          continue;
        }
        const uint32_t t0 = b * block_tokens, n = std::min(block_tokens, len - t0);
        const size_t cell = t.offset + t0;
        if (v_trans) {
          mem.cache->read(t.h, op.layer, t0, n, kd + cell * row, row, es, vd + cell * es, es,
                          n_kv_pad * es);
        } else {
          mem.cache->read(t.h, op.layer, t0, n, kd + cell * row, row, es, vd + cell * row, row, es);
        }
      }
    }
  } catch (const std::exception& e) {
    mem.fail(e.what());
  }
}

}  // namespace llama_oasis

using namespace llama_oasis;

llm_graph_input_attn_kv* llama_memory_oasis_build_attn_inp(const llm_graph_context& g) {
  const auto* mctx = dynamic_cast<const llama_memory_oasis_context*>(g.mctx);
  if (mctx == nullptr) {
    return nullptr;
  }
  const oasis_shape shape = mctx->shape(g.ubatch);
  auto inp =
      std::make_unique<llm_graph_input_oasis>(g.hparams, g.cparams, mctx, shape, g.ubatch.n_tokens);
  if (!shape.decode) {
    // flash attention takes an f16 mask
    inp->self_kq_mask =
        ggml_new_tensor_4d(g.ctx0, g.cparams.flash_attn ? GGML_TYPE_F16 : GGML_TYPE_F32,
                           shape.n_kv_pad, g.ubatch.n_tokens, 1, 1);
    ggml_set_input(inp->self_kq_mask);
    ggml_set_name(inp->self_kq_mask, "attn_inp_kq_mask");
    inp->self_kq_mask_cnv = inp->self_kq_mask;
  }
  return (llm_graph_input_attn_kv*)g.res->add_input(std::move(inp));
}

ggml_tensor* llama_memory_oasis_build_attn(const llm_graph_context& g, llm_graph_input_attn_kv* inp,
                                           ggml_tensor* wo, ggml_tensor* wo_b, ggml_tensor* wo_s,
                                           ggml_tensor* q_cur, ggml_tensor* k_cur,
                                           ggml_tensor* v_cur, ggml_tensor* kq_b,
                                           ggml_tensor* sinks, float kq_scale, int il) {
  auto* oi = dynamic_cast<llm_graph_input_oasis*>(inp);
  if (oi == nullptr) {
    return nullptr;
  }
  if (kq_b != nullptr || sinks != nullptr) {
    throw std::runtime_error(
        "OasisKV: the model's attention has a KQ bias or sinks, which OasisKV does not compute");
  }
  if (q_cur->type != GGML_TYPE_F32 || k_cur->type != GGML_TYPE_F32 ||
      v_cur->type != GGML_TYPE_F32) {
    throw std::runtime_error("OasisKV: the model's Q, K and V are not f32");
  }
  llama_memory_oasis& mem = *oi->mctx_oasis->mem;
  oasis_layer_op& op = mem.layer_ops.at(il);
  op.q_factor = kq_scale / mem.base_scale;

  ggml_context* ctx0 = g.ctx0;
  const int64_t n_tokens = q_cur->ne[2];

  ggml_build_forward_expand(g.gf, q_cur);
  ggml_build_forward_expand(g.gf, v_cur);
  ggml_build_forward_expand(g.gf, k_cur);

  ggml_tensor* cur;
  ggml_tensor* args[3] = {q_cur, k_cur, v_cur};
  if (oi->shape.decode) {
    cur = ggml_custom_4d(ctx0, GGML_TYPE_F32, mem.head_dim, mem.n_head, n_tokens, 1, args, 3,
                         llama_memory_oasis::op_decode, 1, &op);
    cur = ggml_reshape_2d(ctx0, cur, (int64_t)mem.head_dim * mem.n_head, n_tokens);
    ggml_build_forward_expand(g.gf, cur);
  } else {
    const bool v_trans = !g.cparams.flash_attn;
    const int64_t n_kv = oi->shape.n_kv_pad;
    const size_t es = mem.type_size;

    ggml_tensor* store = ggml_custom_4d(ctx0, GGML_TYPE_F32, 1, 1, 1, 1, args, 3,
                                        llama_memory_oasis::op_store, 1, &op);
    ggml_tensor* kv =
        ggml_custom_4d(ctx0, mem.type, (int64_t)mem.head_dim * mem.n_head_kv * n_kv, 2, 1, 1,
                       &store, 1, llama_memory_oasis::op_read, GGML_N_TASKS_MAX, &op);
    kv->op_params[v_trans_param] = v_trans ? 1 : 0;

    ggml_tensor* k = ggml_view_3d(ctx0, kv, mem.head_dim, mem.n_head_kv, n_kv, mem.head_dim * es,
                                  (size_t)mem.head_dim * mem.n_head_kv * es, 0);
    ggml_tensor* v =
        v_trans ? ggml_view_3d(ctx0, kv, n_kv, mem.n_head_kv, mem.head_dim,
                               (size_t)n_kv * mem.head_dim * es, n_kv * es, kv->nb[1])
                : ggml_view_3d(ctx0, kv, mem.head_dim, mem.n_head_kv, n_kv, mem.head_dim * es,
                               (size_t)mem.head_dim * mem.n_head_kv * es, kv->nb[1]);

    cur =
        g.build_attn_mha(q_cur, k, v, nullptr, oi->self_kq_mask, nullptr, nullptr, 0, kq_scale, il);
  }
  g.cb(cur, "kqv_out", il);

  if (wo) {
    cur = g.build_lora_mm(wo, cur, wo_s);
  }
  if (wo_b) {
    cur = ggml_add(ctx0, cur, wo_b);
  }
  return cur;
}
