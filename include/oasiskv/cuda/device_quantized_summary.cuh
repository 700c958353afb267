// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cuda::device_quantized_minmax_summary`: `quantized_minmax_summary` (int8 min/max
//! bounds, a power-of-two scale per (entry, KV head)) in device memory, updated on the device
//! with the host's bits and scored by `cuda::topk_selector`.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "oasiskv/core/error.hpp"
#include "oasiskv/core/layout.hpp"
#include "oasiskv/cuda/detail/qminmax_kernels.cuh"
#include "oasiskv/cuda/detail/runtime.cuh"
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
//! The token counts are mirrored on the host (every change goes through this class), so
//! `update` checks the block's capacity before it launches; device-side writes are asynchronous
//! on the given stream (one CTA per call, looping over the KV heads). Unlike the host summary,
//! an update past `tokens_per_block` is an error, not a saturation.
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
