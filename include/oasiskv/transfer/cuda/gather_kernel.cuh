// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The SM-driven block gather: whole-slot copies, 16 bytes per load, from any memory the
//! device can address (pinned host memory through UVA, or device memory) into device slots.
//! Its copy list and count live in device memory, so a launch can be captured in a CUDA graph
//! and replayed with lists that the device itself wrote (a selection kernel's misses).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "oasiskv/cuda/detail/runtime.cuh"

namespace oasiskv::cuda {

//! @brief One gather launch. Trivially copyable: passed by value as the kernel parameter.
struct gather_args {
  const std::byte* src = nullptr;  // [*][src_stride] device-addressable (UVA) source slots
  std::size_t src_stride = 0;      // bytes between source slots, a multiple of 16
  std::byte* dst = nullptr;        // [*][dst_stride] device slots
  std::size_t dst_stride = 0;      // bytes between destination slots, a multiple of 16
  std::size_t block_bytes = 0;     // bytes per copy, a multiple of 16
  const uint2* pairs = nullptr;    // [max_count] (source slot, destination slot), device memory
  const std::uint32_t* count = nullptr;  // device memory: copies to make (<= max_count); null:
                                         // max_count
  std::uint32_t max_count = 0;
};
static_assert(std::is_trivially_copyable_v<gather_args>);

namespace detail {

//! Each CTA takes whole blocks (grid-stride), each thread moves 16-byte words with `unroll`
//! loads in flight before the first store: a PCIe read takes a microsecond or more, so the
//! bytes in flight, not the instruction count, set the bandwidth.
template <int Unroll>
__global__ void gather_blocks_kernel(gather_args a) {
  const std::uint32_t n = a.count != nullptr ? min(*a.count, a.max_count) : a.max_count;
  const std::size_t words = a.block_bytes / 16;
  const std::size_t step = std::size_t{blockDim.x} * Unroll;
  for (std::uint32_t i = blockIdx.x; i < n; i += gridDim.x) {
    const uint2 p = a.pairs[i];
    const uint4* s = reinterpret_cast<const uint4*>(a.src + std::size_t{p.x} * a.src_stride);
    uint4* d = reinterpret_cast<uint4*>(a.dst + std::size_t{p.y} * a.dst_stride);
    for (std::size_t w = threadIdx.x; w < words; w += step) {
      uint4 r[Unroll];
#pragma unroll
      for (int u = 0; u < Unroll; ++u) {
        const std::size_t x = w + static_cast<std::size_t>(u) * blockDim.x;
        if (x < words) {
          r[u] = s[x];
        }
      }
#pragma unroll
      for (int u = 0; u < Unroll; ++u) {
        const std::size_t x = w + static_cast<std::size_t>(u) * blockDim.x;
        if (x < words) {
          d[x] = r[u];
        }
      }
    }
  }
}

}  // namespace detail

//! @brief Threads per gather CTA, and loads in flight per thread.
inline constexpr unsigned gather_threads = 512;
inline constexpr int gather_unroll = 4;

//! @brief Enqueues a gather on `stream` with a fixed grid of `ctas` CTAs (CTAs beyond the
//! device-side count idle out). Capturable: no host synchronisation, no allocation. Checks the
//! launch, not the copies (those fail, if at all, at the stream's next synchronisation).
inline void enqueue_gather(const gather_args& a, unsigned ctas, cudaStream_t stream) {
  if (a.block_bytes % 16 != 0 || a.src_stride % 16 != 0 || a.dst_stride % 16 != 0 ||
      reinterpret_cast<std::uintptr_t>(a.src) % 16 != 0 ||
      reinterpret_cast<std::uintptr_t>(a.dst) % 16 != 0) [[unlikely]] {
    oasiskv::detail::raise(errc::misaligned,
                           "cuda::enqueue_gather: bases, strides and block bytes must be "
                           "multiples of 16 (block_bytes = ",
                           a.block_bytes, ")");
  }
  if (a.max_count == 0 || ctas == 0) {
    return;
  }
  detail::gather_blocks_kernel<gather_unroll><<<ctas, gather_threads, 0, stream>>>(a);
  detail::check(cudaGetLastError(), "cuda::enqueue_gather: launch");
}

}  // namespace oasiskv::cuda
