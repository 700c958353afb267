// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cuda::flashinfer_decode`: FlashInfer's paged decode kernel behind
//! `sparse_attention_kernel`, for shared block tables (one table for all KV heads of a sequence).
//!
//! Needs FlashInfer's headers (`flashinfer/attention/decode.cuh`, tested with the 0.7.4 wheel's
//! `flashinfer/data/include`; `scripts/fetch-flashinfer.sh`) on the include path, and sm_80 or
//! newer. The project does not depend on it: nothing else includes this header.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <tuple>
#include <type_traits>
#include <vector>

#include "oasiskv/attention/cuda/detail/flashinfer_compat.cuh"  // before FlashInfer
#include "oasiskv/attention/cuda/detail/flashinfer_plan.cuh"

#include <flashinfer/attention/decode.cuh>
#include <flashinfer/attention/default_decode_params.cuh>
#include <flashinfer/attention/scheduler.cuh>
#include <flashinfer/attention/variants.cuh>
#include <flashinfer/page.cuh>

#include "oasiskv/concepts/sparse_attention_kernel.hpp"
#include "oasiskv/core/decode_params.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/ids.hpp"
#include "oasiskv/cuda/detail/runtime.cuh"

namespace oasiskv::cuda {

//! @brief Whether `cuda::flashinfer_decode` may split a request's pages over several CTAs.
enum class flashinfer_split : std::uint8_t {
  automatic,  //!< as FlashInfer's planner decides (few requests x KV heads: split, then merge)
  never,      //!< one CTA per (request, KV head)
};

//! @brief How `cuda::flashinfer_decode` runs.
struct flashinfer_decode_options {
  //! The stream the kernels go to (null: the legacy default stream).
  cudaStream_t stream = nullptr;
  //! false: `decode` waits for its kernels and rethrows a device fault. true: stream-ordered
  //! only; the next call that uploads page lists first waits for the stream, since the
  //! kernels still read the previous ones.
  bool asynchronous = false;
  //! Check with cudaPointerGetAttributes that q, out, lse and the pool are device memory of the
  //! current device.
  bool check_pointers = true;
  //! Split-KV: FlashInfer's choice, or never.
  flashinfer_split split = flashinfer_split::automatic;
};

namespace detail {

// FlashInfer writes its output in the KV type (`o`) and the log-sum-exp in log2 units
// (m + log2(d), m the maximum of scale * log2(e) * q.k); the library's are f32 and the natural
// log. Requests that saw no token get out = 0 and lse = -inf whatever FlashInfer wrote for them.
template <class KV>
__global__ void flashinfer_finish_kernel(const KV* o, float* out, float* lse,
                                         const std::int32_t* indptr, std::uint32_t rows,
                                         std::uint32_t heads, std::uint32_t head_dim) {
  const std::uint32_t row = blockIdx.x * blockDim.y + threadIdx.y;
  if (row >= rows) {
    return;
  }
  const std::uint32_t request = row / heads;
  const bool empty = indptr[request + 1] == indptr[request];
  for (std::uint32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
    const std::size_t i = std::size_t{row} * head_dim + d;
    out[i] = empty ? 0.0f : static_cast<float>(o[i]);
  }
  if (threadIdx.x == 0) {
    lse[row] = empty ? -INFINITY : lse[row] * 0.6931471805599453f;  // ln(2)
  }
}

}  // namespace detail

//! @brief Decode attention through FlashInfer's `BatchDecodeWithPagedKVCacheDispatched`.
//! Models `sparse_attention_kernel` and `host_table_kernel` for shared tables
//! (`block_table_view::tables_per_seq == 1`); per-KV-head tables are `errc::unsupported`.
//!
//! Mapping: a slot is one FlashInfer page in the HND layout, with strides taken from the pool
//! (page: `slot_stride`, head: `tokens_per_block * head_dim`, token: `head_dim`); `k_data` is the
//! pool's base and `v_data` the base plus `kv_layout::value_offset(0)`. Each (sequence, query
//! token) is one FlashInfer request (FlashInfer's decode takes one query token per request): its
//! pages are the table's blocks that hold a token at or before that query token's position, the
//! block holding that position last with `last_page_len` = the tokens it shows (causality among
//! the new tokens), so q_len > 1 reads the selection q_len times. Block order does not matter:
//! no positional encoding is applied. `null_slot` entries are skipped. The page lists
//! (`indices`, `indptr`, `last_page_len`, and the request/tile indices of FlashInfer's split-KV
//! plan) are built on the host and copied to the device once per call. Whether to split a
//! request's pages over several CTAs is FlashInfer's DecodePlan without CUDA graphs, restated on
//! the host by `detail::plan_flashinfer_split` over the grid FlashInfer's own work estimate reports
//! (`BatchDecodeWithPagedKVCacheWorkEstimationDispatched`); a split plan's partial outputs and
//! log-sum-exps go to a workspace the kernel owns (`detail::split_workspace`, grown on demand)
//! and are merged by FlashInfer's `VariableLengthMergeStates`. A small
//! kernel then widens the output to f32 and turns FlashInfer's log2-based lse into the natural
//! log (requests that see no token: out 0, lse -inf).
//!
//! Precision: FlashInfer accumulates in f32 but writes its output (and split partials) in the KV
//! type (its dispatch also instantiates the merge, which does not build for f32 output), so the
//! output carries one rounding to bf16/f16 that `cuda::sparse_decode`'s does not.
//!
//! Supported: f16 and bf16 KV, head dims 64 and 128, GQA group sizes 1, 2, 3, 4, 6, 8, 16
//! (FlashInfer's dispatch), 1-16 query tokens, sm_80 and newer. `decode` copies the device
//! tables back to the host first (synchronises; not capturable). Copies share their state.
class flashinfer_decode {
 public:
  using options = flashinfer_decode_options;

