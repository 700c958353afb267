// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cuda::pinned_host_tier`: the capacity tier in page-locked host memory, registered with
//! CUDA in chunks of whole slots so a device can copy (DMA or an SM gather through UVA) from it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "oasiskv/concepts/tier_backend.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/views.hpp"
#include "oasiskv/cuda/detail/runtime.cuh"
#include "oasiskv/tier/host_tier.hpp"

namespace oasiskv::cuda {

//! @brief How a `pinned_host_tier` gets and registers its memory.
struct pinned_host_tier_options {
  //! Bytes per cudaHostRegister call, rounded down to whole slots. Registering in chunks keeps
  //! each call far below the size at which a single registration fails (>= 512 GiB on r580
  //! drivers) and lets pinning of a large pool proceed piecewise; a copy never spans two chunks.
  std::size_t register_chunk_bytes = std::size_t{1} << 30;
  //! Transparent huge pages for the pool (fewer TLB misses for DMA and SM gathers).
  bool huge_pages = false;
  //! Touch every page before registering: allocating, touching and registering was measured
  //! about 2x faster than cudaHostAlloc of the same size (ik_llama #1988).
  bool prefault = true;
};

//! @brief `host_tier` whose memory is registered with cudaHostRegister (`register_flags`:
//! portable to every device, and mapped into the device address space, which under UVA puts it at
//! the host's own addresses: the gather kernels of `cuda::copy_engine` and
//! `cuda::device_decode_step` read it through the host pointer), chunk by chunk through
//! `host_tier`'s pin hook, and unregistered in reverse. Move-only.
//! Models `host_accessible_tier` with `memory_kind::pinned_host`: the CPU reads and writes its
//! slots (appends), and the device reads them through `cuda::copy_engine`.
class pinned_host_tier {
 public:
  static constexpr memory_kind memory = memory_kind::pinned_host;
  //! @brief The flags of every registration: `cudaHostRegisterPortable` (every device may copy
  //! from it) and `cudaHostRegisterMapped` (kernels may read it; without it the device is not
  //! required to map the memory, and a kernel reading it through the host pointer faults).
  static constexpr unsigned register_flags = cudaHostRegisterPortable | cudaHostRegisterMapped;

  pinned_host_tier(const kv_layout& layout, std::uint32_t num_slots,
                   pinned_host_tier_options options = {})
      : host_(layout, num_slots, host_options(options)) {}

  const kv_layout& layout() const noexcept { return host_.layout(); }
  std::uint32_t num_slots() const noexcept { return host_.num_slots(); }
  std::size_t slot_bytes() const noexcept { return host_.slot_bytes(); }
  std::size_t bytes() const noexcept { return host_.bytes(); }
  std::byte* slot_data(slot_id s) { return host_.slot_data(s); }
  const std::byte* slot_data(slot_id s) const { return host_.slot_data(s); }
  block_pool_view view() const noexcept { return host_.view(); }

  //! @brief cudaHostRegister calls that succeeded.
  std::size_t registrations() const noexcept { return host_.pinned_chunks(); }
  //! @brief Slots per registration: consecutive slots may be copied as one run only within
  //! `[c * slots_per_chunk(), (c + 1) * slots_per_chunk())`.
  std::uint32_t slots_per_chunk() const noexcept { return host_.slots_per_chunk(); }
  //! @brief The registration that holds slot `s`.
  std::uint32_t chunk_of(slot_id s) const noexcept { return s / host_.slots_per_chunk(); }
  //! @brief The underlying host tier (for code written against `host_tier`).
  const host_tier& host() const noexcept { return host_; }

 private:
  static host_tier_options host_options(const pinned_host_tier_options& o) {
    host_tier_options h;
    h.align = host_tier_options::alignment::page;  // cudaHostRegister wants whole pages
    h.huge_pages = o.huge_pages;
    h.prefault = o.prefault;
    h.pin_chunk_bytes = o.register_chunk_bytes;
    h.pin = [](void* p, std::size_t n) {
      const cudaError_t e = cudaHostRegister(p, n, register_flags);
      if (e != cudaSuccess) [[unlikely]] {
        (void)cudaGetLastError();
        oasiskv::detail::raise(detail::code_of(e, errc::out_of_memory),
                               "cuda::pinned_host_tier: cudaHostRegister of ", n, " bytes at ", p,
                               " failed: ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
      }
    };
    h.unpin = [](void* p, std::size_t) {
      (void)cudaHostUnregister(p);
    };
    return h;
  }

  host_tier host_;
};

static_assert(host_accessible_tier<pinned_host_tier>);

}  // namespace oasiskv::cuda
