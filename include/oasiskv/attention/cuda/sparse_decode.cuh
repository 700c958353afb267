// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cuda::sparse_decode`: block-sparse paged decode attention on the GPU (split-K
//! flash-decoding, GQA groups sharing each K/V load, 1-16 causal query tokens, f16/bf16/f32 KV
//! with f32 accumulation, head dims 64 and 128).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include "oasiskv/attention/cuda/detail/decode_kernels.cuh"
#include "oasiskv/attention/validate.hpp"
#include "oasiskv/concepts/sparse_attention_kernel.hpp"
#include "oasiskv/core/decode_params.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/cuda/detail/runtime.cuh"

namespace oasiskv::cuda {

//! @brief How `cuda::sparse_decode` runs.
struct sparse_decode_options {
  //! The stream the kernels go to (null: the legacy default stream).
  cudaStream_t stream = nullptr;
  //! false: `decode` waits for its kernels and rethrows a device fault or a bad table entry the
  //! kernel found, as the CPU kernels do (what `tiered_kv_cache` needs, since it releases the
  //! step's slots when `decode` returns). true: stream-ordered only. Always true while `stream`
  //! is being captured into a CUDA graph.
  bool asynchronous = false;
  //! Check with cudaPointerGetAttributes that every pointer of `decode_params` is device memory
  //! of the current device (a few microseconds per call).
  bool check_pointers = true;
  //! Copy the tables and lengths back and run `oasiskv::validate` on them before launching
  //! (synchronises: tests and debugging). Without it the kernel skips entries with a slot outside
  //! the pool or a block past the sequence's end and reports them (synchronous mode) afterwards.
  bool check_tables = false;
  //! Splits of each table (0: chosen from the multiprocessor count and the table size,
  //! `detail::choose_decode_splits`).
  std::uint32_t num_splits = 0;
  std::uint32_t max_splits = 32;
  //! Expected table size in blocks (0: unknown; `decode_host_tables` takes its tables' largest):
  //! caps the splits at one per `detail::min_blocks_per_split` blocks.
  std::uint32_t expected_blocks = 0;
  //! Read K and V through a double-buffered pipeline of asynchronous copies into shared memory
  //! (`detail::decode_pipelined_kernel`: the next tile's loads in flight while one is computed)
  //! instead of direct 16-byte loads into registers. Same results; which is faster has not been
  //! measured yet (no GPU run so far), so it is not the default.
  bool pipelined = false;
};

//! @brief Decode attention over staged blocks in device memory. Models `sparse_attention_kernel`.
//!
//! A CTA takes one (sequence, KV head, chunk of up to 8 query rows, split of the table's
//! entries): the GQA group's rows for the q_len new tokens share every K and V load; each split
//! keeps an online softmax in the exp2 domain and, when a table is split, a second kernel merges
//! the splits by log-sum-exp. The grid is fixed by what the host knows (sequences, KV heads,
//! q_len, splits); table sizes and lengths are read on the device, CTAs past a table's end
//! return at once, so one launch can be captured in a CUDA graph and replayed with tables that
//! the device rewrote (`cuda::select_blocks`). Copies share the workspace.
//!
//! `decode_params` must hold device pointers: q, the table's refs and offsets, seq_lens, out,
//! lse, and the pool. Shapes, alignment and (by default) pointer kinds are checked before any
//! launch, as `oasiskv::error`.
class sparse_decode {
 public:
  using options = sparse_decode_options;

  sparse_decode() : sparse_decode(options{}) {}
  explicit sparse_decode(options o)
      : options_(o), state_(std::make_shared<state>()), upload_(std::make_shared<uploads>()) {}

  const options& config() const noexcept { return options_; }
  void set_stream(cudaStream_t s) noexcept { options_.stream = s; }

  //! @brief See `sparse_attention_kernel`.
  void decode(const decode_params& p) const { decode_expecting(p, options_.expected_blocks); }

