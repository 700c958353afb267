// SPDX-License-Identifier: Apache-2.0
//
// The parts of OasisKV's llama.cpp memory that its sources share (llama-memory-oasis.h is the
// interface the patched llama.cpp sees): the memory type, its batch context and its graph
// input. llama-memory-oasis.cpp plans and applies batches, llama-memory-oasis-seq.cpp has the
// sequence operations, llama-memory-oasis-graph.cpp the graph and its custom operations.
#pragma once

#include "llama-batch.h"
#include "llama-graph.h"
#include "llama-memory-oasis.h"
#include "llama-memory.h"
#include "oasiskv-bridge.h"

#include <atomic>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

struct llama_cparams;
struct llama_model;

namespace llama_oasis {

using oasiskv_bridge::seq_t;

inline constexpr uint32_t max_query_tokens = 16;  // OasisKV attends 1 to 16 new tokens per sequence
inline constexpr uint32_t block_tokens = 16;
inline constexpr uint32_t kv_pad = 256;  // the stock cache pads the cells attention reads to this
// whether op_read transposes V: the last operation parameter, past the custom op's own
inline constexpr int v_trans_param = GGML_MAX_OP_PARAMS / sizeof(int32_t) - 1;

// The graph a ubatch gets: attention through OasisKV (every sequence brings at most 16 tokens,
// each sequence's attending tokens are its last ones), or dense attention over the cells read
// back from the cache.
struct oasis_shape {
  bool decode = false;
  uint32_t n_kv_pad = 0;  // dense: cells read back (the sequences' tokens), padded
};

// A sequence of the ubatch: the tokens appended to it, and those that attend as its own (their
// first sequence id is this one).
struct oasis_target {
  llama_seq_id id = -1;
  seq_t h = 0;
  uint32_t before = 0;        // tokens it held before the ubatch
  std::vector<uint32_t> tok;  // ubatch indices of its tokens, in position order
  std::vector<uint32_t> own;  // those whose first sequence id it is
  // >= 0: takes that target's tokens and held its blocks: not written, forked from it after
  int32_t alias = -1;
  uint32_t offset = 0;  // dense: first cell read back
};

// The ubatch being computed, as the custom operations see it.
struct oasis_step {
  oasis_shape shape;
  std::vector<oasis_target> targets;
  std::vector<int32_t> first_of;  // [n_tokens] the target each token attends as
  uint32_t n_kv = 0;              // dense: cells read back
  // targets written with equal token counts (one append each), and targets attending with
  // equal query counts (one attend and one lookahead each): (count, target indices)
  std::vector<std::pair<uint32_t, std::vector<size_t>>> appends, attends;
};

// The CPU backend's threads of one custom operation, lent to OasisKV's kernel
// (oasiskv_bridge::team): thread 0 calls the cache, the others serve the work it hands out until
// it closes the operation. An operation is named by a ticket that every thread computes alike
// (the graph computation's number and the layer), so a thread that arrives late, or after the
// end, never waits for an operation that is over.
class op_team final : public oasiskv_bridge::team {
 public:
  unsigned size() const override { return size_; }
  void run(std::size_t n, void (*fn)(void* ctx, std::size_t i), void* ctx) override;

  // thread 0
  void open(unsigned threads) { size_ = threads; }
  void close(uint64_t ticket) { done_.store(ticket, std::memory_order_release); }
  // the other threads: until the operation of `ticket` is closed
  void serve(uint64_t ticket);

 private:
  bool claim(std::size_t& item);
  void work(std::size_t item);

