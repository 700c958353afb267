// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cuda::device_quantized_minmax_summary`: `quantized_minmax_summary` (int8 min/max
//! bounds, a power-of-two scale per (entry, KV head)) in device memory, updated on the device
//! with the host's bits and scored by `cuda::topk_selector`.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "oasiskv/concepts/device_summary.hpp"
#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/layout.hpp"
#include "oasiskv/summary/cuda/detail/qminmax_fold_kernel.cuh"
#include "oasiskv/summary/cuda/device_summary_store.cuh"
// The summary/cpu/ kernels use `#pragma GCC unroll`, which g++ knows and nvcc's front end
// reports (1675) as unrecognised; silence it for that header only.
#pragma nv_diag_suppress 1675
#include "oasiskv/summary/quantized_minmax_summary.hpp"
#pragma nv_diag_default 1675

namespace oasiskv::cuda {

//! @brief `quantized_minmax_summary` in device memory, per entry rather than in the host's
//! 16-entry tiles: code words `[num_kv_heads][capacity][head_dim / 2]` (`uint32`, bytes 0-3 the
//! int8 codes `max(2p)`, `-min(2p)`, `max(2p+1)`, `-min(2p+1)`: the host's `bound_words`, so one
//! entry of one head is `2 head_dim` contiguous bytes, read with 16-byte loads and multiplied with
//! `dp4a`), scales and norms `[num_kv_heads][capacity]` f32 (`2^e`, 0 when empty; `||A||_2`
//! rounded up), a bias `[capacity]` f32 (0; `-inf` empty; `+inf` after a non-finite key) and a
//! token count `[capacity]` u16. Move-only; owns its memory.
//!
//! Filled either by `upload` from a host `quantized_minmax_summary` or on the device by `update`
//! (appended key rows), `recompute` (a block's keys in a fast-tier slot) and `reset`, which give
//! the same codes, scales, norms and bias as the host's `update` / `reset` for the same keys
//! (f16, bf16 or f32): the per-element rules are the `__host__ __device__` functions of
//! `detail/qminmax_math.cuh` (quotients by a power of two are exact, squares summed as integers,
//! the rounding-sensitive steps with `_rn` intrinsics). An infinite key is left out of the codes
//! and makes the entry score `+inf`; a NaN key is ignored, as on the host; an empty entry scores
//! `-inf`. Kernels must not be built with `-ftz=true` (subnormal f32 keys).
//!
//! The token counts are mirrored on the host (every change goes through the
//! `device_summary_store` beneath), so `update` checks the block's capacity before it launches;
//! device-side writes are asynchronous on the given stream (one CTA per call, looping over the KV
//! heads). Unlike the host summary, an update past `tokens_per_block` is an error, not a
//! saturation.
//!
//! As the host model, it grows (`grow`: every entry kept, on the device) and takes shipped
//! summaries (`load`: the host wire format, quantized by the host `load` itself), with their
//! arguments checked on the host by `check_grow` / `check_load`. Models `device_summary`.
class device_quantized_minmax_summary {
 public:
  //! @brief Allocates `capacity` empty entries for `layout` (synchronous); `errc::invalid_argument`
  //! for a zero capacity or an invalid layout, `errc::out_of_memory` when allocation fails.
  device_quantized_minmax_summary(const kv_layout& layout, std::uint32_t capacity)
      : store_(
            "cuda::device_quantized_minmax_summary", layout, capacity,
            {device_summary_array{.width = layout.head_dim / 2 * sizeof(std::uint32_t)},
             device_summary_array{.width = sizeof(float)},
             device_summary_array{.width = sizeof(float)},
             device_summary_array{.width = sizeof(float), .per_head = false, .empty = neg_inf}}) {}