  //! @brief `decode` for callers that build the tables on the host, as `tiered_kv_cache` does:
  //! `p.table.refs`, `p.table.offsets` and `p.seq_lens` are host memory; they are copied on the
  //! kernel's stream into device buffers this kernel owns (pageable sources: the copy is done
  //! when the call returns, so the caller may reuse them). `q`, `out` and the pool are device
  //! memory; a null `lse` uses a device buffer of the kernel's. Not capturable (it copies).
  void decode_host_tables(const decode_params& p) const {
    if (p.table.offsets == nullptr || p.seq_lens == nullptr || p.table.refs == nullptr)
        [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument,
                             "cuda::sparse_decode::decode_host_tables: null table or seq_lens");
    }
    const std::size_t tables = std::size_t{p.num_seqs} * p.table.tables_per_seq;
    const std::size_t refs = p.table.offsets[tables];
    const std::size_t rows = std::size_t{p.num_seqs} * p.q_len * p.pool.layout.num_q_heads;
    std::lock_guard lock(upload_->mutex);
    upload_->reserve(refs * sizeof(block_ref), (tables + 1) * 4, p.num_seqs * 4,
                     p.lse == nullptr ? rows * sizeof(float) : 0);
    detail::check(cudaMemcpyAsync(upload_->refs.ptr, p.table.refs, refs * sizeof(block_ref),
                                  cudaMemcpyHostToDevice, options_.stream),
                  "cuda::sparse_decode: uploading table.refs");
    detail::check(cudaMemcpyAsync(upload_->offsets.ptr, p.table.offsets, (tables + 1) * 4,
                                  cudaMemcpyHostToDevice, options_.stream),
                  "cuda::sparse_decode: uploading table.offsets");
    detail::check(cudaMemcpyAsync(upload_->lens.ptr, p.seq_lens, p.num_seqs * 4,
                                  cudaMemcpyHostToDevice, options_.stream),
                  "cuda::sparse_decode: uploading seq_lens");
    decode_params d = p;
    d.table.refs = static_cast<const block_ref*>(upload_->refs.ptr);
    d.table.offsets = static_cast<const std::uint32_t*>(upload_->offsets.ptr);
    d.seq_lens = static_cast<const std::uint32_t*>(upload_->lens.ptr);
    if (d.lse == nullptr) {
      d.lse = static_cast<float*>(upload_->lse.ptr);
    }
    // The tables are on the host: their largest size caps the splits (unless the option says).
    std::uint32_t largest = 0;
    for (std::size_t t = 0; t < tables; ++t) {
      largest = std::max(largest, p.table.offsets[t + 1] - p.table.offsets[t]);
    }
    decode_expecting(d, options_.expected_blocks != 0 ? options_.expected_blocks : largest);
  }

  //! @brief Allocates what a decode of this shape needs, so that a later call can be captured
  //! in a CUDA graph (a capture may not allocate). Call on the device the decode will run on.
  void reserve(std::uint32_t num_seqs, std::uint32_t q_len, const kv_layout& layout) const {
    layout.validate();
    std::lock_guard lock(state_->mutex);
    const int device = detail::current_device();
    ensure_workspace(make_plan(num_seqs, q_len, layout, device, options_.expected_blocks),
                     layout.head_dim, false, device);
  }

  //! @brief The splits a decode of this shape uses.
  std::uint32_t splits_for(std::uint32_t num_seqs, std::uint32_t q_len,
                           const kv_layout& layout) const {
    std::lock_guard lock(state_->mutex);
    return make_plan(num_seqs, q_len, layout, detail::current_device(), options_.expected_blocks)
        .splits;
  }

  //! @brief Synchronises the stream and rethrows what the kernels found since the last check
  //! (asynchronous mode). Clears the device status word.
  void check_device_status() const {
    std::lock_guard lock(state_->mutex);
    if (state_->status != nullptr) {
      finish();
    }
  }

 private:
  // `decode` with the splits capped for tables of `expected` blocks.
  void decode_expecting(const decode_params& p, std::uint32_t expected) const {
    validate_shape(p);
    std::lock_guard lock(state_->mutex);
    const int device = detail::current_device();
    if (options_.check_pointers) {
      check_pointers(p, device);
    }
    if (options_.check_tables) {
      check_tables_on_host(p);
    }
    const bool capturing = detail::is_capturing(options_.stream);
    const plan pl = make_plan(p.num_seqs, p.q_len, p.pool.layout, device, expected);
    ensure_workspace(pl, p.pool.layout.head_dim, capturing, device);
    launch(p, pl);
    if (!options_.asynchronous && !capturing) {
      finish();
    }
  }

