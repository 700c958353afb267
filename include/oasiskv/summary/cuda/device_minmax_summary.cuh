// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cuda::device_minmax_summary`: `minmax_summary<f16>` (f16 min/max bounds) in device
//! memory, updated on the device with the host's bits and scored by `cuda::topk_selector`.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "oasiskv/concepts/device_summary.hpp"
#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/layout.hpp"
#include "oasiskv/summary/cuda/detail/minmax_fold_kernel.cuh"
#include "oasiskv/summary/cuda/device_summary_store.cuh"
// The summary/cpu/ kernels (via minmax_summary.hpp) use `#pragma GCC unroll`, which g++ knows and
// nvcc's front end reports (1675) as unrecognised; silence it for that header only.
#pragma nv_diag_suppress 1675
#include "oasiskv/summary/minmax_summary.hpp"
#pragma nv_diag_default 1675

namespace oasiskv::cuda {

//! @brief Min/max summaries in device memory: bounds `[num_kv_heads][capacity][2 (max, min)]
//! [head_dim]` f16 and a token count per entry. Move-only; owns its memory.
//!
//! Filled either by `upload` from a host `minmax_summary<f16>` or on the device by `update`
//! (appended key rows), `recompute` (a block's keys in a fast-tier slot) and `reset`, which
//! fold keys with the host's rule and so give the same bits as `minmax_summary<f16>::update`
//! for the same keys: f16 keys are stored as they are (a max/min of f16 values is exact); bf16
//! and f32 keys are widened to float and rounded outward to f16 exactly as the host's
//! `cpu::detail::round_up<f16>` / `round_down<f16>` do (nearest f16, then one ulp up for the
//! maximum or down for the minimum if it landed on the wrong side), keys beyond the f16 range
//! giving infinite bounds and NaN keys leaving the bounds unchanged. Tokens are folded in order, so
//! even a signed-zero bound matches.
//!
//! The token counts are mirrored on the host (every change goes through the
//! `device_summary_store` beneath), so `update` checks the block's capacity before it launches;
//! the device-side writes are asynchronous on the given stream and ordered with the selection
//! when both use one stream. Unlike the host summary, an update past `tokens_per_block` is an
//! error, not a saturation.
//!
//! As the host model, it grows (`grow`: every entry kept, on the device) and takes shipped
//! summaries (`load`: the host wire format, the host `load`'s bits), with their arguments
//! checked on the host by `check_grow` / `check_load`. Models `device_summary`.
class device_minmax_summary {
 public:
  //! @brief Allocates `capacity` empty entries for `layout` (synchronous); `errc::invalid_argument`
  //! for a zero capacity or an invalid layout, `errc::out_of_memory` when allocation fails.
  device_minmax_summary(const kv_layout& layout, std::uint32_t capacity)
      : store_("cuda::device_minmax_summary", layout, capacity,
               {device_summary_array{.width = row_bytes(layout)}}) {}

  //! @brief The layout the summary was built for.
  const kv_layout& layout() const noexcept { return store_.layout(); }
  //! @brief Entries held.
  std::uint32_t capacity() const noexcept { return store_.capacity(); }
  //! @brief Device bounds, `[num_kv_heads][capacity][2 (max, min)][head_dim]` f16.
  const f16* bounds() const noexcept { return store_.data<f16>(0); }
  //! @brief Device token counts, `[capacity]`.
  const std::uint16_t* tokens() const noexcept { return store_.tokens(); }
  //! @brief Tokens folded into entry `e` (the host mirror of the device count; no synchronisation).
  std::uint32_t tokens(std::uint32_t e) const { return store_.tokens(e); }

  //! @brief Copies entries `entries` of a host summary of the same layout and capacity (after
  //! appends; synchronous, through the legacy default stream: synchronise a non-blocking stream
  //! that `update` used first). The scoring math is the host's, so the GPU scores what it scores.
  //! `errc::layout_mismatch` when layout or capacity differ, `errc::out_of_range` for an entry
  //! beyond the capacity (nothing copied).
  void upload(const minmax_summary<f16>& host, std::span<const std::uint32_t> entries) {
    store_.check_host(host.layout(), host.capacity());
    for (const std::uint32_t b : entries) {
      store_.check_entry(b, "upload");
    }
    const kv_layout& l = layout();
    const std::size_t row = 2 * std::size_t{l.head_dim};  // f16 per (entry, head)
    std::vector<f16> bounds(entries.size() * l.num_kv_heads * row);
    std::vector<std::uint16_t> counts(entries.size());
    for (std::size_t i = 0; i < entries.size(); ++i) {
      for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
        const auto src = host.bounds(h, entries[i]);
        std::memcpy(bounds.data() + (i * l.num_kv_heads + h) * row, src.data(), row * sizeof(f16));
      }
      counts[i] = static_cast<std::uint16_t>(host.tokens(entries[i]));
    }
    store_.write_entries(entries, {bounds.data()}, counts.data(), nullptr, "::upload");
  }