  static constexpr unsigned bits = 22;
  static constexpr uint64_t mask = (uint64_t{1} << bits) - 1;
  std::atomic<uint64_t> word_{0};  // the job: [generation:20][items:22][next item:22]
  std::atomic<uint64_t> done_{0};  // the last closed ticket
  std::atomic<std::size_t> remaining_{0};
  void (*fn_)(void*, std::size_t) = nullptr;  // written before word_ publishes a job
  void* ctx_ = nullptr;
  uint64_t generation_ = 0;
  unsigned size_ = 1;
  std::mutex failure_mutex_;
  std::exception_ptr failure_;  // the first exception of a job's items
};

class llama_memory_oasis;

// What one layer's custom operations reach (stable for the life of the memory).
struct oasis_layer_op {
  llama_memory_oasis* mem = nullptr;
  uint32_t layer = 0;
  float q_factor = 1.0f;  // the model's softmax scale over the cache's
};

class llama_memory_oasis : public llama_memory_i {
 public:
  llama_memory_oasis(const llama_model& model, const llama_cparams& cparams,
                     std::unique_ptr<oasiskv_bridge::cache> cache, ggml_type type);

  ~llama_memory_oasis() override;  // logs what the cache did

  // llama_memory_i

  llama_memory_context_ptr init_batch(llama_batch_allocr& balloc, uint32_t n_ubatch,
                                      bool embd_all) override;
  llama_memory_context_ptr init_full() override;
  llama_memory_context_ptr init_update(llama_context* lctx, bool optimize) override;

  // keys are stored rotated; positions never move
  bool get_can_shift() const override { return false; }

  void clear(bool data) override;

  bool seq_rm(llama_seq_id seq_id, llama_pos p0, llama_pos p1) override;
  void seq_cp(llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0,
              llama_pos p1) override;
  void seq_keep(llama_seq_id seq_id) override;
  void seq_add(llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos shift) override;
  void seq_div(llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d) override;

  llama_pos seq_pos_min(llama_seq_id seq_id) const override;
  llama_pos seq_pos_max(llama_seq_id seq_id) const override;

  std::map<ggml_backend_buffer_type_t, size_t> memory_breakdown() const override;

  // refused: OasisKV saves no state (they throw, and llama.cpp reports the failed call)
  [[noreturn]] void state_write(llama_io_write_i& io, llama_seq_id seq_id = -1,
                                llama_state_seq_flags flags = 0) const override;
  [[noreturn]] void state_read(llama_io_read_i& io, llama_seq_id seq_id = -1,
                               llama_state_seq_flags flags = 0) override;

  // for the batch context and the graph

  oasis_shape reserve_shape(const llama_ubatch& ub) const;
  bool apply(const llama_ubatch& ub, const oasis_shape& shape);
  void fill_mask(ggml_tensor* mask, const llama_ubatch& ub) const;

  // the custom operations (run by the CPU backend's threads)
  static void op_decode(ggml_tensor* dst, int ith, int nth, void* userdata);
  static void op_store(ggml_tensor* dst, int ith, int nth, void* userdata);
  static void op_read(ggml_tensor* dst, int ith, int nth, void* userdata);

  const uint32_t n_layer;
  const uint32_t n_head;
  const uint32_t n_head_kv;
  const uint32_t head_dim;
  const ggml_type type;
  const size_t type_size;
  const float base_scale;  // the cache's softmax scale, 1/sqrt(head_dim)

  std::vector<oasis_layer_op> layer_ops;  // [n_layer], declared after what the ops use

  uint64_t compute = 0;  // graph computations so far (each names its operations' tickets)
  op_team team;          // the backend's threads of the decode operation running

 private:
  struct oasis_seq {
    bool used = false;
    seq_t h = 0;
    uint32_t n = 0;  // tokens (positions [0, n))
  };

  enum class plan_result { ok, split_by_sequence, no_room, invalid };

  plan_result plan(const std::vector<llama_ubatch>& ubatches, std::vector<oasis_shape>& shapes,
                   std::string& why) const;

  bool valid_seq(llama_seq_id s) const { return s >= 0 && (uint32_t)s < n_seq_max; }
  void drop(llama_seq_id s);
  bool rm_one(llama_seq_id s, llama_pos p0, llama_pos p1);
  void resync();
  void fail(const char* what);
  bool failed() const { return failed_.load(std::memory_order_acquire); }