  struct state {
    std::mutex mutex;
    int device = -1;
    int sms = 0;
    float* workspace = nullptr;  // device: partial outputs and log-sum-exps of the splits
    std::size_t workspace_floats = 0;
    std::uint32_t* status = nullptr;       // device word
    std::uint32_t* status_host = nullptr;  // pinned copy
    state() = default;
    state(const state&) = delete;
    state& operator=(const state&) = delete;
    ~state() {
      if (device < 0) {
        return;
      }
      int previous = -1;
      const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device &&
                            cudaSetDevice(device) == cudaSuccess;
      (void)cudaFree(workspace);
      (void)cudaFree(status);
      (void)cudaFreeHost(status_host);
      if (switched) {
        (void)cudaSetDevice(previous);
      }
    }
  };
  // Device buffers of decode_host_tables, grown on demand.
  struct uploads {
    struct buffer {
      void* ptr = nullptr;
      std::size_t bytes = 0;
      void grow(std::size_t need) {
        if (need <= bytes) {
          return;
        }
        (void)cudaFree(ptr);
        ptr = nullptr;
        bytes = 0;
        detail::check(cudaMalloc(&ptr, need), "cuda::sparse_decode: allocating upload buffers",
                      errc::out_of_memory);
        bytes = need;
      }
    };
    std::mutex mutex;
    buffer refs, offsets, lens, lse;
    void reserve(std::size_t r, std::size_t o, std::size_t l, std::size_t s) {
      refs.grow(std::max<std::size_t>(r, 16));
      offsets.grow(o);
      lens.grow(l);
      if (s != 0) {
        lse.grow(s);
      }
    }
    uploads() = default;
    uploads(const uploads&) = delete;
    uploads& operator=(const uploads&) = delete;
    ~uploads() {
      (void)cudaFree(refs.ptr);
      (void)cudaFree(offsets.ptr);
      (void)cudaFree(lens.ptr);
      (void)cudaFree(lse.ptr);
    }
  };

  struct plan {
    std::uint32_t rows = 1, rows_per_cta = 1, row_chunks = 1, splits = 1;
    std::size_t out_rows = 0;  // num_seqs * q_len * num_q_heads
  };