  //! @brief The layout the summary was built for.
  const kv_layout& layout() const noexcept { return store_.layout(); }
  //! @brief Entries held.
  std::uint32_t capacity() const noexcept { return store_.capacity(); }
  //! @brief Device code words, `[num_kv_heads][capacity][head_dim / 2]` (see the class comment).
  const std::uint32_t* codes() const noexcept { return store_.data<std::uint32_t>(codes_array); }
  //! @brief Device scales `2^e`, `[num_kv_heads][capacity]` (0 for an empty entry).
  const float* scales() const noexcept { return store_.data<float>(scales_array); }
  //! @brief Device norms `||A||_2` rounded up, `[num_kv_heads][capacity]`.
  const float* norms() const noexcept { return store_.data<float>(norms_array); }
  //! @brief Device biases, `[capacity]`: 0, `-inf` for an empty entry, `+inf` after a
  //! non-finite key.
  const float* biases() const noexcept { return store_.data<float>(biases_array); }
  //! @brief Device token counts, `[capacity]`.
  const std::uint16_t* tokens() const noexcept { return store_.tokens(); }
  //! @brief Tokens folded into entry `e` (the host mirror of the device count; no synchronisation).
  std::uint32_t tokens(std::uint32_t e) const { return store_.tokens(e); }

  //! @brief Copies entries `entries` of a host summary of the same layout and capacity
  //! (synchronous, through the legacy default stream: synchronise a non-blocking stream that
  //! `update` used first). `errc::layout_mismatch` when layout or capacity differ,
  //! `errc::out_of_range` for an entry beyond the capacity (nothing copied).
  void upload(const quantized_minmax_summary& host, std::span<const std::uint32_t> entries) {
    store_.check_host(host.layout(), host.capacity());
    for (const std::uint32_t b : entries) {
      store_.check_entry(b, "upload");
    }
    const std::size_t heads = layout().num_kv_heads, pairs = layout().head_dim / 2;
    staged_entries st;
    st.words.resize(entries.size() * heads * pairs);
    st.scales.resize(entries.size() * heads);
    st.norms.resize(entries.size() * heads);
    st.biases.resize(entries.size());
    st.tokens.resize(entries.size());
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const std::uint32_t b = entries[i];
      for (std::uint32_t h = 0; h < heads; ++h) {
        st.scales[i * heads + h] =
            host.bound_words(h, b, st.words.data() + (i * heads + h) * pairs);
        st.norms[i * heads + h] = host.norm(h, b);
      }
      const std::uint32_t n = host.tokens(b);
      st.biases[i] = host.overflowed(b) ? INFINITY : n == 0 ? -INFINITY : 0.0f;
      st.tokens[i] = static_cast<std::uint16_t>(n);
    }
    write(entries, st, nullptr, "::upload");
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
  //! [head_dim]` keys first), on `stream`: as the host's `reset(e)` then `update(e, block, 0,
  //! count)`. `count = 0` empties it. Throws as `update` (`count` above `tokens_per_block` is
  //! `errc::out_of_range`).
  void recompute(std::uint32_t e, const std::byte* block, std::uint32_t count,
                 cudaStream_t stream = nullptr, bool check_pointers = true) {
    store_.recompute(e, block, count, check_pointers, folder{this, stream});
  }

  //! @brief Empties entry `e` on `stream` (zero codes, scales and norms, no tokens: it scores
  //! `-inf`). `errc::out_of_range` for an entry beyond the capacity.
  void reset(std::uint32_t e, cudaStream_t stream = nullptr) {
    store_.reset(e, folder{this, stream});
  }

  //! @brief Throws unless `capacity` may replace `current` in `grow`: `errc::invalid_argument`
  //! below it (the host `quantized_minmax_summary::grow`'s rule). Host-only; needs no device.
  static void check_grow(std::uint32_t current, std::uint32_t capacity) {
    oasiskv::detail::check_summary_grow("cuda::device_quantized_minmax_summary", current, capacity);
  }

