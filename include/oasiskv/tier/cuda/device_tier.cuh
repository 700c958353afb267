// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cuda::device_tier`: a pool of block slots in one device allocation (the fast tier).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>

#include "oasiskv/concepts/tier_backend.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/views.hpp"
#include "oasiskv/cuda/detail/runtime.cuh"

namespace oasiskv::cuda {

//! @brief How a `device_tier` gets its memory.
struct device_tier_options {
  //! The device that holds the slots; -1: the current device at construction.
  int device = -1;
  //! Allocation hook (an engine's caching allocator, a `cuda::mr` resource wrapped in a lambda):
  //! returns `bytes` of memory of `device`, at least 256-byte aligned, or throws. Empty:
  //! cudaMalloc. A hook rather than a `cuda::mr` parameter because CCCL 3.0's resource concepts are
  //! still experimental (LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE) and change between
  //! releases.
  std::function<void*(std::size_t bytes)> allocate = {};
  //! Releases what `allocate` returned. Must not throw. Empty: cudaFree.
  std::function<void(void* p, std::size_t bytes)> deallocate = {};
  //! Zero the slots at construction (a kernel that reads an unwritten slot then sees zeros, not
  //! another run's data).
  bool zero = false;
  //! The stream of `write_slot` and `read_slot`, a stream of `device` the tier does not own.
  //! Null: the tier creates a non-blocking stream of its own (so the calls never wait for the
  //! legacy default stream's work, nor it for them).
  cudaStream_t stream = nullptr;
};

//! @brief `num_slots` slots of `layout.block_bytes()` rounded up to 128 bytes (a cache line, so
//! no two slots share one) in one device allocation, so the whole pool is one
//! `block_pool_view` of device pointers. Move-only; owns its memory. Models `addressable_tier`
//! with `memory_kind::device`: `slot_data` returns device pointers, which the host must not
//! dereference.
//!
//! Also models `slot_io_tier`: `write_slot` and `read_slot` copy between host memory and a slot
//! with `cudaMemcpyAsync` on `stream()` and synchronise that stream before returning, which is
//! what `tiered_kv_cache` uses to write appended tokens through and to audit. Ordering against
//! the copy engine (its own stream): a staging copy into a slot is waited for (its event) before
//! the cache writes the slot, and a slot is staged into again only after it was evicted, which
//! happens under the cache's lock after every write to it returned; against kernels: the cache
//! writes no slot a running step pinned, and its kernel (`cuda::sparse_decode`, synchronous) has
//! finished when `attend` returns. A copy complete on return is thus ordered before every later
//! transfer and kernel on any stream, without events between the streams.
class device_tier {
 public:
  static constexpr memory_kind memory = memory_kind::device;
  static constexpr std::size_t slot_alignment = 128;

