// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The residency kernel of `cuda::device_decode_step`: after the GPU selection, gives every
//! selected block a staging slot of its sequence, on the device, and lists the copies the
//! gather must make (blocks not resident, or resident with fewer tokens than they now hold).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/block/block_scan.cuh>
#include <type_traits>

#include "oasiskv/config.hpp"
#include "oasiskv/core/ids.hpp"

namespace oasiskv::cuda::detail {

inline constexpr std::uint32_t residency_status_bad_source = 1u;    //!< capacity slot out of range
inline constexpr std::uint32_t residency_none = ~std::uint32_t{0};  //!< an empty slot's tag
inline constexpr int residency_threads = 256;

//! @brief Tokens held by block `b` of a sequence of `len` tokens (`tokens_per_block` for every
//! block but a partial last one; 0 past the end).
OASISKV_HOST_DEVICE constexpr std::uint32_t tokens_in_block(std::uint32_t len, std::uint32_t b,
                                                            std::uint32_t tokens_per_block) {
  const std::uint64_t start = std::uint64_t{b} * tokens_per_block;
  if (start >= len) {
    return 0;
  }
  const std::uint64_t left = len - start;
  return left < tokens_per_block ? static_cast<std::uint32_t>(left) : tokens_per_block;
}

//! @brief What one slot holds: the sequence's block index, the capacity slot it was copied
//! from and how many tokens the block held then (`residency_none` everywhere: empty).
struct slot_tag {
  std::uint32_t block;
  std::uint32_t source;
  std::uint32_t tokens;
  std::uint32_t unused;
};
static_assert(sizeof(slot_tag) == 16);

//! @brief Everything the residency kernel reads and writes; device pointers, passed by value.
struct residency_args {
  block_ref* refs = nullptr;                      // the selection's tables (slots patched here)
  const std::uint32_t* offsets = nullptr;         // [num_seqs + 1]
  const std::uint32_t* seq_lens = nullptr;        // [num_seqs]
  const std::uint32_t* capacity_slots = nullptr;  // [num_seqs][max_blocks]
  slot_id* staged = nullptr;                      // [num_seqs][max_blocks]: slot or null_slot
  slot_tag* tags = nullptr;                       // [num_seqs][budget]
  uint2* pairs = nullptr;                         // out: (capacity slot, fast slot)
  std::uint32_t* pair_count = nullptr;            // zeroed before the kernel
  std::uint32_t* status = nullptr;
  std::uint32_t max_blocks = 0;
  std::uint32_t budget = 0;  // staging slots per sequence
  std::uint32_t tokens_per_block = 0;
  std::uint32_t capacity_slots_total = 0;  // the capacity pool's slots
  slot_id first_slot = 0;                  // sequence s owns [first_slot + s * budget, +budget)
};
static_assert(std::is_trivially_copyable_v<residency_args>);

//! One CTA per sequence, `2 * budget` words of dynamic shared memory. A selected block whose
//! slot the selection found (`staged`) keeps it, and is copied again only if its tag differs
//! (another capacity slot, or more tokens: a partial last block that grew). Every other slot of
//! the sequence is free (the selection holds at most `budget` blocks and the staged map is
//! one-to-one, so there are at least as many free slots as misses); the k-th miss in index order
//! takes the k-th free slot in slot order, the block it held leaves the staged map, and the
//! copy is listed. A capacity slot outside the pool is not copied: the table entry becomes
//! `null_slot` (skipped by the decode kernel) and the status word is set.
// A template: a plain __global__ function in a header is defined again by every translation unit
// that includes it, and a program of two such units fails to link (test_cuda_two_units).
template <class = void>
__global__ void __launch_bounds__(residency_threads) residency_kernel(const residency_args a) {
  using scan = cub::BlockScan<std::uint32_t, residency_threads>;
  __shared__ typename scan::TempStorage storage;
  extern __shared__ std::uint32_t shared_words[];
  std::uint32_t* kept = shared_words;                  // [budget]: 1 where a hit keeps the slot
  std::uint32_t* free_list = shared_words + a.budget;  // [budget]: free local slots, in order

  const std::uint32_t seq = blockIdx.x;
  const slot_id first = a.first_slot + seq * a.budget;
  const std::uint32_t begin = a.offsets[seq];
  const std::uint32_t n = a.offsets[seq + 1] - begin;
  const std::uint32_t len = a.seq_lens[seq];
  const std::size_t row = std::size_t{seq} * a.max_blocks;
  slot_tag* tags = a.tags + std::size_t{seq} * a.budget;
  auto local_of = [&](slot_id s) {
    return s - first;
  };  // >= budget (wrapped) if outside
  for (std::uint32_t k = threadIdx.x; k < a.budget; k += residency_threads) {
    kept[k] = 0;
  }
  __syncthreads();
  for (std::uint32_t j = threadIdx.x; j < n; j += residency_threads) {
    const slot_id s = a.refs[begin + j].slot;
    if (s != null_slot && local_of(s) < a.budget) {
      kept[local_of(s)] = 1;
    }
  }
  __syncthreads();
  {
    const std::uint32_t chunk = (a.budget + residency_threads - 1) / residency_threads;
    const std::uint32_t c0 = threadIdx.x * chunk < a.budget ? threadIdx.x * chunk : a.budget;
    const std::uint32_t c1 = c0 + chunk < a.budget ? c0 + chunk : a.budget;
    std::uint32_t count = 0;
    for (std::uint32_t k = c0; k < c1; ++k) {
      count += kept[k] == 0 ? 1u : 0u;
    }
    std::uint32_t at = 0;
    scan(storage).ExclusiveSum(count, at);
    for (std::uint32_t k = c0; k < c1; ++k) {
      if (kept[k] == 0) {
        free_list[at++] = k;
      }
    }
  }
  __syncthreads();  // the free list is complete; the scan storage is free again
  const std::uint32_t chunk = (n + residency_threads - 1) / residency_threads;
  const std::uint32_t c0 = threadIdx.x * chunk < n ? threadIdx.x * chunk : n;
  const std::uint32_t c1 = c0 + chunk < n ? c0 + chunk : n;
  auto is_miss = [&](slot_id s) {
    return s == null_slot || local_of(s) >= a.budget;
  };
  std::uint32_t misses = 0;
  for (std::uint32_t j = c0; j < c1; ++j) {
    misses += is_miss(a.refs[begin + j].slot) ? 1u : 0u;
  }
  std::uint32_t rank = 0;
  scan(storage).ExclusiveSum(misses, rank);
  for (std::uint32_t j = c0; j < c1; ++j) {
    block_ref& r = a.refs[begin + j];
    const std::uint32_t b = r.index;
    const std::uint32_t source = a.capacity_slots[row + b];
    const std::uint32_t tokens = tokens_in_block(len, b, a.tokens_per_block);
    std::uint32_t local;
    if (is_miss(r.slot)) {
      local = free_list[rank++];
      const std::uint32_t old = tags[local].block;
      // The block that held the slot leaves the staged map (it is not selected: its slot is
      // free, so no other thread writes its entry).
      if (old < a.max_blocks && a.staged[row + old] == first + local) {
        a.staged[row + old] = null_slot;
      }
      a.staged[row + b] = first + local;
      r.slot = first + local;
    } else {
      local = local_of(r.slot);
      const slot_tag t = tags[local];
      if (t.block == b && t.source == source && t.tokens == tokens) {
        continue;  // resident as it is now
      }
    }
    if (source >= a.capacity_slots_total) [[unlikely]] {
      tags[local] = slot_tag{residency_none, residency_none, residency_none, 0};
      a.staged[row + b] = null_slot;
      r.slot = null_slot;
      atomicOr(a.status, residency_status_bad_source);
      continue;
    }
    tags[local] = slot_tag{b, source, tokens, 0};
    const std::uint32_t p = atomicAdd(a.pair_count, 1u);
    a.pairs[p] = make_uint2(source, first + local);
  }
}

}  // namespace oasiskv::cuda::detail