  flashinfer_decode() : flashinfer_decode(options{}) {}
  explicit flashinfer_decode(options o) : options_(o), state_(std::make_shared<state>()) {}

  const options& config() const noexcept { return options_; }
  void set_stream(cudaStream_t s) noexcept { options_.stream = s; }

  //! @brief See `sparse_attention_kernel`: the tables, offsets and seq_lens are device memory
  //! (copied back to build FlashInfer's page lists; synchronises).
  void decode(const decode_params& p) const {
    validate_shape(p);
    const std::size_t tables = p.num_seqs;
    std::vector<std::uint32_t> offsets(tables + 1), lens(p.num_seqs);
    // On the kernel's stream, after whatever wrote the tables there (cuda::select_blocks).
    auto read = [&](void* to, const void* from, std::size_t bytes, const char* what) {
      detail::check(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToHost, options_.stream), what,
                    errc::invalid_argument);
      detail::check(cudaStreamSynchronize(options_.stream), what, errc::invalid_argument);
    };
    read(offsets.data(), p.table.offsets, offsets.size() * 4,
         "cuda::flashinfer_decode: reading table.offsets");
    read(lens.data(), p.seq_lens, lens.size() * 4, "cuda::flashinfer_decode: reading seq_lens");
    if (offsets[0] != 0) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "block_table_view.offsets[0] = ", offsets[0],
                             " must be 0");
    }
    for (std::size_t t = 0; t < tables; ++t) {  // before sizing the copy by the last offset
      if (offsets[t + 1] < offsets[t]) [[unlikely]] {
        oasiskv::detail::raise(errc::invalid_argument,
                               "block_table_view.offsets decrease at table ", t, ": ", offsets[t],
                               " -> ", offsets[t + 1]);
      }
    }
    std::vector<block_ref> refs(offsets.back());
    if (!refs.empty()) {
      read(refs.data(), p.table.refs, refs.size() * sizeof(block_ref),
           "cuda::flashinfer_decode: reading table.refs");
    }
    decode_params h = p;
    h.table.refs = refs.data();
    h.table.offsets = offsets.data();
    h.seq_lens = lens.data();
    run(h);
  }

  //! @brief `decode` with `p.table.refs`, `p.table.offsets` and `p.seq_lens` in host memory
  //! (what `tiered_kv_cache` builds). `q`, `out` and the pool are device memory; `lse` too, or
  //! null: then a device buffer of the kernel's receives it.
  void decode_host_tables(const decode_params& p) const {
    if (p.lse != nullptr) {
      validate_shape(p);
      run(p);
      return;
    }
    decode_params d = p;  // a null lse (the facade's) writes to a buffer of the kernel's
    std::lock_guard lock(state_->mutex);
    state& st = *state_;
    if (d.pool.layout.num_q_heads != 0) {
      const std::size_t bytes =
          std::size_t{d.num_seqs} * d.q_len * d.pool.layout.num_q_heads * sizeof(float);
      if (st.lse_bytes < bytes) {
        claim_device(st, detail::current_device());
        (void)cudaFree(st.lse);
        st.lse = nullptr;
        st.lse_bytes = 0;
        detail::check(cudaMalloc(&st.lse, bytes), "cuda::flashinfer_decode: lse buffer",
                      errc::out_of_memory);
        st.lse_bytes = bytes;
      }
      d.lse = static_cast<float*>(st.lse);
    }
    validate_shape(d);
    upload(d);
    launch_all(d);
  }

  //! @brief The first half of `decode_host_tables`: checks `p` (host tables), builds FlashInfer's
  //! page lists and copies them to the device, launching nothing. With `launch_prepared` it
  //! separates the per-call table upload from the kernels (benchmarks; a selection replayed
  //! over several calls).
  void prepare(const decode_params& p) const {
    validate_shape(p);
    std::lock_guard lock(state_->mutex);
    upload(p);
  }

  //! @brief The second half of `decode_host_tables`: FlashInfer's kernel and the output
  //! conversion over the page lists of the last `prepare` (or decode) call, with `p`'s q, out,
  //! lse and pool. `p` must have the layout, `num_seqs` and `q_len` of that call
  //! (`errc::invalid_argument` otherwise); its tables are not read.
  void launch_prepared(const decode_params& p) const {
    validate_shape(p);
    std::lock_guard lock(state_->mutex);
    const state& st = *state_;
    if (!st.prepared || st.layout != p.pool.layout || st.num_seqs != p.num_seqs ||
        st.q_len != p.q_len) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument,
                             "cuda::flashinfer_decode::launch_prepared: num_seqs = ", p.num_seqs,
                             ", q_len = ", p.q_len,
                             " or the layout differ from the prepared call's (num_seqs = ",
                             st.num_seqs, ", q_len = ", st.q_len, ")");
    }
    launch_all(p);
  }

  //! @brief What the last uploaded page lists planned (for tests and benchmarks).
  struct plan_info {
    bool split = false;               //!< the requests' pages are split over several CTAs
    std::uint32_t requests = 0;       //!< (sequence, query token) pairs
    std::uint32_t tiles = 0;          //!< CTA columns per KV head (requests when unsplit)
    std::size_t workspace_bytes = 0;  //!< what the split needs (0 unsplit)
    std::size_t allocated_bytes = 0;  //!< the split workspace held by the kernel
  };
  //! @brief The plan of the last `decode`, `decode_host_tables` or `prepare` call.
  plan_info last_plan() const {
    std::lock_guard lock(state_->mutex);
    const state& st = *state_;
    plan_info i;
    if (st.prepared) {
      i.split = st.at.split;
      i.requests = st.num_seqs * st.q_len;
      i.tiles = st.at.tiles;
      i.workspace_bytes = st.at.workspace.bytes;
    }
    i.allocated_bytes = st.tmp_bytes;
    return i;
  }

 private:
  using lists = detail::flashinfer_list_layout;

  struct state {
    std::mutex mutex;
    std::vector<std::int32_t> host;  // the page lists, as uploaded
    void* device = nullptr;          // their device copy
    std::size_t device_bytes = 0;
    void* o = nullptr;  // FlashInfer's output, in the KV type
    std::size_t o_bytes = 0;
    void* tmp = nullptr;  // split-KV partial outputs and lse (detail::split_workspace)
    std::size_t tmp_bytes = 0;
    void* lse = nullptr;  // decode_host_tables' lse when the caller passes none
    std::size_t lse_bytes = 0;
    int device_id = -1;
    // What the uploaded lists were built for (launch_prepared checks it).
    bool prepared = false;
    kv_layout layout{};
    std::uint32_t num_seqs = 0, q_len = 0;
    lists at{};
    state() = default;
    state(const state&) = delete;
    state& operator=(const state&) = delete;
    ~state() {
      if (device_id < 0) {
        return;
      }
      int previous = -1;  // no throwing device_guard in a destructor
      const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device_id &&
                            cudaSetDevice(device_id) == cudaSuccess;
      (void)cudaFree(device);
      (void)cudaFree(o);
      (void)cudaFree(tmp);
      (void)cudaFree(lse);
      if (switched) {
        (void)cudaSetDevice(previous);
      }
    }
  };

  static void validate_shape(const decode_params& p) {
    p.pool.validate();
    const kv_layout& l = p.pool.layout;
    if (l.kv_dtype != dtype::f16 && l.kv_dtype != dtype::bf16) [[unlikely]] {
      oasiskv::detail::raise(errc::unsupported,
                             "cuda::flashinfer_decode: kv_dtype = ", to_string(l.kv_dtype),
                             " (supported: f16, bf16)");
    }
    if (l.head_dim != 64 && l.head_dim != 128) [[unlikely]] {
      oasiskv::detail::raise(errc::unsupported, "cuda::flashinfer_decode: head_dim = ", l.head_dim,
                             " (supported: 64, 128)");
    }
    const std::uint32_t g = l.group_size();
    if (g != 1 && g != 2 && g != 3 && g != 4 && g != 6 && g != 8 && g != 16) [[unlikely]] {
      oasiskv::detail::raise(errc::unsupported, "cuda::flashinfer_decode: GQA group size ", g,
                             " (num_q_heads = ", l.num_q_heads, ", num_kv_heads = ", l.num_kv_heads,
                             "; supported: 1, 2, 3, 4, 6, 8, 16)");
    }
    if (p.table.tables_per_seq != 1) [[unlikely]] {
      oasiskv::detail::raise(
          errc::unsupported,
          "cuda::flashinfer_decode: block_table_view.tables_per_seq = ", p.table.tables_per_seq,
          "; only shared tables (1 per sequence) map onto FlashInfer's pages "
          "(use cuda::sparse_decode for per-KV-head selection)");
    }
    if (p.pool.slot_stride % l.elem_bytes() != 0 ||
        p.pool.slot_stride / l.elem_bytes() > std::numeric_limits<std::uint32_t>::max() ||
        p.pool.num_slots > static_cast<std::uint32_t>(std::numeric_limits<std::int32_t>::max()))
        [[unlikely]] {
      oasiskv::detail::raise(errc::unsupported,
                             "cuda::flashinfer_decode: slot_stride = ", p.pool.slot_stride,
                             " bytes, num_slots = ", p.pool.num_slots,
                             " (FlashInfer takes 32-bit page strides and int32 page ids)");
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
    need(p.q, 16, "q");      // read as float4
    need(p.out, 16, "out");  // written as float4
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
    if (!std::isfinite(p.scale)) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "decode_params.scale = ", p.scale,
                             " is not finite");
    }
  }

  // Builds the page lists of every (sequence, query token) request from host tables, checking
  // each entry as `oasiskv::validate` does (null_slot entries skipped).
  lists build(const decode_params& p, std::vector<std::int32_t>& v) const {
    const kv_layout& l = p.pool.layout;
    const std::size_t requests = std::size_t{p.num_seqs} * p.q_len;
    if (p.table.offsets[0] != 0) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument,
                             "block_table_view.offsets[0] = ", p.table.offsets[0], " must be 0");
    }
    std::vector<std::int32_t> pages, indptr{0}, last;
    pages.reserve(std::size_t{p.table.offsets[p.num_seqs]} * p.q_len);
    last.reserve(requests);
    std::vector<std::uint8_t> seen;
    for (std::uint32_t s = 0; s < p.num_seqs; ++s) {
      const std::uint32_t len = p.seq_lens[s];
      if (len < p.q_len) [[unlikely]] {
        oasiskv::detail::raise(errc::invalid_argument, "seq_lens[", s, "] = ", len,
                               " is shorter than q_len = ", p.q_len);
      }
      if (p.table.offsets[s + 1] < p.table.offsets[s]) [[unlikely]] {
        oasiskv::detail::raise(errc::invalid_argument, "block_table_view.offsets decrease at ", s,
                               ": ", p.table.offsets[s], " -> ", p.table.offsets[s + 1]);
      }
      const std::uint32_t nblocks = l.blocks_for(len);
      const block_ref* refs = p.table.begin(s);
      const std::uint32_t n = p.table.size(s);
      seen.assign(nblocks, 0);
      for (std::uint32_t i = 0; i < n; ++i) {
        const block_ref r = refs[i];
        if (r.slot == null_slot) {
          continue;
        }
        if (r.slot >= p.pool.num_slots) [[unlikely]] {
          oasiskv::detail::raise(errc::invalid_slot, "block table ", s, " entry ", i, ": slot ",
                                 r.slot, " is outside the pool of ", p.pool.num_slots, " slots");
        }
        if (r.index >= nblocks) [[unlikely]] {
          oasiskv::detail::raise(errc::out_of_range, "block table ", s, " entry ", i, ": block ",
                                 r.index, " is past the end of sequence ", s, " (", len,
                                 " tokens, ", nblocks, " blocks)");
        }
        if (seen[r.index]++) [[unlikely]] {
          oasiskv::detail::raise(errc::invalid_argument, "block table ", s, " lists block ",
                                 r.index, " twice");
        }
      }
      for (std::uint32_t j = 0; j < p.q_len; ++j) {
        const std::uint64_t pos = std::uint64_t{len} - p.q_len + j;  // the query token's position
        std::int32_t partial = -1;
        std::uint32_t partial_fill = 0;
        for (std::uint32_t i = 0; i < n; ++i) {
          const block_ref r = refs[i];
          const std::uint64_t first = std::uint64_t{r.index} * l.tokens_per_block;
          if (r.slot == null_slot || first > pos) {
            continue;
          }
          const std::uint64_t fill = pos - first + 1;
          if (fill >= l.tokens_per_block) {
            pages.push_back(static_cast<std::int32_t>(r.slot));
          } else {  // the block holding pos (listed once: checked above)
            partial = static_cast<std::int32_t>(r.slot);
            partial_fill = static_cast<std::uint32_t>(fill);
          }
        }
        if (partial >= 0) {
          pages.push_back(partial);
          last.push_back(static_cast<std::int32_t>(partial_fill));
        } else {
          last.push_back(static_cast<std::int32_t>(l.tokens_per_block));
        }
        // FlashInfer indexes pages with int32 and the batch's tokens with uint32.
        if (pages.size() > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()) ||
            pages.size() * l.tokens_per_block > std::numeric_limits<std::uint32_t>::max())
            [[unlikely]] {
          oasiskv::detail::raise(errc::unsupported, "cuda::flashinfer_decode: ", pages.size(),
                                 " pages of ", l.tokens_per_block,
                                 " tokens exceed FlashInfer's 32-bit page and token indices");
        }
        indptr.push_back(static_cast<std::int32_t>(pages.size()));
      }
    }
    const detail::flashinfer_split_plan sp =
        detail::plan_flashinfer_split(max_grid(l), l.num_kv_heads, indptr, l.tokens_per_block,
                                      options_.split != flashinfer_split::never);
    const lists at =
        detail::make_list_layout(pages.size(), requests, sp, l.num_q_heads, l.head_dim);
    v.assign(at.total, 0);
    auto put = [&](const std::vector<std::int32_t>& from, std::size_t offset) {
      std::copy(from.begin(), from.end(), v.begin() + static_cast<std::ptrdiff_t>(offset));
    };
    put(pages, at.indices);
    put(indptr, at.indptr);
    put(last, at.last_page_len);
    put(sp.request, at.request);
    put(sp.tile, at.tile);
    put(sp.o_indptr, at.o_indptr);
    v[at.chunk] = sp.split ? static_cast<std::int32_t>(sp.chunk_pages * l.tokens_per_block)
                           : std::numeric_limits<std::int32_t>::max();  // unused unsplit
    return at;
  }

  // CTAs of FlashInfer's decode kernel resident at once on this device (its occupancy query,
  // through its own work estimate), from which detail::plan_flashinfer_split decides.
  std::uint32_t max_grid(const kv_layout& l) const {
    bool split = false;
    std::uint32_t grid = 0, chunk_pages = 0, new_batch = 0, gdy = 0;
    std::int32_t indptr[2] = {0, 0};  // one empty request: only the grid is wanted
    auto estimate = [&](auto kv_type, auto head_dim) {
      using KV = decltype(kv_type);
      constexpr std::uint32_t D = decltype(head_dim)::value;
      using params_t = flashinfer::BatchDecodeParams<float, KV, KV, std::int32_t>;
      using variant = flashinfer::DefaultAttention<false, false, false, false>;
      cudaError_t e = cudaSuccess;
      DISPATCH_GQA_GROUP_SIZE(l.group_size(), GROUP_SIZE, {
        e = flashinfer::BatchDecodeWithPagedKVCacheWorkEstimationDispatched<
            GROUP_SIZE, D, flashinfer::PosEncodingMode::kNone, variant, params_t>(
            split, grid, chunk_pages, new_batch, gdy, 1, indptr, l.num_q_heads, l.tokens_per_block,
            /*enable_cuda_graph=*/false, options_.stream);
      });
      detail::check(e, "cuda::flashinfer_decode: FlashInfer's work estimate",
                    errc::invalid_argument);
    };
    try {
      const bool f16 = l.kv_dtype == dtype::f16;
      if (l.head_dim == 64) {
        f16 ? estimate(__half{}, std::integral_constant<std::uint32_t, 64>{})
            : estimate(__nv_bfloat16{}, std::integral_constant<std::uint32_t, 64>{});
      } else {
        f16 ? estimate(__half{}, std::integral_constant<std::uint32_t, 128>{})
            : estimate(__nv_bfloat16{}, std::integral_constant<std::uint32_t, 128>{});
      }
    } catch (const oasiskv::error&) {
      throw;
    } catch (const std::exception& x) {
      oasiskv::detail::raise(errc::unsupported, "cuda::flashinfer_decode: FlashInfer: ", x.what());
    }
    return grid;
  }

  void run(const decode_params& p) const {
    std::lock_guard lock(state_->mutex);
    upload(p);
    launch_all(p);
  }

  // The kernel's buffers live on one device: the first it runs on.
  static void claim_device(state& st, int device) {
    if (st.device_id >= 0 && st.device_id != device) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "cuda::flashinfer_decode: called on device ",
                             device, " but its buffers live on device ", st.device_id,
                             " (use one kernel object per device)");
    }
    st.device_id = device;
  }

  // Checks the pointers, builds the page lists and copies them to the device (mutex held).
  void upload(const decode_params& p) const {
    state& st = *state_;
    const int device = detail::current_device();
    if (options_.check_pointers) {
      detail::require_device_pointer(p.q, device, "decode_params.q");
      detail::require_device_pointer(p.out, device, "decode_params.out");
      detail::require_device_pointer(p.lse, device, "decode_params.lse");
      detail::require_device_pointer(p.pool.base, device, "decode_params.pool.base");
      const std::byte* last =
          p.pool.base + (std::size_t{p.pool.num_slots} * p.pool.slot_stride - 1);
      detail::require_device_pointer(last, device, "the last byte of decode_params.pool");
    }
    claim_device(st, device);
    if (options_.asynchronous) {  // the previous call may still read the device lists
      detail::check(cudaStreamSynchronize(options_.stream),
                    "cuda::flashinfer_decode: the previous call's kernels");
    }
    st.prepared = false;
    const lists at = build(p, st.host);
    const std::size_t bytes = at.total * sizeof(std::int32_t);
    if (st.device_bytes < bytes) {
      (void)cudaFree(st.device);
      st.device = nullptr;
      st.device_bytes = 0;
      detail::check(cudaMalloc(&st.device, bytes), "cuda::flashinfer_decode: page lists",
                    errc::out_of_memory);
      st.device_bytes = bytes;
    }
    const kv_layout& l = p.pool.layout;
    const std::size_t o_bytes =
        std::size_t{p.num_seqs} * p.q_len * l.num_q_heads * l.head_dim * l.elem_bytes();
    if (st.o_bytes < o_bytes) {
      (void)cudaFree(st.o);
      st.o = nullptr;
      st.o_bytes = 0;
      detail::check(cudaMalloc(&st.o, o_bytes), "cuda::flashinfer_decode: output buffer",
                    errc::out_of_memory);
      st.o_bytes = o_bytes;
    }
    // A split plan sends the kernel's partial outputs and log-sum-exps to the workspace, which
    // the merge reads; without it FlashInfer would run its unsplit kernel on the split grid.
    if (st.tmp_bytes < at.workspace.bytes) {
      (void)cudaFree(st.tmp);
      st.tmp = nullptr;
      st.tmp_bytes = 0;
      detail::check(cudaMalloc(&st.tmp, at.workspace.bytes),
                    "cuda::flashinfer_decode: split-KV workspace", errc::out_of_memory);
      st.tmp_bytes = at.workspace.bytes;
    }
    detail::check(
        cudaMemcpyAsync(st.device, st.host.data(), bytes, cudaMemcpyHostToDevice, options_.stream),
        "cuda::flashinfer_decode: uploading the page lists");
    st.prepared = true;
    st.layout = l;
    st.num_seqs = p.num_seqs;
    st.q_len = p.q_len;
    st.at = at;
  }

  // FlashInfer's kernel and the output conversion over the uploaded lists (mutex held).
  void launch_all(const decode_params& p) const {
    const state& st = *state_;
    const kv_layout& l = p.pool.layout;
    const lists& at = st.at;
    const auto requests = static_cast<std::uint32_t>(std::size_t{p.num_seqs} * p.q_len);
    const std::uint32_t rows = requests * l.num_q_heads;
    auto* lists_d = static_cast<std::int32_t*>(st.device);
    auto finish = [&](auto* o) {
      const dim3 block(32, 8);
      detail::flashinfer_finish_kernel<<<(rows + 7) / 8, block, 0, options_.stream>>>(
          o, p.out, p.lse, lists_d + at.indptr, rows, l.num_q_heads, l.head_dim);
      detail::check(cudaGetLastError(), "cuda::flashinfer_decode: output launch",
                    errc::invalid_argument);
    };
    if (l.kv_dtype == dtype::f16) {
      auto* o = static_cast<__half*>(st.o);
      launch<__half>(p, lists_d, at, requests, o);
      finish(o);
    } else {
      auto* o = static_cast<__nv_bfloat16*>(st.o);
      launch<__nv_bfloat16>(p, lists_d, at, requests, o);
      finish(o);
    }
    if (!options_.asynchronous) {
      detail::check(cudaStreamSynchronize(options_.stream), "cuda::flashinfer_decode: the kernels");
    }
  }

  template <class KV>
  void launch(const decode_params& p, std::int32_t* d, const lists& at, std::uint32_t requests,
              KV* o) const {
    const kv_layout& l = p.pool.layout;
    const std::int64_t strides[3] = {
        static_cast<std::int64_t>(p.pool.slot_stride / l.elem_bytes()),
        static_cast<std::int64_t>(std::size_t{l.tokens_per_block} * l.head_dim),
        static_cast<std::int64_t>(l.head_dim)};
    auto* k = reinterpret_cast<KV*>(p.pool.base);
    auto* v = reinterpret_cast<KV*>(p.pool.base + l.value_offset(0));
    flashinfer::paged_kv_t<KV, std::int32_t> kv(
        l.num_kv_heads, l.tokens_per_block, l.head_dim, requests, flashinfer::QKVLayout::kHND, k, v,
        strides, d + at.indices, d + at.indptr, d + at.last_page_len);
    using params_t = flashinfer::BatchDecodeParams<float, KV, KV, std::int32_t>;
    params_t fp(const_cast<float*>(p.q), nullptr, kv, o, p.lse, nullptr, l.num_q_heads,
                static_cast<std::int32_t>(l.num_q_heads * l.head_dim),
                static_cast<std::int32_t>(l.head_dim), /*window_left=*/-1,
                /*logits_soft_cap=*/0.0f, p.scale, /*rope_scale=*/1.0f, /*rope_theta=*/1e4f);
    fp.padded_batch_size = at.tiles;
    fp.request_indices = d + at.request;
    fp.kv_tile_indices = d + at.tile;
    fp.o_indptr = d + at.o_indptr;
    fp.kv_chunk_size_ptr = d + at.chunk;
    fp.partition_kv = at.split;  // set again by the dispatch from tmp_v
    KV* tmp_v = nullptr;         // null: FlashInfer's unsplit path (one tile per request)
    float* tmp_s = nullptr;
    if (at.split) {
      if (state_->tmp == nullptr || state_->tmp_bytes < at.workspace.bytes) [[unlikely]] {
        oasiskv::detail::raise(errc::invalid_argument,
                               "cuda::flashinfer_decode: the split plan's workspace (",
                               at.workspace.bytes, " bytes) was not allocated");
      }
      tmp_v = static_cast<KV*>(state_->tmp);
      tmp_s =
          reinterpret_cast<float*>(static_cast<std::byte*>(state_->tmp) + at.workspace.lse_offset);
    }
    using variant = flashinfer::DefaultAttention<false, false, false, false>;
    cudaError_t e = cudaSuccess;
    try {
      if (l.head_dim == 64) {
        e = flashinfer::BatchDecodeWithPagedKVCacheDispatched<
            64, flashinfer::PosEncodingMode::kNone, variant>(fp, tmp_v, tmp_s, false,
                                                             options_.stream);
      } else {
        e = flashinfer::BatchDecodeWithPagedKVCacheDispatched<
            128, flashinfer::PosEncodingMode::kNone, variant>(fp, tmp_v, tmp_s, false,
                                                              options_.stream);
      }
    } catch (const std::exception& x) {
      oasiskv::detail::raise(errc::unsupported, "cuda::flashinfer_decode: FlashInfer: ", x.what());
    }
    detail::check(e, "cuda::flashinfer_decode: BatchDecodeWithPagedKVCacheDispatched",
                  errc::invalid_argument);
  }

  options options_;
  std::shared_ptr<state> state_;
};

static_assert(sparse_attention_kernel<flashinfer_decode>);
static_assert(host_table_kernel<flashinfer_decode>);

}  // namespace oasiskv::cuda