  //! @brief Capacity becomes `capacity` (models the host's `growable_summary::grow`): entries
  //! `[0, capacity())` keep their codes, scales, norms, bias and token counts (device-to-device
  //! copies into new allocations), the new entries start empty as a fresh summary's (zero codes,
  //! scales and norms, bias `-inf`, no tokens). An equal capacity does nothing; a smaller one is
  //! `errc::invalid_argument`. All or nothing: a failed allocation throws `errc::out_of_memory`
  //! (another CUDA failure its `oasiskv::error`) with the old buffers, capacity and token counts
  //! untouched.
  //!
  //! Stream ordering: the copies are enqueued on `stream`, after the work enqueued there before
  //! (an `update` on `stream` is copied with its result); work on other streams that reads or
  //! writes this summary (updates, `topk_selector::select`) must be finished before the call.
  //! The call synchronises `stream`, then frees the old buffers: every device pointer accessor
  //! changes, so a selection or a captured graph holding the old pointers must not run afterwards.
  void grow(std::uint32_t capacity, cudaStream_t stream = nullptr) {
    store_.grow(capacity, stream);
  }

  //! @brief Bytes of one shipped entry, as the host `quantized_minmax_summary::wire_bytes`:
  //! `[num_kv_heads][2 (max, min)][head_dim]` f16.
  std::size_t wire_bytes() const noexcept { return wire_bytes_of(layout()); }
  //! @brief `wire_bytes()` of a summary with layout `l` (host-only).
  static std::size_t wire_bytes_of(const kv_layout& l) noexcept { return store::wire_bytes_of(l); }

  //! @brief Throws unless `load(entries, bytes, tokens)` may run on a summary of `layout` and
  //! `capacity`, naming the offending value: `errc::invalid_argument` when `tokens` does not hold
  //! one count per entry, `bytes` is not `entries.size() * wire_bytes()` long, or a finite
  //! maximum is below its finite minimum (naming the entry, KV head and dimension, as the host
  //! `load` refuses it); `errc::out_of_range` for an entry at or beyond `capacity` or a token count
  //! outside `[1, tokens_per_block]`. Host-only; needs no device.
  static void check_load(const kv_layout& layout, std::uint32_t capacity,
                         std::span<const std::uint32_t> entries, std::span<const std::byte> bytes,
                         std::span<const std::uint32_t> tokens) {
    store::check_load("cuda::device_quantized_minmax_summary::load", layout, capacity, entries,
                      bytes, tokens);
    const std::size_t wire = wire_bytes_of(layout);
    const std::uint32_t d = layout.head_dim;
    for (std::size_t i = 0; i < entries.size(); ++i) {
      for (std::uint32_t h = 0; h < layout.num_kv_heads; ++h) {
        for (std::uint32_t x = 0; x < d; ++x) {
          f16 w[2];
          for (std::uint32_t which = 0; which < 2; ++which) {
            std::memcpy(&w[which],
                        bytes.data() + i * wire + ((std::size_t{h} * 2 + which) * d + x) * 2, 2);
          }
          const float hi = w[0].to_float(), lo = w[1].to_float();
          if (std::isfinite(hi) && std::isfinite(lo) && hi < lo) [[unlikely]] {
            oasiskv::detail::raise(errc::invalid_argument,
                                   "cuda::device_quantized_minmax_summary::load: entry ",
                                   entries[i], ", kv head ", h, ", dimension ", x, ": maximum ", hi,
                                   " is below minimum ", lo);
          }
        }
      }
    }
  }

  //! @brief What `load` copies, per shipped entry `i` (see `stage_load`).
  struct staged_entries {
    std::vector<std::uint32_t> words;  //!< code words `[entries][num_kv_heads][head_dim / 2]`
    std::vector<float> scales;         //!< scales `[entries][num_kv_heads]`
    std::vector<float> norms;          //!< norms `[entries][num_kv_heads]`
    std::vector<float> biases;  //!< biases `[entries]`: 0, or `+inf` after a non-finite bound
    std::vector<std::uint16_t> tokens;  //!< token counts `[entries]`
  };

