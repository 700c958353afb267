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
#include <vector>

#include "oasiskv/cuda/detail/flashinfer_compat.cuh"  // before FlashInfer

#include <flashinfer/attention/decode.cuh>
#include <flashinfer/attention/default_decode_params.cuh>
#include <flashinfer/attention/variants.cuh>
#include <flashinfer/page.cuh>

#include "oasiskv/concepts/sparse_attention_kernel.hpp"
#include "oasiskv/core/decode_params.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/ids.hpp"
#include "oasiskv/cuda/detail/runtime.cuh"

namespace oasiskv::cuda {

//! @brief How `cuda::flashinfer_decode` runs.
struct flashinfer_decode_options {
  //! The stream the kernels go to (null: the legacy default stream).
  cudaStream_t stream = nullptr;
  //! false: `decode` waits for its kernels and rethrows a device fault. true: stream-ordered
  //! only (the page list it uploaded stays owned by the kernel object until the next call).
  bool asynchronous = false;
  //! Check with cudaPointerGetAttributes that q, out, lse and the pool are device memory of the
  //! current device.
  bool check_pointers = true;
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
//! (`indices`, `indptr`, `last_page_len` and the trivial request/tile indices of the non-split
//! path) are built on the host and copied to the device once per call; FlashInfer runs without
//! its split-KV scheduler (no plan, no workspace: one CTA per request and KV head), and a small
//! kernel turns its log2-based lse into the natural log.
//!
//! Supported: f16 and bf16 KV, head dims 64 and 128, GQA group sizes 1, 2, 3, 4, 6, 8, 16
//! (FlashInfer's dispatch), 1-16 query tokens. `decode` copies the device tables back to the
//! host first (synchronises; not capturable). Copies share their state.
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
    detail::check(
        cudaMemcpy(offsets.data(), p.table.offsets, offsets.size() * 4, cudaMemcpyDeviceToHost),
        "cuda::flashinfer_decode: reading table.offsets", errc::invalid_argument);
    detail::check(cudaMemcpy(lens.data(), p.seq_lens, lens.size() * 4, cudaMemcpyDeviceToHost),
                  "cuda::flashinfer_decode: reading seq_lens", errc::invalid_argument);
    if (offsets[0] != 0 || offsets.back() < offsets[0]) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "block_table_view.offsets = [", offsets[0],
                             " .. ", offsets.back(), "] must start at 0 and grow");
    }
    std::vector<block_ref> refs(offsets.back());
    if (!refs.empty()) {
      detail::check(cudaMemcpy(refs.data(), p.table.refs, refs.size() * sizeof(block_ref),
                               cudaMemcpyDeviceToHost),
                    "cuda::flashinfer_decode: reading table.refs", errc::invalid_argument);
    }
    decode_params h = p;
    h.table.refs = refs.data();
    h.table.offsets = offsets.data();
    h.seq_lens = lens.data();
    run(h);
  }

  //! @brief `decode` with `p.table.refs`, `p.table.offsets` and `p.seq_lens` in host memory
  //! (what `tiered_kv_cache` builds). `q`, `out`, `lse` and the pool are device memory.
  void decode_host_tables(const decode_params& p) const {
    validate_shape(p);
    run(p);
  }

 private:
  struct state {
    std::mutex mutex;
    std::vector<std::int32_t> host;  // the page lists, as uploaded
    void* device = nullptr;          // their device copy
    std::size_t device_bytes = 0;
    void* o = nullptr;  // FlashInfer's output, in the KV type
    std::size_t o_bytes = 0;
    int device_id = -1;
    state() = default;
    state(const state&) = delete;
    state& operator=(const state&) = delete;
    ~state() {
      if (device_id >= 0) {
        detail::device_guard guard(device_id);
        (void)cudaFree(device);
        (void)cudaFree(o);
      }
    }
  };

  // Offsets (in int32) of the arrays inside the uploaded buffer.
  struct lists {
    std::size_t indices = 0, indptr = 0, last_page_len = 0, request = 0, tile = 0, chunk = 0;
    std::size_t total = 0;
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
  static lists build(const decode_params& p, std::vector<std::int32_t>& v) {
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
        if (pages.size() > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))
            [[unlikely]] {
          oasiskv::detail::raise(errc::unsupported, "cuda::flashinfer_decode: ", pages.size(),
                                 " pages exceed FlashInfer's int32 indptr");
        }
        indptr.push_back(static_cast<std::int32_t>(pages.size()));
      }
    }
    lists at;
    at.indices = 0;
    at.indptr = (pages.size() + 3) / 4 * 4;  // 16-byte aligned arrays
    at.last_page_len = at.indptr + (requests + 1 + 3) / 4 * 4;
    at.request = at.last_page_len + (requests + 3) / 4 * 4;
    at.tile = at.request + (requests + 3) / 4 * 4;
    at.chunk = at.tile + (requests + 3) / 4 * 4;
    at.total = at.chunk + 4;
    v.assign(at.total, 0);
    std::copy(pages.begin(), pages.end(), v.begin() + static_cast<std::ptrdiff_t>(at.indices));
    std::copy(indptr.begin(), indptr.end(), v.begin() + static_cast<std::ptrdiff_t>(at.indptr));
    std::copy(last.begin(), last.end(), v.begin() + static_cast<std::ptrdiff_t>(at.last_page_len));
    for (std::size_t r = 0; r < requests; ++r) {
      v[at.request + r] = static_cast<std::int32_t>(r);  // tiles stay 0: one tile per request
    }
    v[at.chunk] = std::numeric_limits<std::int32_t>::max();  // read, unused without partition
    return at;
  }

  void run(const decode_params& p) const {
    std::lock_guard lock(state_->mutex);
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
    if (st.device_id >= 0 && st.device_id != device) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "cuda::flashinfer_decode: called on device ",
                             device, " but its buffers live on device ", st.device_id,
                             " (use one kernel object per device)");
    }
    if (options_.asynchronous) {  // the previous call may still read the device lists
      detail::check(cudaStreamSynchronize(options_.stream),
                    "cuda::flashinfer_decode: the previous call's kernels");
    }
    const lists at = build(p, st.host);
    const std::size_t bytes = at.total * sizeof(std::int32_t);
    if (st.device_bytes < bytes) {
      (void)cudaFree(st.device);
      st.device = nullptr;
      st.device_bytes = 0;
      detail::check(cudaMalloc(&st.device, bytes), "cuda::flashinfer_decode: page lists",
                    errc::out_of_memory);
      st.device_bytes = bytes;
      st.device_id = device;
    }
    const kv_layout& l = p.pool.layout;
    const auto requests = static_cast<std::uint32_t>(std::size_t{p.num_seqs} * p.q_len);
    const std::uint32_t rows = requests * l.num_q_heads;
    const std::size_t o_bytes = std::size_t{rows} * l.head_dim * l.elem_bytes();
    if (st.o_bytes < o_bytes) {
      (void)cudaFree(st.o);
      st.o = nullptr;
      st.o_bytes = 0;
      detail::check(cudaMalloc(&st.o, o_bytes), "cuda::flashinfer_decode: output buffer",
                    errc::out_of_memory);
      st.o_bytes = o_bytes;
      st.device_id = device;
    }
    detail::check(
        cudaMemcpyAsync(st.device, st.host.data(), bytes, cudaMemcpyHostToDevice, options_.stream),
        "cuda::flashinfer_decode: uploading the page lists");
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
    fp.padded_batch_size = requests;
    fp.request_indices = d + at.request;
    fp.kv_tile_indices = d + at.tile;
    fp.kv_chunk_size_ptr = d + at.chunk;
    fp.partition_kv = false;
    using variant = flashinfer::DefaultAttention<false, false, false, false>;
    cudaError_t e = cudaSuccess;
    try {
      if (l.head_dim == 64) {
        e = flashinfer::BatchDecodeWithPagedKVCacheDispatched<
            64, flashinfer::PosEncodingMode::kNone, variant>(fp, nullptr, nullptr, false,
                                                             options_.stream);
      } else {
        e = flashinfer::BatchDecodeWithPagedKVCacheDispatched<
            128, flashinfer::PosEncodingMode::kNone, variant>(fp, nullptr, nullptr, false,
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
