// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cuda::device_quantized_minmax_summary`: `quantized_minmax_summary` (int8 min/max
//! bounds, a power-of-two scale per (entry, KV head)) in device memory, updated on the device
//! with the host's bits and scored by `cuda::topk_selector`.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <span>
#include <utility>
#include <vector>

#include "oasiskv/core/error.hpp"
#include "oasiskv/core/layout.hpp"
#include "oasiskv/cuda/detail/runtime.cuh"
#include "oasiskv/summary/cuda/detail/qminmax_fold_kernel.cuh"
// The summary/cpu/ kernels use `#pragma GCC unroll`, which g++ knows and nvcc's front end
// reports (1675) as unrecognised; silence it for that header only.
#pragma nv_diag_suppress 1675
#include "oasiskv/summary/quantized_minmax_summary.hpp"
#pragma nv_diag_default 1675

namespace oasiskv::cuda {

namespace detail {

//! @brief Throws unless a batch `load` of `entries` (with `bytes` bytes, `[entries.size()][wire]`,
//! and one token count per entry in `tokens`) may run on a device summary of `layout` and
//! `capacity`; `who` names the call in the message, which names the offending value. Host-only.
inline void check_summary_load_batch(const char* who, const kv_layout& layout,
                                     std::uint32_t capacity, std::span<const std::uint32_t> entries,
                                     std::size_t bytes, std::span<const std::uint32_t> tokens,
                                     std::size_t wire) {
  if (tokens.size() != entries.size()) [[unlikely]] {
    oasiskv::detail::raise(errc::invalid_argument, who, ": ", entries.size(), " entries but ",
                           tokens.size(), " token counts");
  }
  if (bytes != entries.size() * wire) [[unlikely]] {
    oasiskv::detail::raise(errc::invalid_argument, who, ": got ", bytes, " bytes for ",
                           entries.size(), " entries, expected ", entries.size(), " x ", wire,
                           " = ", entries.size() * wire, " (", layout.num_kv_heads,
                           " kv heads x 2 x head_dim ", layout.head_dim, " x f16 each)");
  }
  for (std::size_t i = 0; i < entries.size(); ++i) {
    if (entries[i] >= capacity) [[unlikely]] {
      oasiskv::detail::raise(errc::out_of_range, who, ": entry ", entries[i],
                             " >= capacity = ", capacity);
    }
    if (tokens[i] == 0 || tokens[i] > layout.tokens_per_block) [[unlikely]] {
      oasiskv::detail::raise(errc::out_of_range, who, ": entry ", entries[i], " of ", tokens[i],
                             " tokens; a block holds 1 to ", layout.tokens_per_block);
    }
  }
}

//! @brief The widest pitch handed to a 2D copy or set: `cudaDevAttrMaxPitch` of current devices
//! (2^31 - 1 bytes). Arrays with wider rows are copied row by row.
inline constexpr std::size_t max_copy_pitch = 0x7fffffff;

//! @brief `height` rows of `width` bytes from `src` (rows `spitch` apart) to `dst` (rows `dpitch`
//! apart) on `stream`: one `cudaMemcpy2DAsync`, or one `cudaMemcpyAsync` per row where a pitch
//! is beyond `max_copy_pitch`. The first error, if any.
inline cudaError_t copy_rows_async(void* dst, std::size_t dpitch, const void* src,
                                   std::size_t spitch, std::size_t width, std::size_t height,
                                   cudaMemcpyKind kind, cudaStream_t stream) {
  if (dpitch <= max_copy_pitch && spitch <= max_copy_pitch) {
    return cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream);
  }
  for (std::size_t r = 0; r < height; ++r) {
    if (const cudaError_t e =
            cudaMemcpyAsync(static_cast<std::byte*>(dst) + r * dpitch,
                            static_cast<const std::byte*>(src) + r * spitch, width, kind, stream);
        e != cudaSuccess) {
      return e;
    }
  }
  return cudaSuccess;
}

//! @brief Zeroes `height` rows of `width` bytes at `dst`, rows `pitch` apart, on `stream`
//! (`cudaMemset2DAsync`, or row by row beyond `max_copy_pitch`). The first error, if any.
inline cudaError_t clear_rows_async(void* dst, std::size_t pitch, std::size_t width,
                                    std::size_t height, cudaStream_t stream) {
  if (pitch <= max_copy_pitch) {
    return cudaMemset2DAsync(dst, pitch, 0, width, height, stream);
  }
  for (std::size_t r = 0; r < height; ++r) {
    if (const cudaError_t e =
            cudaMemsetAsync(static_cast<std::byte*>(dst) + r * pitch, 0, width, stream);
        e != cudaSuccess) {
      return e;
    }
  }
  return cudaSuccess;
}

}  // namespace detail

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
//! The token counts are mirrored on the host (every change goes through this class), so
//! `update` checks the block's capacity before it launches; device-side writes are asynchronous
//! on the given stream (one CTA per call, looping over the KV heads). Unlike the host summary,
//! an update past `tokens_per_block` is an error, not a saturation.
//!
//! As the host model, it grows (`grow`: every entry kept, on the device) and takes shipped
//! summaries (`load`: the host wire format, quantized by the host `load` itself), with their
//! arguments checked on the host by `check_grow` / `check_load`.
class device_quantized_minmax_summary {
 public:
  //! @brief Allocates `capacity` empty entries for `layout` (synchronous); `errc::invalid_argument`
  //! for a zero capacity or an invalid layout, `errc::out_of_memory` when allocation fails.
  device_quantized_minmax_summary(const kv_layout& layout, std::uint32_t capacity)
      : layout_(layout), capacity_(capacity) {
    layout_.validate();
    if (capacity_ == 0) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument,
                             "cuda::device_quantized_minmax_summary capacity is 0");
    }
    host_tokens_.assign(capacity_, 0);
    try {
      codes_ = static_cast<std::uint32_t*>(alloc(slots() * pairs() * sizeof(std::uint32_t)));
      scale_ = static_cast<float*>(alloc(slots() * sizeof(float)));
      norm_ = static_cast<float*>(alloc(slots() * sizeof(float)));
      bias_ = static_cast<float*>(alloc(std::size_t{capacity_} * sizeof(float)));
      tokens_ = static_cast<std::uint16_t*>(alloc(std::size_t{capacity_} * sizeof(std::uint16_t)));
      // Empty entries as the host's: zero codes, scales and norms, bias -inf, no tokens; finished
      // before this returns, since updates may come on a stream that does not wait for the
      // legacy default stream.
      (void)cudaMemset(codes_, 0, slots() * pairs() * sizeof(std::uint32_t));
      (void)cudaMemset(scale_, 0, slots() * sizeof(float));
      (void)cudaMemset(norm_, 0, slots() * sizeof(float));
      (void)cudaMemset(tokens_, 0, std::size_t{capacity_} * sizeof(std::uint16_t));
      const std::vector<float> empty(capacity_, -INFINITY);
      detail::check(
          cudaMemcpy(bias_, empty.data(), empty.size() * sizeof(float), cudaMemcpyHostToDevice),
          "cuda::device_quantized_minmax_summary: clearing the entries");
      detail::check(cudaStreamSynchronize(nullptr),
                    "cuda::device_quantized_minmax_summary: clearing the entries");
    } catch (...) {
      release();
      throw;
    }
  }
  //! @brief Takes `o`'s memory; `o` is left empty.
  device_quantized_minmax_summary(device_quantized_minmax_summary&& o) noexcept
      : layout_(o.layout_),
        capacity_(o.capacity_),
        codes_(std::exchange(o.codes_, nullptr)),
        scale_(std::exchange(o.scale_, nullptr)),
        norm_(std::exchange(o.norm_, nullptr)),
        bias_(std::exchange(o.bias_, nullptr)),
        tokens_(std::exchange(o.tokens_, nullptr)),
        host_tokens_(std::move(o.host_tokens_)) {}
  device_quantized_minmax_summary& operator=(device_quantized_minmax_summary&&) = delete;
  device_quantized_minmax_summary(const device_quantized_minmax_summary&) = delete;
  device_quantized_minmax_summary& operator=(const device_quantized_minmax_summary&) = delete;
  ~device_quantized_minmax_summary() { release(); }

  //! @brief The layout the summary was built for.
  const kv_layout& layout() const noexcept { return layout_; }
  //! @brief Entries held.
  std::uint32_t capacity() const noexcept { return capacity_; }
  //! @brief Device code words, `[num_kv_heads][capacity][head_dim / 2]` (see the class comment).
  const std::uint32_t* codes() const noexcept { return codes_; }
  //! @brief Device scales `2^e`, `[num_kv_heads][capacity]` (0 for an empty entry).
  const float* scales() const noexcept { return scale_; }
  //! @brief Device norms `||A||_2` rounded up, `[num_kv_heads][capacity]`.
  const float* norms() const noexcept { return norm_; }
  //! @brief Device biases, `[capacity]`: 0, `-inf` for an empty entry, `+inf` after a
  //! non-finite key.
  const float* biases() const noexcept { return bias_; }
  //! @brief Device token counts, `[capacity]`.
  const std::uint16_t* tokens() const noexcept { return tokens_; }
  //! @brief Tokens folded into entry `e` (the host mirror of the device count; no synchronisation).
  std::uint32_t tokens(std::uint32_t e) const {
    check_entry(e, "tokens");
    return host_tokens_[e];
  }

  //! @brief Copies entries `entries` of a host summary of the same layout and capacity
  //! (synchronous, through the legacy default stream: synchronise a non-blocking stream that
  //! `update` used first). `errc::layout_mismatch` when layout or capacity differ,
  //! `errc::out_of_range` for an entry beyond the capacity (nothing copied).
  void upload(const quantized_minmax_summary& host, std::span<const std::uint32_t> entries) {
    if (!(host.layout() == layout_) || host.capacity() != capacity_) [[unlikely]] {
      oasiskv::detail::raise(errc::layout_mismatch,
                             "cuda::device_quantized_minmax_summary::upload: the host summary's "
                             "layout or capacity differs (capacity ",
                             host.capacity(), " against ", capacity_, ")");
    }
    for (const std::uint32_t b : entries) {
      check_entry(b, "upload");
    }
    std::vector<std::uint32_t> words(pairs());
    for (const std::uint32_t b : entries) {
      for (std::uint32_t h = 0; h < layout_.num_kv_heads; ++h) {
        const std::size_t slot = std::size_t{h} * capacity_ + b;
        const float s = host.bound_words(h, b, words.data());
        const float n = host.norm(h, b);
        copy_up(codes_ + slot * pairs(), words.data(), pairs() * sizeof(std::uint32_t));
        copy_up(scale_ + slot, &s, sizeof(s));
        copy_up(norm_ + slot, &n, sizeof(n));
      }
      const std::uint32_t n = host.tokens(b);
      const float bias = host.overflowed(b) ? INFINITY : n == 0 ? -INFINITY : 0.0f;
      const auto t = static_cast<std::uint16_t>(n);
      copy_up(bias_ + b, &bias, sizeof(bias));
      copy_up(tokens_ + b, &t, sizeof(t));
      host_tokens_[b] = t;
    }
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
    check_entry(e, "update");
    if (n == 0) {
      return;
    }
    const std::uint32_t have = host_tokens_[e];
    if (n > layout_.tokens_per_block - have) [[unlikely]] {
      oasiskv::detail::raise(
          errc::out_of_range, "cuda::device_quantized_minmax_summary::update: entry ", e, " holds ",
          have, " tokens; ", n, " more exceed tokens_per_block = ", layout_.tokens_per_block);
    }
    check_keys(keys, check_pointers, "cuda::device_quantized_minmax_summary::update: keys");
    detail::qminmax_fold_args a = fold_args(e);
    a.keys = keys;
    a.token_stride = std::size_t{layout_.num_kv_heads} * layout_.head_dim;
    a.head_stride = layout_.head_dim;
    a.count = n;
    a.new_tokens = static_cast<std::uint16_t>(have + n);
    a.fresh = have == 0;
    launch_fold(a, stream, "cuda::device_quantized_minmax_summary::update: launch");
    host_tokens_[e] = a.new_tokens;
  }

  //! @brief Recomputes entry `e` from the first `count` tokens of a block in device memory laid
  //! out as a fast-tier slot (`kv_layout::key_offset`: `[num_kv_heads][tokens_per_block]
  //! [head_dim]` keys first), on `stream`: as the host's `reset(e)` then `update(e, block, 0,
  //! count)`. `count = 0` empties it. Throws as `update` (`count` above `tokens_per_block` is
  //! `errc::out_of_range`).
  void recompute(std::uint32_t e, const std::byte* block, std::uint32_t count,
                 cudaStream_t stream = nullptr, bool check_pointers = true) {
    check_entry(e, "recompute");
    if (count > layout_.tokens_per_block) [[unlikely]] {
      oasiskv::detail::raise(
          errc::out_of_range, "cuda::device_quantized_minmax_summary::recompute: entry ", e,
          " from ", count, " tokens; a block holds at most ", layout_.tokens_per_block);
    }
    if (count == 0) {
      reset(e, stream);
      return;
    }
    check_keys(block, check_pointers, "cuda::device_quantized_minmax_summary::recompute: block");
    detail::qminmax_fold_args a = fold_args(e);
    a.keys = block;
    a.token_stride = layout_.head_dim;
    a.head_stride = std::size_t{layout_.tokens_per_block} * layout_.head_dim;
    a.count = count;
    a.new_tokens = static_cast<std::uint16_t>(count);
    a.fresh = true;
    launch_fold(a, stream, "cuda::device_quantized_minmax_summary::recompute: launch");
    host_tokens_[e] = a.new_tokens;
  }

  //! @brief Empties entry `e` on `stream` (zero codes, scales and norms, no tokens: it scores
  //! `-inf`). `errc::out_of_range` for an entry beyond the capacity.
  void reset(std::uint32_t e, cudaStream_t stream = nullptr) {
    check_entry(e, "reset");
    detail::qminmax_fold_args a = fold_args(e);
    a.clear = true;
    launch_fold(a, stream, "cuda::device_quantized_minmax_summary::reset: launch");
    host_tokens_[e] = 0;
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
    check_grow(capacity_, capacity);
    if (capacity == capacity_) {
      return;
    }
    const std::size_t heads = layout_.num_kv_heads, old_c = capacity_, new_c = capacity;
    std::uint32_t* codes = nullptr;
    float* scale = nullptr;
    float* norm = nullptr;
    float* bias = nullptr;
    std::uint16_t* tokens = nullptr;
    std::vector<std::uint16_t> host;
    try {
      codes = static_cast<std::uint32_t*>(alloc(heads * new_c * pairs() * sizeof(std::uint32_t)));
      scale = static_cast<float*>(alloc(heads * new_c * sizeof(float)));
      norm = static_cast<float*>(alloc(heads * new_c * sizeof(float)));
      bias = static_cast<float*>(alloc(new_c * sizeof(float)));
      tokens = static_cast<std::uint16_t*>(alloc(new_c * sizeof(std::uint16_t)));
      try {
        host.assign(capacity, 0);
      } catch (const std::bad_alloc&) {
        oasiskv::detail::raise(
            errc::out_of_memory,
            "cuda::device_quantized_minmax_summary::grow: the host token mirror");
      }
      std::copy(host_tokens_.begin(), host_tokens_.end(), host.begin());
      const std::vector<float> empty(new_c - old_c, -INFINITY);
      const char* what = "cuda::device_quantized_minmax_summary::grow: copying the entries";
      // [heads][capacity][width] arrays: each head's old entries to the front of its new row,
      // the rest zero.
      auto regrow = [&](void* dst, const void* src, std::size_t width) {
        const std::size_t old_w = old_c * width, new_w = new_c * width;
        detail::check(detail::copy_rows_async(dst, new_w, src, old_w, old_w, heads,
                                              cudaMemcpyDeviceToDevice, stream),
                      what);
        detail::check(detail::clear_rows_async(static_cast<std::byte*>(dst) + old_w, new_w,
                                               new_w - old_w, heads, stream),
                      what);
      };
      regrow(codes, codes_, pairs() * sizeof(std::uint32_t));
      regrow(scale, scale_, sizeof(float));
      regrow(norm, norm_, sizeof(float));
      detail::check(
          cudaMemcpyAsync(bias, bias_, old_c * sizeof(float), cudaMemcpyDeviceToDevice, stream),
          what);
      detail::check(cudaMemcpyAsync(bias + old_c, empty.data(), empty.size() * sizeof(float),
                                    cudaMemcpyHostToDevice, stream),
                    what);
      detail::check(cudaMemcpyAsync(tokens, tokens_, old_c * sizeof(std::uint16_t),
                                    cudaMemcpyDeviceToDevice, stream),
                    what);
      detail::check(
          cudaMemsetAsync(tokens + old_c, 0, (new_c - old_c) * sizeof(std::uint16_t), stream),
          what);
      detail::check(cudaStreamSynchronize(stream), what);  // also: `empty` may go
    } catch (...) {
      (void)cudaFree(codes);
      (void)cudaFree(scale);
      (void)cudaFree(norm);
      (void)cudaFree(bias);
      (void)cudaFree(tokens);
      throw;
    }
    release();
    codes_ = codes;
    scale_ = scale;
    norm_ = norm;
    bias_ = bias;
    tokens_ = tokens;
    host_tokens_ = std::move(host);
    capacity_ = capacity;
  }

  //! @brief Bytes of one shipped entry, as the host `quantized_minmax_summary::wire_bytes`:
  //! `[num_kv_heads][2 (max, min)][head_dim]` f16.
  std::size_t wire_bytes() const noexcept { return wire_bytes_of(layout_); }
  //! @brief `wire_bytes()` of a summary with layout `l` (host-only).
  static std::size_t wire_bytes_of(const kv_layout& l) noexcept {
    return std::size_t{l.num_kv_heads} * 2 * l.head_dim * sizeof(f16);
  }

  //! @brief Throws unless `load(entries, bytes, tokens)` may run on a summary of `layout` and
  //! `capacity`, naming the offending value: `errc::invalid_argument` when `tokens` does not hold
  //! one count per entry, `bytes` is not `entries.size() * wire_bytes()` long, or a finite
  //! maximum is below its finite minimum (naming the entry, KV head and dimension, as the host
  //! `load` refuses it); `errc::out_of_range` for an entry at or beyond `capacity` or a token count
  //! outside `[1, tokens_per_block]`. Host-only; needs no device.
  static void check_load(const kv_layout& layout, std::uint32_t capacity,
                         std::span<const std::uint32_t> entries, std::span<const std::byte> bytes,
                         std::span<const std::uint32_t> tokens) {
    const std::size_t wire = wire_bytes_of(layout);
    detail::check_summary_load_batch("cuda::device_quantized_minmax_summary::load", layout,
                                     capacity, entries, bytes.size(), tokens, wire);
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
    check_load(layout_, capacity_, entries, bytes, tokens);
    if (entries.empty()) {
      return;
    }
    const std::size_t n = entries.size(), heads = layout_.num_kv_heads;
    const staged_entries st = stage_load(layout_, bytes, tokens);
    const char* what = "cuda::device_quantized_minmax_summary::load: copying the entries";
    const std::size_t word_row = pairs() * sizeof(std::uint32_t);
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint32_t e = entries[i];
      detail::check(detail::copy_rows_async(codes_ + std::size_t{e} * pairs(), capacity_ * word_row,
                                            st.words.data() + i * heads * pairs(), word_row,
                                            word_row, heads, cudaMemcpyHostToDevice, stream),
                    what);
      detail::check(detail::copy_rows_async(scale_ + e, capacity_ * sizeof(float),
                                            st.scales.data() + i * heads, sizeof(float),
                                            sizeof(float), heads, cudaMemcpyHostToDevice, stream),
                    what);
      detail::check(detail::copy_rows_async(norm_ + e, capacity_ * sizeof(float),
                                            st.norms.data() + i * heads, sizeof(float),
                                            sizeof(float), heads, cudaMemcpyHostToDevice, stream),
                    what);
      detail::check(
          cudaMemcpyAsync(bias_ + e, &st.biases[i], sizeof(float), cudaMemcpyHostToDevice, stream),
          what);
      detail::check(cudaMemcpyAsync(tokens_ + e, &st.tokens[i], sizeof(std::uint16_t),
                                    cudaMemcpyHostToDevice, stream),
                    what);
    }
    detail::check(cudaStreamSynchronize(stream), what);
    for (std::size_t i = 0; i < n; ++i) {
      host_tokens_[entries[i]] = st.tokens[i];
    }
  }

  //! @brief `load` of one entry, the host `loadable_summary::load(b, bytes, tokens)` shape.
  void load(std::uint32_t b, std::span<const std::byte> bytes, std::uint32_t tokens,
            cudaStream_t stream = nullptr) {
    load(std::span<const std::uint32_t>(&b, 1), bytes, std::span<const std::uint32_t>(&tokens, 1),
         stream);
  }

 private:
  std::size_t slots() const noexcept { return std::size_t{layout_.num_kv_heads} * capacity_; }
  std::size_t pairs() const noexcept { return layout_.head_dim / 2; }
  static void* alloc(std::size_t bytes) {
    void* p = nullptr;
    detail::check(cudaMalloc(&p, bytes), "cuda::device_quantized_minmax_summary: cudaMalloc",
                  errc::out_of_memory);
    return p;
  }
  static void copy_up(void* dst, const void* src, std::size_t bytes) {
    detail::check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice),
                  "cuda::device_quantized_minmax_summary::upload");
  }
  void release() noexcept {
    (void)cudaFree(codes_);
    (void)cudaFree(scale_);
    (void)cudaFree(norm_);
    (void)cudaFree(bias_);
    (void)cudaFree(tokens_);
  }
  void check_entry(std::uint32_t e, const char* what) const {
    if (e >= capacity_) [[unlikely]] {
      oasiskv::detail::raise(errc::out_of_range, "cuda::device_quantized_minmax_summary::", what,
                             ": entry ", e, " >= capacity = ", capacity_);
    }
  }
  static void check_keys(const void* keys, bool check_pointers, const char* what) {
    if (keys == nullptr) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, what, " is null");
    }
    if (check_pointers) {
      detail::require_device_pointer(keys, detail::current_device(), what);
    }
  }
  detail::qminmax_fold_args fold_args(std::uint32_t e) const noexcept {
    detail::qminmax_fold_args a;
    a.codes = codes_;
    a.scale = scale_;
    a.norm = norm_;
    a.bias = bias_;
    a.tokens = tokens_;
    a.capacity = capacity_;
    a.head_dim = layout_.head_dim;
    a.num_kv_heads = layout_.num_kv_heads;
    a.entry = e;
    return a;
  }
  void launch_fold(const detail::qminmax_fold_args& a, cudaStream_t stream,
                   const char* what) const {
    visit_dtype(layout_.kv_dtype, [&](auto elem) {
      using T = decltype(elem);
      detail::qminmax_fold_kernel<T><<<1, detail::qfold_threads, 0, stream>>>(a);
    });
    detail::check(cudaGetLastError(), what, errc::invalid_argument);
  }

  kv_layout layout_;
  std::uint32_t capacity_;
  std::uint32_t* codes_ = nullptr;          // [num_kv_heads][capacity][head_dim / 2], device
  float* scale_ = nullptr;                  // [num_kv_heads][capacity], device
  float* norm_ = nullptr;                   // [num_kv_heads][capacity], device
  float* bias_ = nullptr;                   // [capacity], device
  std::uint16_t* tokens_ = nullptr;         // [capacity], device
  std::vector<std::uint16_t> host_tokens_;  // [capacity]: the device counts, as last written
};

}  // namespace oasiskv::cuda