  //! @brief Folds `n` appended key rows into entry `e` on `stream` (asynchronous). `keys` is
  //! device memory, `[n][num_kv_heads][head_dim]` in the layout's dtype (f16, bf16 or f32), the
  //! rows of tokens `tokens(e)` to `tokens(e) + n - 1` of the entry's block. Throws
  //! `oasiskv::error` before any launch: `errc::out_of_range` for an entry beyond the capacity or
  //! a count that would take the entry past `tokens_per_block`, `errc::invalid_argument` for null
  //! or non-device `keys` (checked with `cudaPointerGetAttributes` when `check_pointers`). `n = 0`
  //! does nothing.
  void update(std::uint32_t e, const void* keys, std::uint32_t n, cudaStream_t stream = nullptr,
              bool check_pointers = true) {
    store_.update(e, keys, n, check_pointers, folder{this, stream});
  }

  //! @brief Recomputes entry `e` from the first `count` tokens of a block in device memory laid
  //! out as a fast-tier slot (`kv_layout::key_offset`: `[num_kv_heads][tokens_per_block]
  //! [head_dim]` keys first), on `stream`: the entry's old bounds are dropped, as the host's
  //! `reset(e)` then `update(e, block, 0, count)`. `count = 0` empties it. Throws as `update`
  //! (`count` above `tokens_per_block` is `errc::out_of_range`).
  void recompute(std::uint32_t e, const std::byte* block, std::uint32_t count,
                 cudaStream_t stream = nullptr, bool check_pointers = true) {
    store_.recompute(e, block, count, check_pointers, folder{this, stream});
  }

  //! @brief Empties entry `e` on `stream`: zero bounds, no tokens (scores `-inf`, no mass).
  void reset(std::uint32_t e, cudaStream_t stream = nullptr) {
    store_.reset(e, folder{this, stream});
  }

  //! @brief Throws unless `capacity` may replace `current` in `grow`: `errc::invalid_argument`
  //! below it (the host `minmax_summary::grow`'s rule). Host-only; needs no device.
  static void check_grow(std::uint32_t current, std::uint32_t capacity) {
    oasiskv::detail::check_summary_grow("cuda::device_minmax_summary", current, capacity);
  }

  //! @brief Capacity becomes `capacity` (models the host's `growable_summary::grow`): entries
  //! `[0, capacity())` keep their bounds and token counts (device-to-device copies into new
  //! allocations), the new entries start empty as a fresh summary's (zero bounds, no tokens). An
  //! equal capacity does nothing; a smaller one is `errc::invalid_argument`. All or nothing: a
  //! failed allocation throws `errc::out_of_memory` (another CUDA failure its `oasiskv::error`)
  //! with the old buffers, capacity and token counts untouched.
  //!
  //! Stream ordering: the copies are enqueued on `stream`, after the work enqueued there before
  //! (an `update` on `stream` is copied with its result); work on other streams that reads or
  //! writes this summary (updates, `topk_selector::select`) must be finished before the call.
  //! The call synchronises `stream`, then frees the old buffers: `bounds()` and `tokens()` change,
  //! so a selection or a captured graph holding the old pointers must not run afterwards.
  void grow(std::uint32_t capacity, cudaStream_t stream = nullptr) {
    store_.grow(capacity, stream);
  }

  //! @brief Bytes of one shipped entry, as the host `minmax_summary::wire_bytes`:
  //! `[num_kv_heads][2 (max, min)][head_dim]` f16.
  std::size_t wire_bytes() const noexcept { return wire_bytes_of(layout()); }
  //! @brief `wire_bytes()` of a summary with layout `l` (host-only).
  static std::size_t wire_bytes_of(const kv_layout& l) noexcept { return store::wire_bytes_of(l); }

  //! @brief Throws unless `load(entries, bytes, tokens)` may run on a summary of `layout` and
  //! `capacity`, naming the offending value: `errc::invalid_argument` when `tokens` does not hold
  //! one count per entry or `bytes` is not `entries.size() * wire_bytes()` long,
  //! `errc::out_of_range` for an entry at or beyond `capacity` or a token count outside
  //! `[1, tokens_per_block]` (the host `load`'s range). Host-only; needs no device.
  static void check_load(const kv_layout& layout, std::uint32_t capacity,
                         std::span<const std::uint32_t> entries, std::span<const std::byte> bytes,
                         std::span<const std::uint32_t> tokens) {
    store::check_load("cuda::device_minmax_summary::load", layout, capacity, entries, bytes,
                      tokens);
  }

