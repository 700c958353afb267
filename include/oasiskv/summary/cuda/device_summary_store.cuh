// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cuda::device_summary_store`: the device arrays, token counts and their host mirror
//! that both device summaries keep, with everything they do alike: allocation and clearing,
//! the checks and bookkeeping around a fold kernel, `grow`, and the copies of `load` and
//! `upload`. A summary adds its arrays' meaning, its fold kernel and its host half of `load`.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <new>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/layout.hpp"
#include "oasiskv/cuda/detail/copy_rows.cuh"
#include "oasiskv/cuda/detail/runtime.cuh"
#include "oasiskv/summary/cuda/detail/summary_fold.cuh"
#include "oasiskv/summary/summary_checks.hpp"

namespace oasiskv::cuda {

//! @brief One device array of a summary: `[num_kv_heads][capacity][width]` bytes (`per_head`)
//! or `[capacity][width]`. Every 32-bit word of an empty entry holds `empty` (0: zero bytes; a
//! non-zero `empty` needs a `width` that is a multiple of 4).
struct device_summary_array {
  std::size_t width = 0;
  bool per_head = true;
  std::uint32_t empty = 0;
};

//! @brief `N` device arrays of `capacity` entries (`device_summary_array`), a token count per
//! entry (`[capacity]` u16, device) and its host mirror. Move-only; owns its memory. `name`
//! (a string literal, e.g. "cuda::device_minmax_summary") starts every error message.
//!
//! Every change to the token counts goes through the store, so the mirror is the device's
//! counts as last written: `update` checks an entry's room before it launches. The store runs
//! the checks and bookkeeping of `update`, `recompute` and `reset` and hands the summary a
//! `detail::summary_fold` to launch its kernel with; it grows every array at once (all or
//! nothing) and writes whole entries from host staging buffers (`write_entries`, under `load`
//! and `upload`).
template <std::size_t N>
class device_summary_store {
 public:
  //! @brief Allocates `capacity` empty entries for `layout` (synchronous): `errc::invalid_argument`
  //! for a zero capacity or an invalid layout, `errc::out_of_memory` when allocation fails.
  device_summary_store(const char* name, const kv_layout& layout, std::uint32_t capacity,
                       const std::array<device_summary_array, N>& arrays)
      : name_(name), layout_(layout), capacity_(capacity) {
    layout_.validate();
    if (capacity_ == 0) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, name_, " capacity is 0");
    }
    for (std::size_t k = 0; k < N; ++k) {
      arrays_[k] = arrays[k];
    }
    arrays_[N] = {sizeof(std::uint16_t), false, 0};  // the token counts
    host_tokens_.assign(capacity_, 0);
    try {
      std::vector<std::vector<std::uint32_t>> fills;
      for (std::size_t k = 0; k <= N; ++k) {
        data_[k] = allocate(k, capacity_, ": cudaMalloc");
        clear_async(k, data_[k], 0, capacity_, nullptr, fills, ": clearing the entries");
      }
      // Finished before this returns: updates may come on a stream that does not wait for the
      // legacy default stream.
      check(cudaStreamSynchronize(nullptr), ": clearing the entries");
    } catch (...) {
      release();
      throw;
    }
  }
  //! @brief Takes `o`'s memory; `o` is left empty.
  device_summary_store(device_summary_store&& o) noexcept
      : name_(o.name_),
        layout_(o.layout_),
        capacity_(o.capacity_),
        arrays_(o.arrays_),
        data_(std::exchange(o.data_, {})),
        host_tokens_(std::move(o.host_tokens_)) {}
  device_summary_store& operator=(device_summary_store&&) = delete;
  device_summary_store(const device_summary_store&) = delete;
  device_summary_store& operator=(const device_summary_store&) = delete;
  ~device_summary_store() { release(); }

  const char* name() const noexcept { return name_; }
  const kv_layout& layout() const noexcept { return layout_; }
  std::uint32_t capacity() const noexcept { return capacity_; }
  //! @brief Array `k` in device memory.
  template <class T>
  T* data(std::size_t k) const noexcept {
    return static_cast<T*>(data_[k]);
  }
  //! @brief Device token counts, `[capacity]`.
  std::uint16_t* tokens() const noexcept { return data<std::uint16_t>(N); }
  //! @brief Tokens folded into entry `e` (the host mirror of the device count; no synchronisation).
  std::uint32_t tokens(std::uint32_t e) const {
    check_entry(e, "tokens");
    return host_tokens_[e];
  }

  //! @brief `errc::out_of_range` naming `name::what` unless `e < capacity()`.
  void check_entry(std::uint32_t e, const char* what) const {
    if (e >= capacity_) [[unlikely]] {
      oasiskv::detail::raise(errc::out_of_range, name_, "::", what, ": entry ", e,
                             " >= capacity = ", capacity_);
    }
  }

  //! @brief `update(e, keys, n)` of a summary: checks the entry, its room for `n` more tokens
  //! and `keys`, then calls `launch(fold)` to enqueue the summary's kernel and records the new
  //! count. `n = 0` does nothing.
  template <class Launch>
  void update(std::uint32_t e, const void* keys, std::uint32_t n, bool check_pointers,
              Launch&& launch) {
    check_entry(e, "update");
    if (n == 0) {
      return;
    }
    const std::uint32_t have = host_tokens_[e];
    if (n > layout_.tokens_per_block - have) [[unlikely]] {
      oasiskv::detail::raise(errc::out_of_range, name_, "::update: entry ", e, " holds ", have,
                             " tokens; ", n,
                             " more exceed tokens_per_block = ", layout_.tokens_per_block);
    }
    check_keys(keys, check_pointers, "update", "keys");
    detail::summary_fold f = fold(e);
    f.keys = keys;
    f.token_stride = std::size_t{layout_.num_kv_heads} * layout_.head_dim;
    f.head_stride = layout_.head_dim;
    f.count = n;
    f.new_tokens = static_cast<std::uint16_t>(have + n);
    f.fresh = have == 0;
    run(f, "update", launch);
  }

  //! @brief `recompute(e, block, count)` of a summary: the entry from the first `count` tokens
  //! of a block laid out as a fast-tier slot (keys `[num_kv_heads][tokens_per_block][head_dim]`
  //! first); `count = 0` is `reset(e)`.
  template <class Launch>
  void recompute(std::uint32_t e, const std::byte* block, std::uint32_t count, bool check_pointers,
                 Launch&& launch) {
    check_entry(e, "recompute");
    if (count > layout_.tokens_per_block) [[unlikely]] {
      oasiskv::detail::raise(errc::out_of_range, name_, "::recompute: entry ", e, " from ", count,
                             " tokens; a block holds at most ", layout_.tokens_per_block);
    }
    if (count == 0) {
      reset(e, launch);
      return;
    }
    check_keys(block, check_pointers, "recompute", "block");
    detail::summary_fold f = fold(e);
    f.keys = block;
    f.token_stride = layout_.head_dim;
    f.head_stride = std::size_t{layout_.tokens_per_block} * layout_.head_dim;
    f.count = count;
    f.new_tokens = static_cast<std::uint16_t>(count);
    f.fresh = true;
    run(f, "recompute", launch);
  }

  //! @brief `reset(e)` of a summary: the entry emptied by its kernel (`fold.clear`).
  template <class Launch>
  void reset(std::uint32_t e, Launch&& launch) {
    check_entry(e, "reset");
    detail::summary_fold f = fold(e);
    f.clear = true;
    run(f, "reset", launch);
  }

  //! @brief Capacity becomes `capacity`: every array and the token counts move into new
  //! allocations (device-to-device, each head's row to the front of its wider row), the new
  //! entries start empty, the host mirror is extended. An equal capacity does nothing; a smaller
  //! one is `errc::invalid_argument` (`check_summary_grow`). All or nothing: a failure throws
  //! with the old buffers, capacity and counts untouched. Ordered after the work on `stream`;
  //! synchronises it, then frees the old buffers.
  void grow(std::uint32_t capacity, cudaStream_t stream) {
    oasiskv::detail::check_summary_grow(name_, capacity_, capacity);
    if (capacity == capacity_) {
      return;
    }
    std::array<void*, N + 1> next{};
    std::vector<std::uint16_t> host;
    try {
      for (std::size_t k = 0; k <= N; ++k) {
        next[k] = allocate(k, capacity, "::grow: cudaMalloc");
      }
      try {
        host.assign(capacity, 0);
      } catch (const std::bad_alloc&) {
        oasiskv::detail::raise(errc::out_of_memory, name_, "::grow: the host token mirror");
      }
      std::copy(host_tokens_.begin(), host_tokens_.end(), host.begin());
      std::vector<std::vector<std::uint32_t>> fills;  // kept until the stream is synchronised
      for (std::size_t k = 0; k <= N; ++k) {
        const std::size_t width = arrays_[k].width;
        const std::size_t old_w = capacity_ * width, new_w = capacity * width;
        check(detail::copy_rows_async(next[k], new_w, data_[k], old_w, old_w, rows(k),
                                      cudaMemcpyDeviceToDevice, stream),
              "::grow: copying the entries");
        clear_async(k, next[k], capacity_, capacity, stream, fills, "::grow: copying the entries");
      }
      check(cudaStreamSynchronize(stream), "::grow: copying the entries");
    } catch (...) {
      for (void* p : next) {
        (void)cudaFree(p);
      }
      throw;
    }
    release();
    data_ = next;
    host_tokens_ = std::move(host);
    capacity_ = capacity;
  }

  //! @brief Bytes of one shipped entry, as the host min/max summaries' `wire_bytes`:
  //! `[num_kv_heads][2 (max, min)][head_dim]` f16 (host-only).
  static std::size_t wire_bytes_of(const kv_layout& l) noexcept {
    return std::size_t{l.num_kv_heads} * 2 * l.head_dim * sizeof(f16);
  }

  //! @brief Throws unless a batch `load` of `entries` (with `bytes`, `[entries.size()][wire]`,
  //! and one token count per entry in `tokens`) may run on a summary of `layout` and `capacity`;
  //! `who` names the call in the message, which names the offending value: `errc::
  //! invalid_argument` for a count or byte size that does not match, `errc::out_of_range` for an
  //! entry at or beyond `capacity` or a token count outside `[1, tokens_per_block]`. Host-only.
  static void check_load(const char* who, const kv_layout& layout, std::uint32_t capacity,
                         std::span<const std::uint32_t> entries, std::span<const std::byte> bytes,
                         std::span<const std::uint32_t> tokens) {
    const std::size_t wire = wire_bytes_of(layout);
    if (tokens.size() != entries.size()) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, who, ": ", entries.size(), " entries but ",
                             tokens.size(), " token counts");
    }
    if (bytes.size() != entries.size() * wire) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, who, ": got ", bytes.size(), " bytes for ",
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

  //! @brief `errc::layout_mismatch` unless a host summary of `layout` and `capacity` matches
  //! this one (for `upload`).
  void check_host(const kv_layout& layout, std::uint32_t capacity) const {
    if (!(layout == layout_) || capacity != capacity_) [[unlikely]] {
      oasiskv::detail::raise(errc::layout_mismatch, name_,
                             "::upload: the host summary's layout or capacity differs (capacity ",
                             capacity, " against ", capacity_, ")");
    }
  }

  //! @brief Writes whole entries from host memory on `stream` and synchronises it: entry
  //! `entries[i]` of array `k` from `staged[k] + i * rows(k) * width(k)` (its rows of every KV
  //! head, or its one element), its token count from `counts[i]`; then the host mirror. A
  //! repeated entry takes its last values. `what` follows the name in a CUDA error's message
  //! (e.g. "::load: copying the entries"); after one the
  //! listed entries are unspecified (the mirror unchanged).
  void write_entries(std::span<const std::uint32_t> entries,
                     const std::array<const void*, N>& staged, const std::uint16_t* counts,
                     cudaStream_t stream, const char* what) {
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const std::uint32_t e = entries[i];
      for (std::size_t k = 0; k <= N; ++k) {
        const std::size_t width = arrays_[k].width;
        const auto* src = static_cast<const std::byte*>(k < N ? staged[k] : counts);
        check(detail::copy_rows_async(static_cast<std::byte*>(data_[k]) + e * width,
                                      capacity_ * width, src + i * rows(k) * width, width, width,
                                      rows(k), cudaMemcpyHostToDevice, stream),
              what);
      }
    }
    check(cudaStreamSynchronize(stream), what);
    for (std::size_t i = 0; i < entries.size(); ++i) {
      host_tokens_[entries[i]] = counts[i];
    }
  }

 private:
  // Rows of array `k`: one per KV head, or one.
  std::size_t rows(std::size_t k) const noexcept {
    return arrays_[k].per_head ? layout_.num_kv_heads : 1;
  }

  void* allocate(std::size_t k, std::uint32_t capacity, const char* what) const {
    void* p = nullptr;
    check(cudaMalloc(&p, rows(k) * capacity * arrays_[k].width), what, errc::out_of_memory);
    return p;
  }

  // Enqueues on `stream` the empty value of entries `[from, to)` of array `k` at `base` (an
  // array of `to` entries); a non-zero pattern is copied from a host buffer left in `fills`.
  void clear_async(std::size_t k, void* base, std::uint32_t from, std::uint32_t to,
                   cudaStream_t stream, std::vector<std::vector<std::uint32_t>>& fills,
                   const char* what) const {
    const device_summary_array& a = arrays_[k];
    const std::size_t pitch = to * a.width, width = (to - from) * a.width;
    void* dst = static_cast<std::byte*>(base) + from * a.width;
    if (a.empty == 0) {
      check(detail::clear_rows_async(dst, pitch, width, rows(k), stream), what);
      return;
    }
    const std::vector<std::uint32_t>& fill = fills.emplace_back(rows(k) * width / 4, a.empty);
    check(detail::copy_rows_async(dst, pitch, fill.data(), width, width, rows(k),
                                  cudaMemcpyHostToDevice, stream),
          what);
  }

  detail::summary_fold fold(std::uint32_t e) const noexcept {
    detail::summary_fold f;
    f.tokens = tokens();
    f.capacity = capacity_;
    f.head_dim = layout_.head_dim;
    f.num_kv_heads = layout_.num_kv_heads;
    f.entry = e;
    return f;
  }

  template <class Launch>
  void run(const detail::summary_fold& f, const char* op, Launch& launch) {
    launch(f);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) [[unlikely]] {
      detail::check(e, (std::string(name_) + "::" + op + ": launch").c_str(),
                    errc::invalid_argument);
    }
    host_tokens_[f.entry] = f.new_tokens;
  }

  void check_keys(const void* keys, bool check_pointers, const char* op, const char* arg) const {
    if (keys == nullptr) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, name_, "::", op, ": ", arg, " is null");
    }
    if (check_pointers) {
      const std::string what = std::string(name_) + "::" + op + ": " + arg;
      detail::require_device_pointer(keys, detail::current_device(), what.c_str());
    }
  }

  // `detail::check` with the name then `what` (e.g. "::grow: cudaMalloc") as its subject.
  void check(cudaError_t e, const char* what, errc fallback = errc::transfer_failed) const {
    if (e != cudaSuccess) [[unlikely]] {
      detail::check(e, (std::string(name_) + what).c_str(), fallback);
    }
  }

  void release() noexcept {
    for (void* p : data_) {
      (void)cudaFree(p);
    }
    data_ = {};
  }

  const char* name_;
  kv_layout layout_;
  std::uint32_t capacity_;
  std::array<device_summary_array, N + 1> arrays_{};  // the summary's, then the token counts
  std::array<void*, N + 1> data_{};                   // device memory, as arrays_ describes
  std::vector<std::uint16_t> host_tokens_;            // [capacity]: the device counts, as written
};

}  // namespace oasiskv::cuda