  device_tier(const kv_layout& layout, std::uint32_t num_slots, device_tier_options options = {})
      : layout_(layout), num_slots_(num_slots), options_(std::move(options)) {
    layout_.validate();
    if (num_slots_ == 0 || num_slots_ == null_slot) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "cuda::device_tier num_slots = ", num_slots,
                             " must be in [1, ", null_slot, ")");
    }
    if (static_cast<bool>(options_.allocate) != static_cast<bool>(options_.deallocate))
        [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument,
                             "cuda::device_tier: allocate and deallocate hooks come in pairs");
    }
    device_ = options_.device >= 0 ? options_.device : detail::current_device();
    slot_bytes_ = (layout_.block_bytes() + slot_alignment - 1) / slot_alignment * slot_alignment;
    bytes_ = slot_bytes_ * num_slots_;
    detail::device_guard guard(device_);
    void* p = nullptr;
    if (options_.allocate) {
      p = options_.allocate(bytes_);
    } else {
      const cudaError_t e = cudaMalloc(&p, bytes_);
      if (e != cudaSuccess) [[unlikely]] {
        (void)cudaGetLastError();
        oasiskv::detail::raise(detail::code_of(e, errc::out_of_memory),
                               "cuda::device_tier: cudaMalloc of ", bytes_, " bytes (", num_slots_,
                               " slots of ", slot_bytes_, ") on device ", device_,
                               " failed: ", cudaGetErrorString(e));
      }
    }
    base_ = static_cast<std::byte*>(p);
    if (reinterpret_cast<std::uintptr_t>(base_) % slot_alignment != 0) [[unlikely]] {
      release();
      oasiskv::detail::raise(errc::misaligned,
                             "cuda::device_tier: the allocate hook returned memory that is not ",
                             slot_alignment, "-byte aligned");
    }
    try {
      stream_ = options_.stream;
      if (stream_ == nullptr) {
        detail::check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                      "cuda::device_tier: cudaStreamCreateWithFlags", errc::unsupported);
        owns_stream_ = true;
      }
      if (options_.zero) {
        // Finished before the constructor returns: the tier's writes go to a non-blocking
        // stream, and the copy engine's to its own, neither of which waits for the legacy one.
        OASISKV_CUDA_TRY(cudaMemsetAsync(base_, 0, bytes_, stream_));
        OASISKV_CUDA_TRY(cudaStreamSynchronize(stream_));
      }
    } catch (...) {
      release();
      throw;
    }
  }

  device_tier(device_tier&& o) noexcept
      : layout_(o.layout_),
        num_slots_(o.num_slots_),
        options_(std::move(o.options_)),
        device_(o.device_),
        slot_bytes_(o.slot_bytes_),
        bytes_(o.bytes_),
        base_(std::exchange(o.base_, nullptr)),
        stream_(std::exchange(o.stream_, nullptr)),
        owns_stream_(std::exchange(o.owns_stream_, false)) {}
  device_tier& operator=(device_tier&& o) noexcept {
    if (this != &o) {
      release();
      layout_ = o.layout_;
      num_slots_ = o.num_slots_;
      options_ = std::move(o.options_);
      device_ = o.device_;
      slot_bytes_ = o.slot_bytes_;
      bytes_ = o.bytes_;
      base_ = std::exchange(o.base_, nullptr);
      stream_ = std::exchange(o.stream_, nullptr);
      owns_stream_ = std::exchange(o.owns_stream_, false);
    }
    return *this;
  }
  device_tier(const device_tier&) = delete;
  device_tier& operator=(const device_tier&) = delete;
  ~device_tier() { release(); }

  const kv_layout& layout() const noexcept { return layout_; }
  std::uint32_t num_slots() const noexcept { return num_slots_; }
  std::size_t slot_bytes() const noexcept { return slot_bytes_; }
  //! @brief Bytes of slot memory (num_slots x slot_bytes).
  std::size_t bytes() const noexcept { return bytes_; }
  //! @brief The device that holds the slots.
  int device() const noexcept { return device_; }

  //! @brief Device pointer to slot `s`.
  std::byte* slot_data(slot_id s) {
    check_slot(s);
    return base_ + std::size_t{s} * slot_bytes_;
  }
  const std::byte* slot_data(slot_id s) const {
    check_slot(s);
    return base_ + std::size_t{s} * slot_bytes_;
  }
  //! @brief The pool as kernels read it (device pointers).
  block_pool_view view() const noexcept { return {base_, slot_bytes_, num_slots_, layout_}; }

  //! @brief The stream `write_slot` and `read_slot` copy on (`device_tier_options::stream`, else
  //! the tier's own non-blocking stream).
  cudaStream_t stream() const noexcept { return stream_; }

  //! @brief Copies `n` bytes of host memory at `in` (pageable or pinned) into bytes
  //! `[offset, offset + n)` of slot `s`; complete when it returns (see the class comment for the
  //! ordering). A bad slot is `errc::invalid_slot`, a range past the block `errc::out_of_range`,
  //! a CUDA failure `errc::transfer_failed`.
  void write_slot(slot_id s, std::size_t offset, const std::byte* in, std::size_t n) {
    std::byte* dst = slot_data(s) + check_range(s, offset, n, in, "write_slot");
    if (n == 0) {
      return;
    }
    detail::device_guard guard(device_);
    detail::check(cudaMemcpyAsync(dst, in, n, cudaMemcpyHostToDevice, stream_),
                  "cuda::device_tier::write_slot: cudaMemcpyAsync");
    detail::check(cudaStreamSynchronize(stream_), "cuda::device_tier::write_slot: the copy");
  }

  //! @brief `write_slot` without waiting (`async_slot_io_tier`): the copy is queued on
  //! `stream()`; `in` must stay unchanged until `complete_writes` returns, and is best pinned
  //! (from pageable memory CUDA stages the copy before it returns). Argument errors as
  //! `write_slot`, before anything is queued.
  void write_slot_async(slot_id s, std::size_t offset, const std::byte* in, std::size_t n) {
    std::byte* dst = slot_data(s) + check_range(s, offset, n, in, "write_slot_async");
    if (n == 0) {
      return;
    }
    detail::device_guard guard(device_);
    detail::check(cudaMemcpyAsync(dst, in, n, cudaMemcpyHostToDevice, stream_),
                  "cuda::device_tier::write_slot_async: cudaMemcpyAsync");
  }

  //! @brief Waits for every write `write_slot_async` queued (one stream synchronisation). A
  //! failed copy is `errc::transfer_failed`.
  void complete_writes() {
    detail::device_guard guard(device_);
    detail::check(cudaStreamSynchronize(stream_), "cuda::device_tier::complete_writes");
  }

  //! @brief Copies bytes `[offset, offset + n)` of slot `s` into `n` bytes of host memory at
  //! `out`; complete when it returns. Errors as `write_slot`.
  void read_slot(slot_id s, std::size_t offset, std::byte* out, std::size_t n) const {
    const std::byte* src = slot_data(s) + check_range(s, offset, n, out, "read_slot");
    if (n == 0) {
      return;
    }
    detail::device_guard guard(device_);
    detail::check(cudaMemcpyAsync(out, src, n, cudaMemcpyDeviceToHost, stream_),
                  "cuda::device_tier::read_slot: cudaMemcpyAsync");
    detail::check(cudaStreamSynchronize(stream_), "cuda::device_tier::read_slot: the copy");
  }

 private:
  // `offset`, after checking that `[offset, offset + n)` lies within one block and that the host
  // buffer is there.
  std::size_t check_range(slot_id s, std::size_t offset, std::size_t n, const void* host,
                          const char* what) const {
    const std::size_t block = layout_.block_bytes();
    if (offset > block || n > block - offset) [[unlikely]] {
      oasiskv::detail::raise(errc::out_of_range, "cuda::device_tier::", what, ": bytes [", offset,
                             ", ", offset, " + ", n, ") of slot ", s, " pass the block's ", block,
                             " bytes");
    }
    if (n != 0 && host == nullptr) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "cuda::device_tier::", what,
                             ": null host buffer for ", n, " bytes");
    }
    return offset;
  }

  void check_slot(slot_id s) const {
    if (s >= num_slots_) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_slot, "cuda::device_tier: slot ", s,
                             " is outside the pool of ", num_slots_, " slots");
    }
  }

  void release() noexcept {
    if (base_ == nullptr) {
      return;
    }
    int previous = -1;
    const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device_ &&
                          cudaSetDevice(device_) == cudaSuccess;
    if (owns_stream_) {
      (void)cudaStreamSynchronize(stream_);  // every call waits for its copy: a formality
      (void)cudaStreamDestroy(stream_);
    }
    stream_ = nullptr;
    owns_stream_ = false;
    if (options_.deallocate) {
      try {
        options_.deallocate(base_, bytes_);
      } catch (...) {
        // Releasing must not throw; a hook that does loses the memory, not the program.
      }
    } else {
      (void)cudaFree(base_);
    }
    if (switched) {
      (void)cudaSetDevice(previous);
    }
    base_ = nullptr;
  }

  kv_layout layout_;
  std::uint32_t num_slots_;
  device_tier_options options_;
  int device_ = 0;
  std::size_t slot_bytes_ = 0;
  std::size_t bytes_ = 0;
  std::byte* base_ = nullptr;  // [num_slots][slot_bytes], device memory
  cudaStream_t stream_ = nullptr;
  bool owns_stream_ = false;
};

static_assert(addressable_tier<device_tier>);
static_assert(!host_accessible_tier<device_tier>);
static_assert(slot_io_tier<device_tier>);
static_assert(async_slot_io_tier<device_tier>);

}  // namespace oasiskv::cuda