  //! @brief The host half of `load`: the bounds it copies, `[entries][num_kv_heads][2 (max,
  //! min)][head_dim]` f16 bits, from `bytes` (whole shipped entries, as `check_load` accepts
  //! them): the bits as shipped (already the device's per-(head, entry) order), each NaN bound
  //! made infinite outward (`+inf` for a maximum, `-inf` for a minimum), as the host `load`
  //! stores them. Host-only; needs no device.
  static std::vector<std::uint16_t> stage_load(const kv_layout& layout,
                                               std::span<const std::byte> bytes) {
    const std::uint32_t d = layout.head_dim;
    std::vector<std::uint16_t> staged(bytes.size() / sizeof(std::uint16_t));
    std::memcpy(staged.data(), bytes.data(), staged.size() * sizeof(std::uint16_t));
    for (std::size_t i = 0; i < staged.size(); ++i) {
      if ((staged[i] & 0x7fffu) > 0x7c00u) {
        staged[i] = (i / d) % 2 == 0 ? std::uint16_t{0x7c00u} : std::uint16_t{0xfc00u};
      }
    }
    return staged;
  }

  //! @brief Sets entries `entries[i]` from summaries computed elsewhere (models the host's
  //! `loadable_summary::load` for a batch): `bytes` is `[entries.size()][wire_bytes()]`, entry
  //! `i`'s shipped bounds as `minmax_summary<f16>::load` takes them (per KV head the
  //! elementwise maximum then minimum key as f16, little-endian: `disagg::summarize_block`), and
  //! `tokens[i]` its block's token count. Each entry then holds what the host summary holds after
  //! `load(entries[i], bytes_i, tokens[i])` (the bits as shipped, a NaN bound made infinite
  //! outward), so `upload` of that host summary gives the same device bytes; later `update`s fold
  //! into it. A repeated entry takes its last bytes. Everything is checked before any copy
  //! (`check_load`), and the summary is then unchanged.
  //!
  //! Stream ordering: the host-to-device copies are enqueued on `stream` after the work
  //! enqueued there before (from a host staging buffer); work on other streams that reads or
  //! writes these entries must be finished before the call. The call synchronises `stream` before
  //! returning. A CUDA failure during the copies throws and leaves the listed entries unspecified
  //! (reset or load them again).
  void load(std::span<const std::uint32_t> entries, std::span<const std::byte> bytes,
            std::span<const std::uint32_t> tokens, cudaStream_t stream = nullptr) {
    check_load(layout(), capacity(), entries, bytes, tokens);
    if (entries.empty()) {
      return;
    }
    const std::vector<std::uint16_t> staged = stage_load(layout(), bytes);
    const std::vector<std::uint16_t> counts(tokens.begin(), tokens.end());
    store_.write_entries(entries, {staged.data()}, counts.data(), stream,
                         "::load: copying the entries");
  }

  //! @brief `load` of one entry, the host `loadable_summary::load(b, bytes, tokens)` shape.
  void load(std::uint32_t b, std::span<const std::byte> bytes, std::uint32_t tokens,
            cudaStream_t stream = nullptr) {
    load(std::span<const std::uint32_t>(&b, 1), bytes, std::span<const std::uint32_t>(&tokens, 1),
         stream);
  }

 private:
  using store = device_summary_store<1>;

  // Bytes of one entry's bounds of one KV head.
  static std::size_t row_bytes(const kv_layout& l) noexcept {
    return 2 * std::size_t{l.head_dim} * sizeof(f16);
  }

  // Launches the fold kernel for the store: a CTA per KV head.
  struct folder {
    const device_minmax_summary* s;
    cudaStream_t stream;
    void operator()(const detail::summary_fold& f) const {
      detail::minmax_fold_args a;
      static_cast<detail::summary_fold&>(a) = f;
      a.bounds = s->store_.data<f16>(0);
      visit_dtype(s->layout().kv_dtype, [&](auto elem) {
        using T = decltype(elem);
        detail::minmax_fold_kernel<T><<<dim3(f.num_kv_heads), detail::fold_threads, 0, stream>>>(a);
      });
    }
  };

  store store_;
};

static_assert(device_summary<device_minmax_summary>);

}  // namespace oasiskv::cuda