  static void validate_shape(const decode_params& p) {
    p.pool.validate();
    const kv_layout& l = p.pool.layout;
    if (l.head_dim != 64 && l.head_dim != 128) [[unlikely]] {
      oasiskv::detail::raise(errc::unsupported, "cuda::sparse_decode: head_dim = ", l.head_dim,
                             " (supported: 64, 128)");
    }
    auto need = [](const void* ptr, std::size_t align, const char* name) {
      if (ptr == nullptr) [[unlikely]] {
        oasiskv::detail::raise(errc::invalid_argument, "decode_params.", name, " is null");
      }
      if (reinterpret_cast<std::uintptr_t>(ptr) % align != 0) [[unlikely]] {
        oasiskv::detail::raise(errc::misaligned, "decode_params.", name, " = ", ptr, " is not ",
                               align, "-byte aligned");
      }
    };
    need(p.q, 16, "q");  // read as float4
    need(p.out, alignof(float), "out");
    need(p.lse, alignof(float), "lse");
    need(p.seq_lens, alignof(std::uint32_t), "seq_lens");
    need(p.table.refs, alignof(block_ref), "table.refs");
    need(p.table.offsets, alignof(std::uint32_t), "table.offsets");
    if (p.num_seqs == 0 || p.table.num_seqs != p.num_seqs || p.num_seqs > 65535) [[unlikely]] {
      oasiskv::detail::raise(
          errc::invalid_argument, "decode_params.num_seqs = ", p.num_seqs,
          " must be in [1, 65535] and equal table.num_seqs = ", p.table.num_seqs);
    }
    if (p.q_len < 1 || p.q_len > max_query_tokens) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "decode_params.q_len = ", p.q_len,
                             " must be in [1, 16]");
    }
    if (p.table.tables_per_seq != 1 && p.table.tables_per_seq != l.num_kv_heads) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument,
                             "block_table_view.tables_per_seq = ", p.table.tables_per_seq,
                             " must be 1 or num_kv_heads = ", l.num_kv_heads);
    }
    if (!std::isfinite(p.scale)) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "decode_params.scale = ", p.scale,
                             " is not finite");
    }
  }

  static void check_pointers(const decode_params& p, int device) {
    detail::require_device_pointer(p.q, device, "decode_params.q");
    detail::require_device_pointer(p.out, device, "decode_params.out");
    detail::require_device_pointer(p.lse, device, "decode_params.lse");
    detail::require_device_pointer(p.seq_lens, device, "decode_params.seq_lens");
    detail::require_device_pointer(p.table.refs, device, "decode_params.table.refs");
    detail::require_device_pointer(p.table.offsets, device, "decode_params.table.offsets");
    detail::require_device_pointer(p.pool.base, device, "decode_params.pool.base");
    const std::byte* last = p.pool.base + (std::size_t{p.pool.num_slots} * p.pool.slot_stride - 1);
    detail::require_device_pointer(last, device, "the last byte of decode_params.pool");
  }

  // Copies what the kernel would read of the tables back to the host and runs the CPU kernels'
  // validation on it, so a bad table is an error before any launch (synchronises).
  static void check_tables_on_host(const decode_params& p) {
    const std::size_t tables = std::size_t{p.num_seqs} * p.table.tables_per_seq;
    std::vector<std::uint32_t> offsets(tables + 1), lens(p.num_seqs);
    detail::check(
        cudaMemcpy(offsets.data(), p.table.offsets, offsets.size() * 4, cudaMemcpyDeviceToHost),
        "cuda::sparse_decode: reading table.offsets", errc::invalid_argument);
    detail::check(cudaMemcpy(lens.data(), p.seq_lens, lens.size() * 4, cudaMemcpyDeviceToHost),
                  "cuda::sparse_decode: reading seq_lens", errc::invalid_argument);
    for (std::size_t t = 0; t < tables; ++t) {
      if (offsets[t + 1] < offsets[t]) [[unlikely]] {
        oasiskv::detail::raise(errc::invalid_argument,
                               "block_table_view.offsets decrease at table ", t, ": ", offsets[t],
                               " -> ", offsets[t + 1]);
      }
    }
    std::vector<block_ref> refs(offsets.back());
    if (!refs.empty()) {
      detail::check(cudaMemcpy(refs.data(), p.table.refs, refs.size() * sizeof(block_ref),
                               cudaMemcpyDeviceToHost),
                    "cuda::sparse_decode: reading table.refs", errc::invalid_argument);
    }
    decode_params h = p;  // q, out, lse and the pool are checked for shape only: not read
    h.table.refs = refs.data();
    h.table.offsets = offsets.data();
    h.seq_lens = lens.data();
    oasiskv::validate(h);
  }

  plan make_plan(std::uint32_t num_seqs, std::uint32_t q_len, const kv_layout& l, int device,
                 std::uint32_t expected) const {
    if (state_->device < 0) {
      state_->device = device;
      state_->sms = detail::multiprocessor_count(device);
    } else if (state_->device != device) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "cuda::sparse_decode: called on device ",
                             device, " but its workspace lives on device ", state_->device,
                             " (use one kernel object per device)");
    }
    plan pl;
    pl.rows = q_len * l.group_size();
    pl.rows_per_cta = pl.rows <= 1 ? 1 : pl.rows <= 2 ? 2 : pl.rows <= 4 ? 4 : 8;
    pl.row_chunks = (pl.rows + pl.rows_per_cta - 1) / pl.rows_per_cta;
    if (std::uint64_t{l.num_kv_heads} * pl.row_chunks > 65535) [[unlikely]] {
      oasiskv::detail::raise(errc::unsupported, "cuda::sparse_decode: ", l.num_kv_heads,
                             " KV heads x ", pl.row_chunks, " row chunks exceed the grid");
    }
    const std::uint64_t ctas = std::uint64_t{num_seqs} * l.num_kv_heads * pl.row_chunks;
    pl.splits = detail::choose_decode_splits(static_cast<std::uint32_t>(state_->sms), ctas,
                                             expected, options_.num_splits, options_.max_splits);
    pl.out_rows = std::size_t{num_seqs} * q_len * l.num_q_heads;
    return pl;
  }

  void ensure_workspace(const plan& pl, std::uint32_t head_dim, bool capturing, int device) const {
    state& st = *state_;
    const std::size_t need = pl.splits > 1 ? pl.out_rows * pl.splits * (head_dim + 1) : 0;
    if (st.status != nullptr && st.workspace_floats >= need) {
      return;
    }
    if (capturing) [[unlikely]] {
      oasiskv::detail::raise(errc::unsupported,
                             "cuda::sparse_decode: the stream is being captured and the "
                             "workspace must grow; call reserve() with this shape before the "
                             "capture");
    }
    detail::device_guard guard(device);
    if (st.status == nullptr) {
      void* d = nullptr;
      void* h = nullptr;
      detail::check(cudaMalloc(&d, sizeof(std::uint32_t)), "cuda::sparse_decode: cudaMalloc",
                    errc::out_of_memory);
      st.status = static_cast<std::uint32_t*>(d);
      // Done before returning: a later call may launch on another stream, which would not
      // wait for a clear left queued on this one (or on the legacy stream).
      detail::check(cudaMemsetAsync(st.status, 0, sizeof(std::uint32_t), options_.stream),
                    "cuda::sparse_decode: cudaMemsetAsync");
      detail::check(cudaStreamSynchronize(options_.stream),
                    "cuda::sparse_decode: clearing the status word");
      detail::check(cudaHostAlloc(&h, sizeof(std::uint32_t), cudaHostAllocDefault),
                    "cuda::sparse_decode: cudaHostAlloc", errc::out_of_memory);
      st.status_host = static_cast<std::uint32_t*>(h);
    }
    if (st.workspace_floats < need) {
      (void)cudaFree(st.workspace);  // not in use: calls are serialised by the mutex, and the
      st.workspace = nullptr;        // previous call's kernels ran on the same stream
      st.workspace_floats = 0;
      void* w = nullptr;
      detail::check(cudaMalloc(&w, need * sizeof(float)), "cuda::sparse_decode: workspace",
                    errc::out_of_memory);
      st.workspace = static_cast<float*>(w);
      st.workspace_floats = need;
    }
  }

  template <class T, int D>
  void launch_typed(const detail::decode_kernel_args& a, const plan& pl, std::uint32_t num_seqs,
                    std::uint32_t kv_heads) const {
    const dim3 grid(pl.splits, kv_heads * pl.row_chunks, num_seqs);
    cudaStream_t s = options_.stream;
    auto run = [&](auto rows) {
      constexpr int R = decltype(rows)::value;
      if (options_.pipelined) {
        detail::decode_pipelined_kernel<T, D, R><<<grid, 128, 0, s>>>(a);
      } else {
        detail::decode_split_kernel<T, D, R><<<grid, 128, 0, s>>>(a);
      }
    };
    switch (pl.rows_per_cta) {
      case 1:
        run(std::integral_constant<int, 1>{});
        break;
      case 2:
        run(std::integral_constant<int, 2>{});
        break;
      case 4:
        run(std::integral_constant<int, 4>{});
        break;
      default:
        run(std::integral_constant<int, 8>{});
        break;
    }
    detail::check(cudaGetLastError(), "cuda::sparse_decode: launch", errc::invalid_argument);
    if (pl.splits > 1) {
      detail::merge_splits_kernel<D><<<static_cast<unsigned>(pl.out_rows), D, 0, s>>>(
          a.p.out, a.p.lse, a.part_out, a.part_lse, pl.splits);
      detail::check(cudaGetLastError(), "cuda::sparse_decode: merge launch",
                    errc::invalid_argument);
    }
  }

  void launch(const decode_params& p, const plan& pl) const {
    const kv_layout& l = p.pool.layout;
    detail::decode_kernel_args a;
    a.p = p;
    a.status = state_->status;
    a.splits = pl.splits;
    a.rows = pl.rows;
    a.row_chunks = pl.row_chunks;
    a.qscale = p.scale * 1.4426950408889634f;  // log2(e)
    if (pl.splits > 1) {
      a.part_out = state_->workspace;
      a.part_lse = state_->workspace + pl.out_rows * pl.splits * l.head_dim;
    }
    visit_dtype(l.kv_dtype, [&](auto elem) {
      using T = decltype(elem);
      if (l.head_dim == 64) {
        launch_typed<T, 64>(a, pl, p.num_seqs, l.num_kv_heads);
      } else {
        launch_typed<T, 128>(a, pl, p.num_seqs, l.num_kv_heads);
      }
    });
  }

  // Waits for the kernels, then reports a device fault or the table entries they skipped.
  void finish() const {
    state& st = *state_;
    cudaStream_t s = options_.stream;
    detail::check(cudaMemcpyAsync(st.status_host, st.status, sizeof(std::uint32_t),
                                  cudaMemcpyDeviceToHost, s),
                  "cuda::sparse_decode: reading the status word");
    detail::check(cudaStreamSynchronize(s), "cuda::sparse_decode: the kernels");
    const std::uint32_t bad = *st.status_host;
    if (bad != 0) [[unlikely]] {
      detail::check(cudaMemsetAsync(st.status, 0, sizeof(std::uint32_t), s),
                    "cuda::sparse_decode: clearing the status word");
      detail::check(cudaStreamSynchronize(s), "cuda::sparse_decode: clearing the status word");
      if (bad & detail::status_bad_slot) {
        oasiskv::detail::raise(errc::invalid_slot,
                               "cuda::sparse_decode: a block table entry names a slot outside "
                               "the pool (skipped by the kernel; enable check_tables to find it)");
      }
      if (bad & detail::status_short_seq) {
        oasiskv::detail::raise(errc::invalid_argument,
                               "cuda::sparse_decode: a seq_lens entry is shorter than q_len");
      }
      oasiskv::detail::raise(errc::out_of_range,
                             "cuda::sparse_decode: a block table entry is past the end of its "
                             "sequence (skipped by the kernel; enable check_tables to find it)");
    }
  }

  options options_;
  std::shared_ptr<state> state_;
  std::shared_ptr<uploads> upload_;
};

static_assert(sparse_attention_kernel<sparse_decode>);
static_assert(host_table_kernel<sparse_decode>);

}  // namespace oasiskv::cuda
