// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cuda::copy_engine`: batches of scattered block copies from pinned host memory into a
//! device tier, on a dedicated stream, with CUDA events as tickets.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "oasiskv/concepts/tier_backend.hpp"
#include "oasiskv/concepts/transfer_engine.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/cuda/detail/runtime.cuh"
#include "oasiskv/tier/cuda/device_tier.cuh"
#include "oasiskv/tier/cuda/pinned_host_tier.cuh"
#include "oasiskv/tier/host_tier.hpp"
#include "oasiskv/transfer/cuda/gather_kernel.cuh"

namespace oasiskv::cuda {

//! @brief A source tier the device can read asynchronously: pinned host memory, or a plain
//! `host_tier` (checked at `submit`: it must have been registered through its pin hook).
template <class T>
concept device_readable_tier = host_accessible_tier<T>;

//! @brief A destination tier in device memory.
template <class T>
concept device_memory_tier = addressable_tier<T> &&(T::memory == memory_kind::device);

//! @brief Copies batches of whole blocks host -> device on its own non-blocking stream and
//! returns at once: `submit` validates the batch (layouts, slot ranges, duplicate destinations,
//! hazards with unfinished batches, as `cpu_copy_engine` does), enqueues it and records an event;
//! `test` is `cudaEventQuery`, `wait` is `cudaEventSynchronize` plus the error check. Nothing on
//! the submit path synchronises with the host.
//!
//! Two paths, chosen per batch (`options::path`):
//! - gather kernel: a small fixed grid of CTAs reads the source slots with 16-byte loads through
//!   UVA; the (source, destination) list is staged to device memory on the same stream. Best for
//!   many small blocks, where a DMA descriptor per block costs more than the block;
//!   `enqueue_gather` is the same kernel over device-written lists, capturable in a CUDA graph.
//! - `cudaMemcpyBatchAsync` (CUDA 13's signature, or 12.8's; one `cudaMemcpyAsync` per run
//!   before 12.8) over runs of consecutive slots, each run within
//!   one pinned registration: the copy engines, best for large blocks. Not capturable: a capture
//!   returns `cudaErrorStreamCaptureUnsupported` and would silently drop the copies, so that code
//!   is an error here (`errc::unsupported`), never ignored.
//! Models `transfer_engine<copy_engine, Src, Dst>` for `Src` a `device_readable_tier` and `Dst` a
//! `device_memory_tier`. Thread-safe.
class copy_engine {
 public:
  enum class copy_path : std::uint8_t { automatic, gather_kernel, batch_memcpy };

  struct options {
    int device = -1;  //!< -1: the current device at construction
    copy_path path = copy_path::automatic;
    //! `automatic` takes the gather kernel for blocks up to this size when a batch has at least
    //! `kernel_min_blocks` of them (the crossover vLLM #57555 tuned on H100: < 28 KiB, >= 16).
    std::size_t kernel_max_block_bytes = std::size_t{28} << 10;
    std::uint32_t kernel_min_blocks = 16;
    //! CTAs of the gather kernel (each 512 threads x 4 loads of 16 bytes in flight).
    unsigned gather_ctas = 16;
  };

  //! @brief Identifies one submitted batch. Default-constructed tickets are never issued.
  struct ticket {
    std::uint64_t id = 0;
    friend constexpr bool operator==(const ticket&, const ticket&) = default;
  };

  struct statistics {
    std::uint64_t batches = 0;
    std::uint64_t blocks = 0;
    std::uint64_t bytes = 0;
    std::uint64_t kernel_batches = 0;
    std::uint64_t memcpy_batches = 0;
    std::uint64_t memcpy_runs = 0;  //!< copies handed to cudaMemcpyBatchAsync after coalescing
    std::uint64_t failed_batches = 0;
  };

  copy_engine() : copy_engine(options{}) {}
  explicit copy_engine(options o) : options_(o) {
    device_ = o.device >= 0 ? o.device : detail::current_device();
    detail::device_guard guard(device_);
    int same_address = 0;
    detail::check(cudaDeviceGetAttribute(&same_address,
                                         cudaDevAttrCanUseHostPointerForRegisteredMem, device_),
                  "cudaDeviceGetAttribute(CanUseHostPointerForRegisteredMem)", errc::unsupported);
    // The gather kernel indexes the whole pool from one base, so it needs registered memory at
    // the host's own addresses (always so on x86-64 Linux); otherwise every batch takes DMA.
    uva_host_pointers_ = same_address != 0;
    detail::check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                  "cudaStreamCreateWithFlags", errc::unsupported);
  }
  copy_engine(const copy_engine&) = delete;
  copy_engine& operator=(const copy_engine&) = delete;

