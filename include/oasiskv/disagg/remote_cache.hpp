// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The policies that make a prefill node's memory the capacity tier of a
//! `tiered_kv_cache`, and `adopted_request`, one remote request admitted into such a cache.
//!
//! ```cpp
//! struct policies {
//!   using allocator = oasiskv::free_list_allocator;
//!   using fast_tier = oasiskv::host_tier;                          // the staging budget
//!   using slow_tier = oasiskv::disagg::remote_capacity_tier<>;     // exporter + local tail
//!   using transfer  = oasiskv::disagg::remote_transfer;            // UCX gets + memcpy
//!   using predictor = oasiskv::lookahead_predictor<oasiskv::minmax_summary<>>;
//!   using scheduler = oasiskv::lookahead_prefetcher<>;             // selective admission
//!   using kernel    = oasiskv::cpu::sparse_decode;
//! };
//! ```
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "oasiskv/concepts/transfer_engine.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/ids.hpp"
#include "oasiskv/disagg/ucx_engine.hpp"
#include "oasiskv/disagg/ucx_remote_tier.hpp"
#include "oasiskv/tier/composite_tier.hpp"
#include "oasiskv/tier/host_tier.hpp"
#include "oasiskv/transfer/cpu_copy_engine.hpp"
#include "oasiskv/transfer/routing_engine.hpp"

namespace oasiskv::disagg {

//! @brief The `ucx_engine` a `ucx_remote_tier` is connected through, as a transfer policy: built
//! from the tier (a `routing_engine` builds it from its composite's remote part), it forwards
//! every batch to that engine. Models `transfer_engine<ucx_engine_ref, ucx_remote_tier, Dst>` for
//! host-accessible `Dst`. The engine must outlive it.
class ucx_engine_ref {
 public:
  using ticket = ucx_engine::ticket;

  explicit ucx_engine_ref(const ucx_remote_tier& tier) noexcept : engine_(&tier.engine()) {}
  explicit ucx_engine_ref(ucx_engine& engine) noexcept : engine_(&engine) {}

  template <remote_block_source Src, host_accessible_tier Dst>
  ticket submit(const Src& src, Dst& dst, std::span<const block_copy> copies) {
    return engine_->submit(src, dst, copies);
  }
  bool test(const ticket& t) const { return engine_->test(t); }
  void wait(const ticket& t) { engine_->wait(t); }
  ucx_engine& engine() const noexcept { return *engine_; }

 private:
  ucx_engine* engine_;
};

//! @brief A capacity tier of an exporter's slots `[0, n)` (read-only, adopted only) and local
//! slots `[n, n + m)` in `Local` for the tokens the decode node appends.
template <class Local = host_tier>
using remote_capacity_tier = composite_tier<ucx_remote_tier, Local>;

//! @brief UCX gets for the exporter's slots, `cpu_copy_engine` for the local ones.
using remote_transfer = routing_engine<ucx_engine_ref, cpu_copy_engine>;

static_assert(transfer_engine<remote_transfer, remote_capacity_tier<>, host_tier>);

//! @brief One request of the exporter behind `Cache`'s capacity tier, admitted into the cache:
//! leased (`open`), then adopted with its block table and, when the cache's summary can load
//! them, the shipped summaries (a summary that cannot load reads every block once instead).
//! Which blocks are read is the cache's scheduler's business: `lookahead_prefetcher` stages the
//! sink blocks and the recent window's full blocks at admission and each step's predicted
//! blocks after (selective admission); `all_resident` stages every full block at admission
//! (full admission). The destructor removes the sequence from the cache, then ends the lease.
template <class Cache>
class adopted_request {
 public:
  adopted_request(Cache& cache, std::uint64_t request) : cache_(&cache), request_(request) {
    ucx_remote_tier& tier = cache.capacity_tier().first();
    constexpr bool summaries = Cache::loads_summaries;
    const opened_msg o = tier.open(request, summaries);
    const std::uint64_t staged_before = cache.stats().bytes_prefetched;
    try {
      std::vector<slot_id> slots;
      slots.reserve(o.blocks.size());
      for (const block_entry& b : o.blocks) {
        slots.push_back(b.slot);
      }
      seq_ = cache.adopt(
          o.tokens, slots,
          summaries ? std::span<const std::byte>(o.summaries) : std::span<const std::byte>{});
    } catch (...) {
      try {
        tier.release(request);
      } catch (const error&) {
      }
      throw;
    }
    tokens_ = o.tokens;
    admitted_bytes_ = o.summaries.size() + (cache.stats().bytes_prefetched - staged_before);
  }
  adopted_request(const adopted_request&) = delete;
  adopted_request& operator=(const adopted_request&) = delete;
  ~adopted_request() {
    try {
      cache_->remove(seq_);
    } catch (const error&) {
    }
    try {
      cache_->capacity_tier().first().release(request_);
    } catch (const error&) {
      // The exporter is gone or the lease lapsed: it reclaims the blocks itself.
    }
  }

  sequence_id sequence() const noexcept { return seq_; }
  std::uint64_t request() const noexcept { return request_; }
  //! @brief The prompt's tokens (what the exporter holds).
  std::uint32_t prompt_tokens() const noexcept { return tokens_; }
  //! @brief Bytes admission read or started reading: the shipped summaries and the blocks the
  //! cache staged at once.
  std::uint64_t admitted_bytes() const noexcept { return admitted_bytes_; }

 private:
  Cache* cache_;
  std::uint64_t request_;
  sequence_id seq_{};
  std::uint32_t tokens_ = 0;
  std::uint64_t admitted_bytes_ = 0;
};

}  // namespace oasiskv::disagg
