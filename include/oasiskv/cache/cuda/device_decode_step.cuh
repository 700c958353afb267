// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cuda::device_decode_step`: one decode step composed of the CUDA parts (a device
//! summary, the GPU selection, the gather, the sparse decode) and enqueued on one stream with no
//! host synchronisation, so that a CUDA graph can capture it and replay it.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <span>

#include "oasiskv/attention/cuda/sparse_decode.cuh"
#include "oasiskv/cache/cuda/detail/residency_kernel.cuh"
#include "oasiskv/cache/cuda/device_step_options.cuh"
#include "oasiskv/core/decode_params.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/selection.hpp"
#include "oasiskv/core/views.hpp"
#include "oasiskv/cuda/detail/runtime.cuh"
#include "oasiskv/predictor/cuda/topk_selector.cuh"
#include "oasiskv/summary/cuda/device_minmax_summary.cuh"
#include "oasiskv/summary/cuda/device_quantized_minmax_summary.cuh"
#include "oasiskv/transfer/cuda/gather_kernel.cuh"

namespace oasiskv::cuda {

//! @brief A decode step on the GPU with no host synchronisation: a thin composition of the CUDA
//! models of the concepts, for code that drives them directly. It exists beside
//! `tiered_kv_cache`, whose step predicts from host queries, stages through a `transfer_engine`
//! and synchronises (no CUDA graph can hold it), to give a step a CUDA graph can capture: every
//! decision the facade makes on the host (which blocks, which slots, which copies) is made here
//! on the device. It composes, and owns only the glue between them (the pinned staging area and
//! its device mirror, the residency kernel, the slot tags and the copy list):
//! - a `device_summary`, the caller's, kept current by the caller:
//! `device_quantized_minmax_summary`
//!   (int8 bounds, the one to prefer: the selection reads about 1/31 of the KV at 32k) or
//!   `device_minmax_summary` (f16 bounds, 1/16);
//! - a `device_selector` (`topk_selector`), which also judges the `selection_params`;
//! - the gather of `transfer/cuda/` (`enqueue_gather`, the `copy_engine`'s kernel over a
//!   device-written list);
//! - a `sparse_attention_kernel` (`sparse_decode`, asynchronous).
//!
//! Each step enqueues on one stream, in order,
//!
//! 1. the copies of this step's host inputs from a pinned staging area (`seq_lens`, and the
//!    block maps `summary_ids` and `capacity_slots`, rows `0..num_seqs`) into device buffers;
//! 2. `topk_selector::select` over the summary with the lookahead queries, writing
//!    the step's block table (shared by the KV heads) with each block's staging slot, or
//!    `null_slot` where the block is not staged;
//! 3. the residency kernel (`detail::residency_kernel`): each sequence owns `budget_blocks`
//!    fast slots; a selected block already staged keeps its slot, every other selected block
//!    takes a slot no selected block holds (there are enough: the table has at most
//!    `budget_blocks` entries), and a copy is listed for each block whose slot does not hold it
//!    as it is now (slot tags record the block, its capacity slot and its token count, so a
//!    partial last block that grew is copied again). All decided on the device;
//! 4. `enqueue_gather` of the listed copies, capacity pool to fast pool;
//! 5. `sparse_decode` over the device table, lengths, `q`, `out`, `lse`.
//!
//! No `cudaStreamSynchronize`, no pageable copy, no read of device data on the host and no
//! allocation happen in `enqueue`: every buffer is allocated at construction for `max_seqs`,
//! `max_blocks`, the budget, `max_q_len` and `max_lookahead`. `capture` records the same
//! sequence into a `cudaGraphExec_t` that `replay` launches; between replays the host changes
//! the staging area (lengths, new blocks' entries) and the caller's device buffers (queries).
//!
//! The caller's contract: write the staging area only when no step that reads it is pending
//! (`wait_staging`); a block's capacity copy changes only by appending tokens (then the step
//! copies it again), else call `invalidate`; a sequence's summary entries are up to date before
//! its step; steps of one object are ordered (one stream, or events between streams). Argument
//! errors, and with `check_staging` bad staging entries, are `oasiskv::error`s thrown before
//! anything is enqueued; without `check_staging` the caller guarantees summary ids in range (the
//! scoring kernel reads them unchecked), and a sequence longer than `max_blocks` or a capacity
//! slot outside the pool is left out by the device and reported by `check_status`, as is a table
//! entry the decode kernel skipped. Thread-safe (calls are serialised).
class device_decode_step {
 public:
  using options = device_decode_step_options;
  using io = device_decode_step_io;