  //! @brief Finishes every batch, then releases the stream, events and list buffers.
  ~copy_engine() {
    int previous = -1;
    const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device_ &&
                          cudaSetDevice(device_) == cudaSuccess;
    (void)cudaStreamSynchronize(stream_);
    for (auto& [id, b] : in_flight_) {
      (void)cudaEventDestroy(b.event);
    }
    for (cudaEvent_t e : free_events_) {
      (void)cudaEventDestroy(e);
    }
    for (list_buffer& l : lists_) {
      (void)cudaFreeHost(l.host);
      (void)cudaFree(l.dev);
    }
    (void)cudaStreamDestroy(stream_);
    if (switched) {
      (void)cudaSetDevice(previous);
    }
  }

  //! @brief See `transfer_engine`. Throws before anything is enqueued when the batch is bad;
  //! `errc::unsupported` when `src` is pageable memory the device cannot read asynchronously.
  template <device_readable_tier Src, device_memory_tier Dst>
  ticket submit(const Src& src, Dst& dst, std::span<const block_copy> copies) {
    const kv_layout& l = src.layout();
    if (!(l == dst.layout())) [[unlikely]] {
      oasiskv::detail::raise(errc::layout_mismatch,
                             "cuda::copy_engine::submit: source and destination layouts differ "
                             "(block bytes ",
                             l.block_bytes(), " vs ", dst.layout().block_bytes(), ")");
    }
    if constexpr (requires { dst.device(); }) {
      if (dst.device() != device_) [[unlikely]] {
        oasiskv::detail::raise(errc::invalid_argument,
                               "cuda::copy_engine::submit: the destination "
                               "tier is on device ",
                               dst.device(), ", the engine on device ", device_);
      }
    }
    for (std::size_t i = 0; i < copies.size(); ++i) {
      if (copies[i].src >= src.num_slots()) [[unlikely]] {
        oasiskv::detail::raise(errc::invalid_slot, "cuda::copy_engine::submit: copy ", i,
                               " reads slot ", copies[i].src, " of a source tier of ",
                               src.num_slots(), " slots");
      }
      if (copies[i].dst >= dst.num_slots()) [[unlikely]] {
        oasiskv::detail::raise(errc::invalid_slot, "cuda::copy_engine::submit: copy ", i,
                               " writes slot ", copies[i].dst, " of a destination tier of ",
                               dst.num_slots(), " slots");
      }
    }
    const block_pool_view sv = src.view();
    const block_pool_view dv = dst.view();
    // The gather kernel reads the source through its host addresses: registered and mapped
    // there (pinned_host_tier registers with cudaHostRegisterMapped; another pinned source is
    // asked), else the batch goes by DMA.
    bool mapped = uva_host_pointers_;
    if constexpr (Src::memory != memory_kind::pinned_host) {
      mapped = require_pinned(sv) && mapped;
    }
    std::uint32_t chunk_slots = src.num_slots();
    if constexpr (requires { src.slots_per_chunk(); }) {
      chunk_slots = std::max<std::uint32_t>(1, src.slots_per_chunk());
    }

    std::unique_lock lock(mutex_);
    retire_finished_locked();
    check_hazards_locked(&src, &dst, copies);
    const copy_path path = choose(copies.size(), l.block_bytes(), mapped);
    detail::device_guard guard(device_);
    batch b;
    b.src_tier = &src;
    b.dst_tier = &dst;
    b.blocks = copies.size();
    b.bytes = copies.size() * l.block_bytes();
    b.event = take_event_locked();
    try {
      if (!copies.empty()) {
        if (path == copy_path::gather_kernel) {
          b.list = enqueue_gather_locked(sv, dv, l.block_bytes(), copies);
        } else {
          enqueue_memcpy_locked(sv, dv, l.block_bytes(), chunk_slots, copies);
        }
      }
      detail::check(cudaEventRecord(b.event, stream_), "cuda::copy_engine: cudaEventRecord");
    } catch (...) {
      free_events_.push_back(b.event);
      if (b.list != no_list) {
        lists_[b.list].busy = false;
      }
      throw;
    }
    b.id = ++issued_;
    b.copies.assign(copies.begin(), copies.end());
    for (const block_copy& c : b.copies) {
      ++reading_[{b.src_tier, c.src}];
      writing_.insert({b.dst_tier, c.dst});
    }
    ++stats_.batches;
    stats_.blocks += b.blocks;
    if (!copies.empty()) {
      ++(path == copy_path::gather_kernel ? stats_.kernel_batches : stats_.memcpy_batches);
    }
    const ticket t{b.id};
    in_flight_.emplace(b.id, std::move(b));
    return t;
  }