  void append_targets(const ggml_tensor* k, const ggml_tensor* v, uint32_t layer);
  void finish_ubatch();
  void rows_f32(const ggml_tensor* t, uint32_t tok, float factor, float* out) const;
  void rows_kv(const ggml_tensor* t, uint32_t tok, uint8_t* out) const;

  const uint32_t n_seq_max;
  const uint32_t max_tokens;  // per sequence

  std::unique_ptr<oasiskv_bridge::cache> cache;
  std::vector<oasis_seq> seqs;  // [n_seq_max]

  oasis_step step;

  // a failure inside a custom operation, reported by the next apply()
  std::atomic<bool> failed_{false};
  std::mutex failure_mutex;
  std::string failure;

  // scratch of the operations (thread 0 only)
  std::vector<float> qbuf, obuf;
  std::vector<uint8_t> kbuf, vbuf;
  std::vector<seq_t> hbuf;
};

class llama_memory_oasis_context : public llama_memory_context_i {
 public:
  explicit llama_memory_oasis_context(llama_memory_status status) : status(status) {}

  // the worst case, for reserving the graphs
  explicit llama_memory_oasis_context(llama_memory_oasis* mem)
      : mem(mem), status(LLAMA_MEMORY_STATUS_SUCCESS) {}

  llama_memory_oasis_context(llama_memory_oasis* mem, std::vector<llama_ubatch> ubatches,
                             std::vector<oasis_shape> shapes)
      : mem(mem),
        ubatches(std::move(ubatches)),
        shapes(std::move(shapes)),
        status(LLAMA_MEMORY_STATUS_SUCCESS) {}

  bool next() override { return ++i_next < ubatches.size(); }

  bool apply() override { return mem->apply(ubatches[i_next], shapes[i_next]); }

  const llama_ubatch& get_ubatch() const override { return ubatches[i_next]; }

  llama_memory_status get_status() const override { return status; }

  oasis_shape shape(const llama_ubatch& ub) const {
    return ubatches.empty() ? mem->reserve_shape(ub) : shapes[i_next];
  }

  llama_memory_oasis* mem = nullptr;

 private:
  size_t i_next = 0;
  std::vector<llama_ubatch> ubatches;
  std::vector<oasis_shape> shapes;
  const llama_memory_status status;
};

// The attention input of an OasisKV graph: the dense ubatches' mask, nothing for decode.
class llm_graph_input_oasis : public llm_graph_input_attn_kv {
 public:
  llm_graph_input_oasis(const llama_hparams& hparams, const llama_cparams& cparams,
                        const llama_memory_oasis_context* mctx, oasis_shape shape,
                        uint32_t n_tokens)
      : llm_graph_input_attn_kv(hparams, cparams, nullptr),
        mctx_oasis(mctx),
        shape(shape),
        n_tokens(n_tokens) {}

  void set_input(const llama_ubatch* ubatch) override {
    ++mctx_oasis->mem->compute;  // a new computation of the graph
    if (self_kq_mask && self_kq_mask->buffer) {
      mctx_oasis->mem->fill_mask(self_kq_mask, *ubatch);
    }
  }

  bool can_reuse(const llm_graph_params& params) override {
    const auto* m = dynamic_cast<const llama_memory_oasis_context*>(params.mctx);
    if (m == nullptr) {
      return false;
    }
    mctx_oasis = m;
    const oasis_shape s = m->shape(params.ubatch);
    return s.decode == shape.decode && s.n_kv_pad == shape.n_kv_pad &&
           params.ubatch.n_tokens == n_tokens;
  }

  const llama_memory_oasis_context* mctx_oasis;
  const oasis_shape shape;
  const uint32_t n_tokens;
};

}  // namespace llama_oasis