  //! @brief The host half of `load`: `bytes` and `tokens` (as `check_load` accepts them)
  //! quantized by the host `quantized_minmax_summary::load` itself, into a scratch summary of
  //! one entry per shipped one, and read back in the device's per-entry order (`bound_words`,
  //! `norm`, `overflowed`). Host-only; needs no device.
  static staged_entries stage_load(const kv_layout& layout, std::span<const std::byte> bytes,
                                   std::span<const std::uint32_t> tokens) {
    const std::size_t n = tokens.size(), heads = layout.num_kv_heads, pairs = layout.head_dim / 2;
    const std::size_t wire = wire_bytes_of(layout);
    staged_entries st;
    if (n == 0) {
      return st;
    }
    quantized_minmax_summary scratch(layout, static_cast<std::uint32_t>(n));
    st.words.resize(n * heads * pairs);
    st.scales.resize(n * heads);
    st.norms.resize(n * heads);
    st.biases.resize(n);
    st.tokens.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      const auto b = static_cast<std::uint32_t>(i);
      scratch.load(b, bytes.subspan(i * wire, wire), tokens[i]);
      for (std::uint32_t h = 0; h < heads; ++h) {
        st.scales[i * heads + h] =
            scratch.bound_words(h, b, st.words.data() + (i * heads + h) * pairs);
        st.norms[i * heads + h] = scratch.norm(h, b);
      }
      st.biases[i] = scratch.overflowed(b) ? INFINITY : 0.0f;
      st.tokens[i] = static_cast<std::uint16_t>(tokens[i]);
    }
    return st;
  }

  //! @brief Sets entries `entries[i]` from f16 bounds computed elsewhere (models the host's
  //! `loadable_summary::load` for a batch): `bytes` is `[entries.size()][wire_bytes()]`, entry
  //! `i`'s shipped bounds as `quantized_minmax_summary::load` takes them (per KV head the
  //! elementwise maximum then minimum key as f16: `disagg::summarize_block`), and `tokens[i]` its
  //! block's token count. The bounds are quantized on the host by the host summary's own `load`
  //! (into a scratch summary), so each entry then holds the codes, scales, norms, bias (`+inf`
  //! after a non-finite bound) and token count the host summary holds after
  //! `load(entries[i], bytes_i, tokens[i])`: `upload` of that host summary gives the same device
  //! bytes. Later `update`s fold into the entry. A repeated entry takes its last bytes. Everything
  //! is checked before any copy (`check_load`), and the summary is then unchanged.
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
    write(entries, stage_load(layout(), bytes, tokens), stream, "::load: copying the entries");
  }

  //! @brief `load` of one entry, the host `loadable_summary::load(b, bytes, tokens)` shape.
  void load(std::uint32_t b, std::span<const std::byte> bytes, std::uint32_t tokens,
            cudaStream_t stream = nullptr) {
    load(std::span<const std::uint32_t>(&b, 1), bytes, std::span<const std::uint32_t>(&tokens, 1),
         stream);
  }

 private:
  using store = device_summary_store<4>;
  static constexpr std::size_t codes_array = 0, scales_array = 1, norms_array = 2, biases_array = 3;
  static constexpr std::uint32_t neg_inf = 0xff800000u;  // -inf, an empty entry's bias

  void write(std::span<const std::uint32_t> entries, const staged_entries& st, cudaStream_t stream,
             const char* what) {
    store_.write_entries(entries,
                         {st.words.data(), st.scales.data(), st.norms.data(), st.biases.data()},
                         st.tokens.data(), stream, what);
  }

  // Launches the fold kernel for the store: one CTA for the entry, looping over the KV heads.
  struct folder {
    const device_quantized_minmax_summary* s;
    cudaStream_t stream;
    void operator()(const detail::summary_fold& f) const {
      detail::qminmax_fold_args a;
      static_cast<detail::summary_fold&>(a) = f;
      a.codes = s->store_.data<std::uint32_t>(codes_array);
      a.scale = s->store_.data<float>(scales_array);
      a.norm = s->store_.data<float>(norms_array);
      a.bias = s->store_.data<float>(biases_array);
      visit_dtype(s->layout().kv_dtype, [&](auto elem) {
        using T = decltype(elem);
        detail::qminmax_fold_kernel<T><<<1, detail::qfold_threads, 0, stream>>>(a);
      });
    }
  };

  store store_;
};

static_assert(device_summary<device_quantized_minmax_summary>);

}  // namespace oasiskv::cuda