  //! @brief Whether batch `t` has finished (`cudaEventQuery`). Never blocks.
  bool test(const ticket& t) {
    std::lock_guard lock(mutex_);
    check_issued(t);
    const auto it = in_flight_.find(t.id);
    if (it == in_flight_.end()) {
      return true;
    }
    const cudaError_t e = cudaEventQuery(it->second.event);
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error: keep it out of later checks
      return false;
    }
    retire_locked(it, e);
    return true;
  }

  //! @brief Blocks until batch `t` has finished (`cudaEventSynchronize`); rethrows a failure of
  //! its copies (or of the device while they ran) once, as `errc::transfer_failed`.
  void wait(const ticket& t) {
    std::unique_lock lock(mutex_);
    check_issued(t);
    if (auto it = in_flight_.find(t.id); it != in_flight_.end()) {
      const cudaEvent_t ev = it->second.event;
      lock.unlock();  // other threads may submit or test meanwhile; events are never destroyed
      const cudaError_t e = cudaEventSynchronize(ev);
      lock.lock();
      if (auto again = in_flight_.find(t.id); again != in_flight_.end()) {
        retire_locked(again, e);
      }
    }
    if (auto f = failures_.find(t.id); f != failures_.end()) {
      std::string message = std::move(f->second);
      failures_.erase(f);
      throw error(errc::transfer_failed, message);
    }
  }

  //! @brief Makes `stream` wait for batch `t` on the device (no host synchronisation), so a
  //! kernel enqueued after it reads the copied blocks.
  void wait_on_stream(const ticket& t, cudaStream_t stream) {
    std::lock_guard lock(mutex_);
    check_issued(t);
    if (auto it = in_flight_.find(t.id); it != in_flight_.end()) {
      detail::check(cudaStreamWaitEvent(stream, it->second.event, 0),
                    "cuda::copy_engine: cudaStreamWaitEvent");
    }
  }

  //! @brief Blocks until every batch submitted so far has finished. Failures stay for `wait`.
  void synchronize() {
    std::unique_lock lock(mutex_);
    lock.unlock();
    const cudaError_t e = cudaStreamSynchronize(stream_);
    lock.lock();
    while (!in_flight_.empty()) {
      retire_locked(in_flight_.begin(), e);
    }
  }

  //! @brief The engine's stream (non-blocking, created at construction).
  cudaStream_t stream() const noexcept { return stream_; }
  int device() const noexcept { return device_; }
  const options& config() const noexcept { return options_; }

  statistics stats() const {
    std::lock_guard lock(mutex_);
    return stats_;
  }

 private:
  static constexpr std::size_t no_list = ~std::size_t{0};

  struct batch {
    std::uint64_t id = 0;
    cudaEvent_t event = nullptr;
    const void* src_tier = nullptr;
    const void* dst_tier = nullptr;
    std::vector<block_copy> copies;
    std::size_t blocks = 0, bytes = 0;
    std::size_t list = no_list;  // index into lists_, held until the batch finishes
  };
  // A (source, destination) list staged in pinned memory and copied to the device on the stream.
  struct list_buffer {
    uint2* host = nullptr;  // [capacity], pinned
    uint2* dev = nullptr;   // [capacity], device
    std::size_t capacity = 0;
    bool busy = false;
  };
  struct slot_key {
    const void* tier;
    slot_id slot;
    friend bool operator==(const slot_key&, const slot_key&) = default;
  };
  struct slot_key_hash {
    std::size_t operator()(const slot_key& k) const noexcept {
      return std::hash<const void*>{}(k.tier) ^ (std::size_t{k.slot} * 0x9e3779b97f4a7c15ull);
    }
  };

  // Throws unless the pool is pinned; returns whether it is also mapped at its host addresses.
  static bool require_pinned(const block_pool_view& v) {
    const std::byte* last = v.base + (std::size_t{v.num_slots} * v.slot_stride - 1);
    bool mapped = true;
    for (const void* p : {static_cast<const void*>(v.base), static_cast<const void*>(last)}) {
      const detail::pointer_info info = detail::query_pointer(p);
      if (info.kind != detail::pointer_kind::pinned_host) [[unlikely]] {
        oasiskv::detail::raise(
            errc::unsupported, "cuda::copy_engine::submit: the source tier's memory at ", p, " is ",
            detail::to_string(info.kind),
            ": the device copies asynchronously only from pinned memory (use "
            "cuda::pinned_host_tier, or a host_tier whose pin hook calls cudaHostRegister)");
      }
      mapped = mapped && info.device_address == p;
    }
    return mapped;
  }

  copy_path choose(std::size_t blocks, std::size_t block_bytes, bool mapped) const {
    if (options_.path == copy_path::gather_kernel) {
      if (!mapped) [[unlikely]] {
        oasiskv::detail::raise(errc::unsupported,
                               "cuda::copy_engine: the gather kernel needs registered host "
                               "memory mapped at the host's addresses (cudaHostRegisterMapped), "
                               "which device ",
                               device_, " or the source tier does not offer");
      }
      return copy_path::gather_kernel;
    }
    if (options_.path == copy_path::batch_memcpy || !mapped) {
      return copy_path::batch_memcpy;
    }
    return block_bytes <= options_.kernel_max_block_bytes && blocks >= options_.kernel_min_blocks
               ? copy_path::gather_kernel
               : copy_path::batch_memcpy;
  }

  // Same rules as cpu_copy_engine: within the batch a destination appears once and is no
  // source; across batches a slot being written is neither read nor written again, and a slot
  // being read is not written.
  void check_hazards_locked(const void* src_tier, const void* dst_tier,
                            std::span<const block_copy> copies) const {
    std::unordered_set<slot_key, slot_key_hash> dsts;
    dsts.reserve(copies.size());
    for (std::size_t i = 0; i < copies.size(); ++i) {
      const slot_key d{dst_tier, copies[i].dst};
      if (!dsts.insert(d).second) [[unlikely]] {
        oasiskv::detail::raise(errc::invalid_argument, "cuda::copy_engine::submit: copy ", i,
                               " writes slot ", d.slot,
                               " which an earlier copy of the batch writes");
      }
      if (writing_.contains(d) || reading_.contains(d)) [[unlikely]] {
        oasiskv::detail::raise(errc::slot_in_flight, "cuda::copy_engine::submit: copy ", i,
                               " writes slot ", d.slot, " which an unfinished batch still ",
                               writing_.contains(d) ? "writes" : "reads");
      }
    }
    for (std::size_t i = 0; i < copies.size(); ++i) {
      const slot_key s{src_tier, copies[i].src};
      if (writing_.contains(s)) [[unlikely]] {
        oasiskv::detail::raise(errc::slot_in_flight, "cuda::copy_engine::submit: copy ", i,
                               " reads slot ", s.slot, " which an unfinished batch still writes");
      }
      if (dsts.contains(s)) [[unlikely]] {
        oasiskv::detail::raise(errc::invalid_argument, "cuda::copy_engine::submit: copy ", i,
                               " reads slot ", s.slot, " which the same batch writes");
      }
    }
  }

  std::size_t enqueue_gather_locked(const block_pool_view& sv, const block_pool_view& dv,
                                    std::size_t block_bytes, std::span<const block_copy> copies) {
    const std::size_t idx = take_list_locked(copies.size());
    list_buffer& lb = lists_[idx];
    for (std::size_t i = 0; i < copies.size(); ++i) {
      lb.host[i] = make_uint2(copies[i].src, copies[i].dst);
    }
    try {
      detail::check(cudaMemcpyAsync(lb.dev, lb.host, copies.size() * sizeof(uint2),
                                    cudaMemcpyHostToDevice, stream_),
                    "cuda::copy_engine: staging the gather list");
      gather_args a;
      a.src = sv.base;  // registered memory at the host's address (checked at construction)
      a.src_stride = sv.slot_stride;
      a.dst = dv.base;
      a.dst_stride = dv.slot_stride;
      a.block_bytes = block_bytes;
      a.pairs = lb.dev;
      a.count = nullptr;
      a.max_count = static_cast<std::uint32_t>(copies.size());
      const unsigned ctas =
          static_cast<unsigned>(std::min<std::size_t>(copies.size(), options_.gather_ctas));
      enqueue_gather(a, std::max(1u, ctas), stream_);
    } catch (...) {
      lb.busy = false;
      throw;
    }
    return idx;
  }

  void enqueue_memcpy_locked(const block_pool_view& sv, const block_pool_view& dv,
                             std::size_t block_bytes, std::uint32_t chunk_slots,
                             std::span<const block_copy> copies) {
    // Runs of consecutive source and destination slots become one copy when both pools have the
    // same stride (padding is copied too, harmlessly) and the run stays in one registration.
    sorted_.assign(copies.begin(), copies.end());
    std::sort(sorted_.begin(), sorted_.end(),
              [](const block_copy& a, const block_copy& b) { return a.src < b.src; });
    const bool coalesce = sv.slot_stride == dv.slot_stride;
    dsts_.clear();
    srcs_.clear();
    sizes_.clear();
    bool all_small = true;
    for (std::size_t i = 0; i < sorted_.size();) {
      std::size_t j = i + 1;
      while (coalesce && j < sorted_.size() && sorted_[j].src == sorted_[j - 1].src + 1 &&
             sorted_[j].dst == sorted_[j - 1].dst + 1 &&
             sorted_[j].src / chunk_slots == sorted_[i].src / chunk_slots) {
        ++j;
      }
      const std::size_t bytes = (j - i - 1) * sv.slot_stride + block_bytes;
      srcs_.push_back(sv.base + std::size_t{sorted_[i].src} * sv.slot_stride);
      dsts_.push_back(dv.base + std::size_t{sorted_[i].dst} * dv.slot_stride);
      sizes_.push_back(bytes);
      all_small = all_small && bytes <= (std::size_t{128} << 10);
      i = j;
    }
    cudaError_t e = cudaErrorNotSupported;  // before CUDA 12.8: one cudaMemcpyAsync per run
#if CUDART_VERSION >= 12080
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.srcLocHint.type = cudaMemLocationTypeHost;
    attr.srcLocHint.id = 0;
    attr.dstLocHint.type = cudaMemLocationTypeDevice;
    attr.dstLocHint.id = device_;
    // Overlap with compute only pays when every copy is small (cuDF #23674).
    attr.flags = all_small ? cudaMemcpyFlagPreferOverlapWithCompute : cudaMemcpyFlagDefault;
    std::size_t attr_index = 0;
#if CUDART_VERSION >= 13000
    e = cudaMemcpyBatchAsync(dsts_.data(), srcs_.data(), sizes_.data(), sizes_.size(), &attr,
                             &attr_index, 1, stream_);
#else  // CUDA 12.8 and 12.9: non-const arrays and a failure index
    std::size_t failed_at = 0;
    e = cudaMemcpyBatchAsync(dsts_.data(), const_cast<void**>(srcs_.data()), sizes_.data(),
                             sizes_.size(), &attr, &attr_index, 1, &failed_at, stream_);
#endif
#else
    (void)all_small;
#endif
    if (e == cudaErrorStreamCaptureUnsupported) [[unlikely]] {
      (void)cudaGetLastError();
      oasiskv::detail::raise(errc::unsupported,
                             "cuda::copy_engine: cudaMemcpyBatchAsync cannot be captured in a "
                             "CUDA graph (the capture would drop the copies); capture "
                             "cuda::enqueue_gather instead");
    }
    if (e == cudaErrorNotSupported || e == cudaErrorCallRequiresNewerDriver) {
      (void)cudaGetLastError();  // an older driver: one cudaMemcpyAsync per run
      for (std::size_t i = 0; i < sizes_.size(); ++i) {
        detail::check(
            cudaMemcpyAsync(dsts_[i], srcs_[i], sizes_[i], cudaMemcpyHostToDevice, stream_),
            "cuda::copy_engine: cudaMemcpyAsync");
      }
    } else {
      detail::check(e, "cuda::copy_engine: cudaMemcpyBatchAsync");
    }
    stats_.memcpy_runs += sizes_.size();
  }

  std::size_t take_list_locked(std::size_t n) {
    std::size_t pick = no_list;
    for (std::size_t i = 0; i < lists_.size(); ++i) {
      if (!lists_[i].busy && (pick == no_list || lists_[i].capacity > lists_[pick].capacity)) {
        pick = i;
      }
    }
    if (pick == no_list) {
      lists_.push_back({});
      pick = lists_.size() - 1;
    }
    list_buffer& lb = lists_[pick];
    if (lb.capacity < n) {
      // Free buffers are not in flight, so they can be released; growth is rare (doubling).
      const std::size_t cap = std::max<std::size_t>({n, 1024, 2 * lb.capacity});
      (void)cudaFreeHost(lb.host);
      (void)cudaFree(lb.dev);
      lb = {};
      void* h = nullptr;
      void* d = nullptr;
      detail::check(cudaHostAlloc(&h, cap * sizeof(uint2), cudaHostAllocDefault),
                    "cuda::copy_engine: cudaHostAlloc (gather list)", errc::out_of_memory);
      if (const cudaError_t e = cudaMalloc(&d, cap * sizeof(uint2)); e != cudaSuccess) {
        (void)cudaFreeHost(h);
        detail::check(e, "cuda::copy_engine: cudaMalloc (gather list)", errc::out_of_memory);
      }
      lb.host = static_cast<uint2*>(h);
      lb.dev = static_cast<uint2*>(d);
      lb.capacity = cap;
    }
    lb.busy = true;
    return pick;
  }

  cudaEvent_t take_event_locked() {
    if (!free_events_.empty()) {
      const cudaEvent_t e = free_events_.back();
      free_events_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    detail::check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                  "cuda::copy_engine: cudaEventCreateWithFlags");
    return e;
  }

  void retire_finished_locked() {
    for (auto it = in_flight_.begin(); it != in_flight_.end();) {
      const cudaError_t e = cudaEventQuery(it->second.event);
      if (e == cudaErrorNotReady) {
        (void)cudaGetLastError();
        break;  // one stream: later batches cannot have finished either
      }
      it = retire_locked(it, e);
    }
  }

  std::map<std::uint64_t, batch>::iterator retire_locked(
      std::map<std::uint64_t, batch>::iterator it, cudaError_t e) {
    batch& b = it->second;
    for (const block_copy& c : b.copies) {
      auto r = reading_.find({b.src_tier, c.src});
      if (r != reading_.end() && --r->second == 0) {
        reading_.erase(r);
      }
      writing_.erase({b.dst_tier, c.dst});
    }
    if (b.list != no_list) {
      lists_[b.list].busy = false;
    }
    free_events_.push_back(b.event);
    if (e == cudaSuccess) {
      stats_.bytes += b.bytes;
    } else {
      (void)cudaGetLastError();
      ++stats_.failed_batches;
      failures_.emplace(b.id, "cuda::copy_engine: batch " + std::to_string(b.id) + " of " +
                                  std::to_string(b.blocks) + " blocks failed: " +
                                  cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
    }
    return in_flight_.erase(it);
  }

  void check_issued(const ticket& t) const {
    if (t.id == 0 || t.id > issued_) [[unlikely]] {
      oasiskv::detail::raise(errc::unknown_ticket, "cuda::copy_engine: ticket ", t.id,
                             " was never issued (last issued: ", issued_, ")");
    }
  }

  options options_;
  int device_ = 0;
  bool uva_host_pointers_ = false;
  cudaStream_t stream_ = nullptr;
  mutable std::mutex mutex_;
  std::map<std::uint64_t, batch> in_flight_;  // ordered by id = stream order
  std::unordered_map<std::uint64_t, std::string> failures_;
  std::unordered_map<slot_key, std::uint32_t, slot_key_hash> reading_;
  std::unordered_set<slot_key, slot_key_hash> writing_;
  std::vector<cudaEvent_t> free_events_;
  std::vector<list_buffer> lists_;
  std::vector<block_copy> sorted_;  // scratch of the memcpy path
  std::vector<void*> dsts_;
  std::vector<const void*> srcs_;
  std::vector<std::size_t> sizes_;
  std::uint64_t issued_ = 0;
  statistics stats_{};
};

static_assert(transfer_engine<copy_engine, pinned_host_tier, device_tier>);
static_assert(transfer_engine<copy_engine, host_tier, device_tier>);

}  // namespace oasiskv::cuda