  //! @brief Checks the options against the summary's layout without touching the driver: the
  //! selection as `topk_selector::validate` judges it, then the step's own sizes, pools and
  //! slots. Throws `oasiskv::error` naming the offending value.
  static void validate(const options& o, const kv_layout& layout) {
    layout.validate();
    topk_selector::validate(layout, o.selection);
    if (o.max_seqs == 0 || o.max_seqs > 65535) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument,
                             "device_decode_step_options.max_seqs = ", o.max_seqs,
                             " must be in [1, 65535]");
    }
    if (o.max_blocks == 0) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "device_decode_step_options.max_blocks is 0");
    }
    const selection_params& sp = o.selection;
    if (sp.budget_blocks == 0 || sp.budget_blocks > max_step_budget) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument,
                             "selection_params.budget_blocks = ", sp.budget_blocks,
                             " must be in [1, ", max_step_budget, "]");
    }
    if (o.max_q_len == 0 || o.max_q_len > max_query_tokens) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument,
                             "device_decode_step_options.max_q_len = ", o.max_q_len,
                             " must be in [1, 16]");
    }
    if (o.max_lookahead == 0 || o.max_lookahead > max_query_tokens) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument,
                             "device_decode_step_options.max_lookahead = ", o.max_lookahead,
                             " must be in [1, 16]");
    }
    if (!std::isfinite(o.scale)) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "device_decode_step_options.scale = ", o.scale,
                             " is not finite");
    }
    if (o.gather_ctas == 0) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "device_decode_step_options.gather_ctas is 0");
    }
    o.fast.validate();
    o.capacity.validate();
    if (!(o.fast.layout == layout) || !(o.capacity.layout == layout)) [[unlikely]] {
      oasiskv::detail::raise(errc::layout_mismatch,
                             "cuda::device_decode_step: the fast and capacity pools' layouts "
                             "must be the summary's");
    }
    const std::uint64_t slots = std::uint64_t{o.max_seqs} * sp.budget_blocks;
    if (std::uint64_t{o.first_slot} + slots > o.fast.num_slots) [[unlikely]] {
      oasiskv::detail::raise(errc::out_of_range,
                             "device_decode_step_options.first_slot = ", o.first_slot, " + ",
                             o.max_seqs, " sequences x ", sp.budget_blocks,
                             " staging slots exceed the fast pool's ", o.fast.num_slots, " slots");
    }
  }

  //! @brief Checks one step's shape and pointers (null, alignment) against the options without
  //! touching the driver. Throws `oasiskv::error` naming the offending value.
  static void validate(const options& o, const io& x) {
    if (x.num_seqs == 0 || x.num_seqs > o.max_seqs) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument,
                             "device_decode_step_io.num_seqs = ", x.num_seqs,
                             " must be in [1, max_seqs = ", o.max_seqs, "]");
    }
    if (x.q_len == 0 || x.q_len > o.max_q_len) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "device_decode_step_io.q_len = ", x.q_len,
                             " must be in [1, max_q_len = ", o.max_q_len, "]");
    }
    if (x.lookahead_tokens == 0 || x.lookahead_tokens > o.max_lookahead) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument,
                             "device_decode_step_io.lookahead_tokens = ", x.lookahead_tokens,
                             " must be in [1, max_lookahead = ", o.max_lookahead, "]");
    }
    auto need = [](const void* p, std::size_t align, const char* name) {
      if (p == nullptr) [[unlikely]] {
        oasiskv::detail::raise(errc::invalid_argument, "device_decode_step_io.", name, " is null");
      }
      if (reinterpret_cast<std::uintptr_t>(p) % align != 0) [[unlikely]] {
        oasiskv::detail::raise(errc::misaligned, "device_decode_step_io.", name, " = ", p,
                               " is not ", align, "-byte aligned");
      }
    };
    need(x.q, 16, "q");
    need(x.lookahead, alignof(float), "lookahead");
    need(x.out, alignof(float), "out");
    if (x.lse != nullptr) {
      need(x.lse, alignof(float), "lse");
    }
  }

  //! @brief Checks the host inputs of a step of `num_seqs` sequences and `q_len` query tokens
  //! in a staging area laid out as `device_step_staging_layout{o.max_seqs, o.max_blocks}`
  //! (`words`: the area), for a summary of `summary_capacity` entries, without touching the
  //! driver. Throws `oasiskv::error` naming the sequence, block and value.
  static void validate_staging(const options& o, std::uint32_t tokens_per_block,
                               std::uint32_t summary_capacity, const std::uint32_t* words,
                               std::uint32_t num_seqs, std::uint32_t q_len) {
    const device_step_staging_layout sl{o.max_seqs, o.max_blocks};
    for (std::uint32_t s = 0; s < num_seqs; ++s) {
      const std::uint32_t len = words[sl.lens_offset() + s];
      if (len < q_len) [[unlikely]] {
        oasiskv::detail::raise(errc::invalid_argument, "cuda::device_decode_step: seq_lens[", s,
                               "] = ", len, " is below q_len = ", q_len);
      }
      const std::uint64_t blocks = (std::uint64_t{len} + tokens_per_block - 1) / tokens_per_block;
      if (blocks > o.max_blocks) [[unlikely]] {
        oasiskv::detail::raise(errc::out_of_range, "cuda::device_decode_step: seq_lens[", s,
                               "] = ", len, " takes ", blocks,
                               " blocks, more than max_blocks = ", o.max_blocks);
      }
      const std::uint32_t* ids = words + sl.row(sl.ids_offset(), s);
      const std::uint32_t* caps = words + sl.row(sl.caps_offset(), s);
      for (std::uint32_t i = 0; i < blocks; ++i) {
        if (ids[i] >= summary_capacity) [[unlikely]] {
          oasiskv::detail::raise(errc::out_of_range, "cuda::device_decode_step: summary_ids(", s,
                                 ")[", i, "] = ", ids[i], " >= the summary's capacity ",
                                 summary_capacity);
        }
        if (caps[i] >= o.capacity.num_slots) [[unlikely]] {
          oasiskv::detail::raise(errc::invalid_slot, "cuda::device_decode_step: capacity_slots(", s,
                                 ")[", i, "] = ", caps[i], " >= the capacity pool's ",
                                 o.capacity.num_slots, " slots");
        }
      }
    }
  }

  //! @brief Allocates every buffer on the current device and checks the pools' memory kinds.
  //! The selection reads the int8 bounds of `summary` (about 1/31 of the KV at 128-dimension
  //! heads and 16-token blocks, against 1/16 for f16 bounds). `summary` must outlive the object.
  device_decode_step(const device_quantized_minmax_summary& summary, const options& o)
      : device_decode_step(nullptr, &summary, summary.layout(), o) {}
  //! @brief As above, the selection reading the f16 min/max bounds of `summary`.
  device_decode_step(const device_minmax_summary& summary, const options& o)
      : device_decode_step(&summary, nullptr, summary.layout(), o) {}
  device_decode_step(const device_decode_step&) = delete;
  device_decode_step& operator=(const device_decode_step&) = delete;
  ~device_decode_step() { drop_graph(); }

 private:
  device_decode_step(const device_minmax_summary* minmax,
                     const device_quantized_minmax_summary* quantized, const kv_layout& layout,
                     const options& o)
      : minmax_(minmax),
        quantized_(quantized),
        layout_(layout),
        options_(o),
        staging_layout_{o.max_seqs, o.max_blocks},
        selector_(selector_options(o)),
        decode_(decode_options(o)) {
    validate(options_, layout_);
    if (options_.scale == 0.0f) {
      options_.scale = 1.0f / std::sqrt(static_cast<float>(layout_.head_dim));
    }
    device_ = detail::current_device();
    detail::require_device_pointer(options_.fast.base, device_, "device_decode_step_options.fast");
    detail::require_device_pointer(last_byte(options_.fast), device_,
                                   "the last byte of device_decode_step_options.fast");
    require_readable(options_.capacity.base, "device_decode_step_options.capacity");
    require_readable(last_byte(options_.capacity),
                     "the last byte of device_decode_step_options.capacity");
    buffers_.allocate(options_, staging_layout_, layout_);
    const kv_layout& l = layout_;
    selector_.reserve(l, options_.max_seqs, options_.max_blocks, options_.max_lookahead);
    if (options_.decode_splits == 0) {
      sparse_decode_options probe = decode_.config();
      probe.expected_blocks = options_.selection.budget_blocks;
      options_.decode_splits = sparse_decode(probe).splits_for(options_.max_seqs, 1, l);
    }
    sparse_decode_options d = decode_.config();
    d.num_splits = options_.decode_splits;
    decode_ = sparse_decode(d);
    decode_.reserve(options_.max_seqs, options_.max_q_len, l);
  }

 public:
  //! @brief Whether the selection reads int8 bounds (a `device_quantized_minmax_summary`).
  bool int8_bounds() const noexcept { return quantized_ != nullptr; }

  //! @brief The options in effect (`scale` and `decode_splits` resolved).
  const options& config() const noexcept { return options_; }
  //! @brief Where the staging area's parts lie.
  const device_step_staging_layout& staging_layout() const noexcept { return staging_layout_; }

  //! @brief Pinned host memory: the tokens of each sequence, the `q_len` new ones included
  //! (their keys and values already in the capacity pool).
  std::span<std::uint32_t> seq_lens() noexcept {
    return {buffers_.host + staging_layout_.lens_offset(), options_.max_seqs};
  }
  //! @brief Pinned host memory: sequence `s`'s summary entry of each block (`max_blocks`).
  std::span<std::uint32_t> summary_ids(std::uint32_t s) {
    check_seq(s, "summary_ids");
    return {buffers_.host + staging_layout_.row(staging_layout_.ids_offset(), s),
            options_.max_blocks};
  }
  //! @brief Pinned host memory: sequence `s`'s capacity slot of each block (`max_blocks`).
  std::span<std::uint32_t> capacity_slots(std::uint32_t s) {
    check_seq(s, "capacity_slots");
    return {buffers_.host + staging_layout_.row(staging_layout_.caps_offset(), s),
            options_.max_blocks};
  }

  //! @brief Device memory: the last step's block table (`[num_seqs + 1]` offsets, then the
  //! refs), valid once the step finished; for inspection.
  const block_ref* device_refs() const noexcept { return buffers_.refs; }
  //! @brief Device memory: the last step's table offsets.
  const std::uint32_t* device_offsets() const noexcept { return buffers_.offsets; }
  //! @brief Device memory: how many blocks the last step copied into staging slots.
  const std::uint32_t* device_copy_count() const noexcept { return buffers_.pair_count; }

  //! @brief Enqueues one step on `stream` (see the class). Validates everything first;
  //! capturable when `stream` is being captured by the caller.
  void enqueue(const io& x, cudaStream_t stream) {
    check_io(x, true);
    std::lock_guard lock(mutex_);
    const cudaStreamCaptureStatus st = detail::capture_status(stream);
    if (st == cudaStreamCaptureStatusInvalidated) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument,
                             "cuda::device_decode_step::enqueue: the stream's capture was "
                             "invalidated");
    }
    enqueue_locked(x, stream, st == cudaStreamCaptureStatusNone);
  }

  //! @brief Captures one step of shape `x` on `stream` into a graph (replacing a previous one).
  //! `stream` must not be the legacy default stream nor be capturing already. Nothing runs.
  void capture(const io& x, cudaStream_t stream) {
    check_io(x, false);
    if (stream == nullptr || stream == cudaStreamLegacy) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument,
                             "cuda::device_decode_step::capture: the legacy default stream "
                             "cannot be captured; pass a created stream");
    }
    std::lock_guard lock(mutex_);
    if (detail::capture_status(stream) != cudaStreamCaptureStatusNone) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "cuda::device_decode_step::capture: stream ",
                             static_cast<const void*>(stream), " is being captured already");
    }
    detail::check(cudaStreamBeginCapture(stream, options_.capture_mode),
                  "cuda::device_decode_step: cudaStreamBeginCapture", errc::invalid_argument);
    cudaGraph_t graph = nullptr;
    try {
      enqueue_locked(x, stream, false);
    } catch (...) {
      (void)cudaStreamEndCapture(stream, &graph);
      (void)cudaGraphDestroy(graph);
      (void)cudaGetLastError();
      throw;
    }
    detail::check(cudaStreamEndCapture(stream, &graph),
                  "cuda::device_decode_step: cudaStreamEndCapture", errc::invalid_argument);
    cudaGraphExec_t exec = nullptr;
    const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
    (void)cudaGraphDestroy(graph);
    detail::check(e, "cuda::device_decode_step: cudaGraphInstantiate", errc::invalid_argument);
    drop_graph();
    exec_ = exec;
    captured_ = x;
  }

  //! @brief Whether a step has been captured.
  bool captured() const noexcept { return exec_ != nullptr; }
  //! @brief The shape and buffers the captured graph runs with.
  const io& captured_io() const noexcept { return captured_; }

  //! @brief Launches the captured graph on `stream`, after checking the staging area for the
  //! captured shape (`check_staging`).
  void replay(cudaStream_t stream) {
    std::lock_guard lock(mutex_);
    if (exec_ == nullptr) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument,
                             "cuda::device_decode_step::replay: nothing was captured");
    }
    if (options_.check_staging) {
      validate_staging(options_, layout_.tokens_per_block, summary_capacity(), buffers_.host,
                       captured_.num_seqs, captured_.q_len);
    }
    detail::check(cudaGraphLaunch(exec_, stream), "cuda::device_decode_step: cudaGraphLaunch");
    if (detail::capture_status(stream) == cudaStreamCaptureStatusNone) {
      detail::check(cudaEventRecord(buffers_.staging_read, stream),
                    "cuda::device_decode_step: cudaEventRecord");
    }
  }

  //! @brief Blocks until the staging area is no longer read: until the staging copies of the
  //! last `enqueue` (made outside a capture) are done, or the whole graph of the last `replay`.
  //! Then the host may write the next step's inputs, while the rest of an enqueued step runs.
  void wait_staging() {
    detail::check(cudaEventSynchronize(buffers_.staging_read),
                  "cuda::device_decode_step: waiting for the staging copies");
  }

  //! @brief Enqueues on `stream` the forgetting of every staged block (each is copied again
  //! when next selected): needed when a capacity copy changed other than by appending tokens,
  //! or a capacity slot was reused with the same token count. Capturable.
  void invalidate(cudaStream_t stream) {
    std::lock_guard lock(mutex_);
    buffers_.clear_residency(options_, stream);
  }

  //! @brief Synchronises `stream` and throws what the device found since the last check: a
  //! sequence longer than `max_blocks` (`errc::out_of_range`), a capacity slot outside the pool
  //! (`errc::invalid_slot`; that block was left out of the table), a bad table entry or length
  //! the decode kernel skipped. Clears the flags.
  void check_status(cudaStream_t stream) {
    std::lock_guard lock(mutex_);
    detail::check(cudaStreamSynchronize(stream), "cuda::device_decode_step: the step");
    std::uint32_t bad = 0;
    detail::check(cudaMemcpy(&bad, buffers_.status, sizeof(bad), cudaMemcpyDeviceToHost),
                  "cuda::device_decode_step: reading the status word");
    if (bad != 0) [[unlikely]] {
      detail::check(cudaMemset(buffers_.status, 0, sizeof(bad)),
                    "cuda::device_decode_step: clearing the status word");
      detail::check(cudaDeviceSynchronize(), "cuda::device_decode_step: clearing the status");
      oasiskv::detail::raise(errc::invalid_slot,
                             "cuda::device_decode_step: a capacity_slots entry names a slot "
                             "outside the capacity pool (the block was left out)");
    }
    selector_.set_stream(stream);
    selector_.check_status();
    decode_.set_stream(stream);
    decode_.check_device_status();
  }

 private:
  struct buffers {
    std::uint32_t* host = nullptr;        // pinned staging area
    std::uint32_t* mirror = nullptr;      // its device copy
    slot_id* staged = nullptr;            // [max_seqs][max_blocks]
    detail::slot_tag* tags = nullptr;     // [max_seqs][budget]
    block_ref* refs = nullptr;            // [max_seqs * budget]
    std::uint32_t* offsets = nullptr;     // [max_seqs + 1]
    uint2* pairs = nullptr;               // [max_seqs * budget]
    std::uint32_t* pair_count = nullptr;  // one word
    std::uint32_t* status = nullptr;      // one word
    float* lse = nullptr;                 // [max_seqs][max_q_len][num_q_heads]
    cudaEvent_t staging_read = nullptr;
    int device = -1;

    buffers() = default;
    buffers(const buffers&) = delete;
    buffers& operator=(const buffers&) = delete;
    ~buffers() {
      if (device < 0) {
        return;
      }
      int previous = -1;
      const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device &&
                            cudaSetDevice(device) == cudaSuccess;
      (void)cudaFreeHost(host);
      for (void* p :
           {static_cast<void*>(mirror), static_cast<void*>(staged), static_cast<void*>(tags),
            static_cast<void*>(refs), static_cast<void*>(offsets), static_cast<void*>(pairs),
            static_cast<void*>(pair_count), static_cast<void*>(status), static_cast<void*>(lse)}) {
        (void)cudaFree(p);
      }
      if (staging_read != nullptr) {
        (void)cudaEventDestroy(staging_read);
      }
      if (switched) {
        (void)cudaSetDevice(previous);
      }
    }

    template <class T>
    static void alloc(T*& p, std::size_t n, const char* what) {
      void* m = nullptr;
      detail::check(cudaMalloc(&m, std::max<std::size_t>(n, 1) * sizeof(T)), what,
                    errc::out_of_memory);
      p = static_cast<T*>(m);
    }

    void allocate(const options& o, const device_step_staging_layout& sl, const kv_layout& l) {
      device = detail::current_device();
      const std::size_t slots = std::size_t{o.max_seqs} * o.selection.budget_blocks;
      void* h = nullptr;
      detail::check(cudaHostAlloc(&h, sl.words() * 4, cudaHostAllocDefault),
                    "cuda::device_decode_step: the pinned staging area", errc::out_of_memory);
      host = static_cast<std::uint32_t*>(h);
      std::memset(host, 0, sl.words() * 4);
      alloc(mirror, sl.words(), "cuda::device_decode_step: the staging mirror");
      alloc(staged, std::size_t{o.max_seqs} * o.max_blocks, "cuda::device_decode_step: staged");
      alloc(tags, slots, "cuda::device_decode_step: slot tags");
      alloc(refs, slots, "cuda::device_decode_step: the block table");
      alloc(offsets, std::size_t{o.max_seqs} + 1, "cuda::device_decode_step: the offsets");
      alloc(pairs, slots, "cuda::device_decode_step: the copy list");
      alloc(pair_count, 1, "cuda::device_decode_step: the copy count");
      alloc(status, 1, "cuda::device_decode_step: the status word");
      alloc(lse, std::size_t{o.max_seqs} * o.max_q_len * l.num_q_heads,
            "cuda::device_decode_step: lse");
      detail::check(cudaEventCreateWithFlags(&staging_read, cudaEventDisableTiming),
                    "cuda::device_decode_step: cudaEventCreate");
      detail::check(cudaMemset(mirror, 0, sl.words() * 4), "cuda::device_decode_step: cudaMemset");
      detail::check(cudaMemset(status, 0, 4), "cuda::device_decode_step: cudaMemset");
      clear_residency(o, nullptr);
      // Finished before the constructor returns: steps may run on a stream that does not wait
      // for the legacy default stream.
      detail::check(cudaStreamSynchronize(nullptr), "cuda::device_decode_step: clearing");
    }

    void clear_residency(const options& o, cudaStream_t stream) const {
      const std::size_t slots = std::size_t{o.max_seqs} * o.selection.budget_blocks;
      detail::check(
          cudaMemsetAsync(staged, 0xff, std::size_t{o.max_seqs} * o.max_blocks * sizeof(slot_id),
                          stream),
          "cuda::device_decode_step: clearing the staged map");
      detail::check(cudaMemsetAsync(tags, 0xff, slots * sizeof(detail::slot_tag), stream),
                    "cuda::device_decode_step: clearing the slot tags");
    }
  };

  static topk_selector::options selector_options(const options& o) {
    topk_selector::options s;
    s.aggregation = o.aggregation;
    s.check_pointers = false;  // checked by the step
    return s;
  }
  static sparse_decode_options decode_options(const options& o) {
    sparse_decode_options d;
    d.asynchronous = true;
    d.check_pointers = false;  // checked by the step
    d.num_splits = o.decode_splits;
    return d;
  }

  static const std::byte* last_byte(const block_pool_view& v) noexcept {
    return v.base + (std::size_t{v.num_slots} * v.slot_stride - 1);
  }

  static void require_readable(const void* p, const char* what) {
    const detail::pointer_info info = detail::query_pointer(p);
    if (info.kind == detail::pointer_kind::unregistered_host) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, what, " = ", p,
                             " is pageable host memory: the gather reads it from the device, so "
                             "it must be pinned (cudaHostRegister, pinned_host_tier) or device "
                             "memory");
    }
    if (info.kind == detail::pointer_kind::pinned_host && info.device_address != p) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, what, " = ", p,
                             " is pinned host memory the device does not read at that address: "
                             "the gather reads it through the host pointer, so it must be mapped "
                             "(cudaHostRegisterMapped, as pinned_host_tier registers, or "
                             "cudaHostAlloc)");
    }
  }

  void check_seq(std::uint32_t s, const char* what) const {
    if (s >= options_.max_seqs) [[unlikely]] {
      oasiskv::detail::raise(errc::out_of_range, "cuda::device_decode_step::", what, ": sequence ",
                             s, " >= max_seqs = ", options_.max_seqs);
    }
  }

  // Everything `enqueue` (`staging`) and `capture` check before anything is enqueued. A capture
  // reads no staging (its graph does, at each replay, which checks it then).
  void check_io(const io& x, bool staging) const {
    validate(options_, x);
    if (staging && options_.check_staging) {
      validate_staging(options_, layout_.tokens_per_block, summary_capacity(), buffers_.host,
                       x.num_seqs, x.q_len);
    }
    if (options_.check_pointers) {
      detail::require_device_pointer(x.q, device_, "device_decode_step_io.q");
      detail::require_device_pointer(x.lookahead, device_, "device_decode_step_io.lookahead");
      detail::require_device_pointer(x.out, device_, "device_decode_step_io.out");
      if (x.lse != nullptr) {
        detail::require_device_pointer(x.lse, device_, "device_decode_step_io.lse");
      }
    }
    if (detail::current_device() != device_) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "cuda::device_decode_step: called on device ",
                             detail::current_device(), " but its buffers live on device ", device_);
    }
  }

  // `record`: mark the end of the staging copies with `staging_read` (not while capturing: an
  // event recorded in a capture cannot be waited on from the host).
  void enqueue_locked(const io& x, cudaStream_t stream, bool record) {
    const kv_layout& l = layout_;
    const device_step_staging_layout& sl = staging_layout_;
    const std::uint32_t budget = options_.selection.budget_blocks;
    const std::size_t rows = std::size_t{x.num_seqs} * options_.max_blocks * 4;
    auto copy = [&](std::size_t offset, std::size_t bytes, const char* what) {
      detail::check(cudaMemcpyAsync(buffers_.mirror + offset, buffers_.host + offset, bytes,
                                    cudaMemcpyHostToDevice, stream),
                    what);
    };
    copy(sl.lens_offset(), std::size_t{x.num_seqs} * 4, "cuda::device_decode_step: seq_lens");
    copy(sl.ids_offset(), rows, "cuda::device_decode_step: summary_ids");
    copy(sl.caps_offset(), rows, "cuda::device_decode_step: capacity_slots");
    if (record) {
      detail::check(cudaEventRecord(buffers_.staging_read, stream),
                    "cuda::device_decode_step: cudaEventRecord");
    }
    detail::check(cudaMemsetAsync(buffers_.pair_count, 0, 4, stream),
                  "cuda::device_decode_step: clearing the copy count");

    const std::uint32_t* lens = buffers_.mirror + sl.lens_offset();
    topk_request r;
    r.queries = x.lookahead;
    r.num_tokens = x.lookahead_tokens;
    r.seq_lens = lens;
    r.summary_ids = buffers_.mirror + sl.ids_offset();
    r.staged_slots = buffers_.staged;
    r.refs = buffers_.refs;
    r.offsets = buffers_.offsets;
    r.num_seqs = x.num_seqs;
    r.max_blocks = options_.max_blocks;
    r.params = options_.selection;
    selector_.set_stream(stream);
    if (quantized_ != nullptr) {
      selector_.select(*quantized_, r);
    } else {
      selector_.select(*minmax_, r);
    }

    detail::residency_args a;
    a.refs = buffers_.refs;
    a.offsets = buffers_.offsets;
    a.seq_lens = lens;
    a.capacity_slots = buffers_.mirror + sl.caps_offset();
    a.staged = buffers_.staged;
    a.tags = buffers_.tags;
    a.pairs = buffers_.pairs;
    a.pair_count = buffers_.pair_count;
    a.status = buffers_.status;
    a.max_blocks = options_.max_blocks;
    a.budget = budget;
    a.tokens_per_block = l.tokens_per_block;
    a.capacity_slots_total = options_.capacity.num_slots;
    a.first_slot = options_.first_slot;
    detail::residency_kernel<><<<x.num_seqs, detail::residency_threads,
                                 2 * std::size_t{budget} * sizeof(std::uint32_t), stream>>>(a);
    detail::check(cudaGetLastError(), "cuda::device_decode_step: residency launch",
                  errc::invalid_argument);

    gather_args g;
    g.src = options_.capacity.base;
    g.src_stride = options_.capacity.slot_stride;
    g.dst = options_.fast.base;
    g.dst_stride = options_.fast.slot_stride;
    g.block_bytes = l.block_bytes();
    g.pairs = buffers_.pairs;
    g.count = buffers_.pair_count;
    g.max_count = x.num_seqs * budget;
    enqueue_gather(g, options_.gather_ctas, stream);

    decode_params p;
    p.q = x.q;
    p.pool = options_.fast;
    p.table = {buffers_.refs, buffers_.offsets, x.num_seqs, 1};
    p.seq_lens = lens;
    p.out = x.out;
    p.lse = x.lse != nullptr ? x.lse : buffers_.lse;
    p.num_seqs = x.num_seqs;
    p.q_len = x.q_len;
    p.scale = options_.scale;
    decode_.set_stream(stream);
    decode_.decode(p);
  }

  void drop_graph() noexcept {
    if (exec_ != nullptr) {
      (void)cudaGraphExecDestroy(exec_);
      exec_ = nullptr;
    }
  }

  // The summary's entries may grow (its capacity is read at each check).
  std::uint32_t summary_capacity() const noexcept {
    return quantized_ != nullptr ? quantized_->capacity() : minmax_->capacity();
  }

  const device_minmax_summary* minmax_ = nullptr;  // one of the two is set
  const device_quantized_minmax_summary* quantized_ = nullptr;
  kv_layout layout_{};
  options options_;
  device_step_staging_layout staging_layout_;
  topk_selector selector_;
  sparse_decode decode_;
  buffers buffers_;
  int device_ = -1;
  cudaGraphExec_t exec_ = nullptr;
  io captured_{};
  std::mutex mutex_;
};

}  // namespace oasiskv::cuda
