// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The `tiered_kv_cache` policy bundles the mini-decoder builds: one per attention mode,
//! all on host tiers with the CPU kernel. Shared by the single-sequence backend
//! (kv_backend.cpp) and the batched engine (batch/batch.cpp).
#pragma once

#include <memory>
#include <numeric>
#include <type_traits>

#include <mini_decoder/kv/kv_backend.hpp>
#include <mini_decoder/ops/threads.hpp>

#include "oasiskv/oasiskv.hpp"
#include "oasiskv/predictor/lookahead_predictor.hpp"
#include "oasiskv/predictor/recency_predictor.hpp"
#include "oasiskv/summary/cascade_summary.hpp"
#include "oasiskv/summary/minmax_summary.hpp"
#include "oasiskv/summary/qminmax_int2_summary.hpp"
#include "oasiskv/summary/quantized_key_summary.hpp"
#include "oasiskv/summary/quantized_minmax_summary.hpp"

namespace mini_decoder::bundles {

//! Dense attention through the sparse path: every block, always (the engine's own predictor,
//! as any engine may write one against the importance_predictor concept).
struct select_all_predictor {
  using summary_type = oasiskv::no_summary;
  static constexpr oasiskv::prediction_timing timing = oasiskv::prediction_timing::lookahead;
  void select(const oasiskv::prediction_input<oasiskv::no_summary>& in,
              const oasiskv::selection_params&, oasiskv::selection& out) {
    const std::uint32_t n = in.layout.blocks_for(in.seq_len);
    out.tables = 1;
    out.blocks.resize(n);
    std::iota(out.blocks.begin(), out.blocks.end(), 0u);
    out.offsets = {0, n};
  }
};

//! Host fast and capacity tiers, CPU copies and the CPU sparse kernel; the mode picks the
//! scheduler and the predictor.
template <class Scheduler, class Predictor>
struct bundle {
  using allocator = oasiskv::free_list_allocator;
  using fast_tier = oasiskv::host_tier;
  using slow_tier = oasiskv::host_tier;
  using transfer = oasiskv::cpu_copy_engine;
  using predictor = Predictor;
  using scheduler = Scheduler;
  using kernel = oasiskv::cpu::sparse_decode;
};

//! Every block resident, every block attended.
using dense_bundle = bundle<oasiskv::all_resident, select_all_predictor>;
//! Lookahead prediction from the previous step's queries through `Summary`, prefetched ahead of
//! attention.
template <class Summary>
using oasis_bundle = bundle<oasiskv::lookahead_prefetcher<>, oasiskv::lookahead_predictor<Summary>>;
//! Prediction from the current query through the f16 min/max bounds, fetched on demand (Quest).
using quest_bundle = bundle<oasiskv::on_demand_fetcher<>,
                            oasiskv::current_query_predictor<oasiskv::minmax_summary<>>>;
//! The most recent blocks only.
using recency_bundle = bundle<oasiskv::lookahead_prefetcher<>, oasiskv::recency_predictor>;
//! Lookahead prediction through `Summary`, but fetched at attention time (no overlap).
template <class Summary>
using on_demand_bundle =
    bundle<oasiskv::on_demand_fetcher<>, oasiskv::lookahead_predictor<Summary>>;

//! Calls `f(std::type_identity<S>{})` with the summary type `S` that `k` names; returns what
//! `f` returns (the same type for every `S`).
template <class F>
decltype(auto) with_summary(summary_kind k, F&& f) {
  switch (k) {
    case summary_kind::qminmax:
      return f(std::type_identity<oasiskv::quantized_minmax_summary>{});
    case summary_kind::int8:
      return f(std::type_identity<oasiskv::int8_key_summary>{});
    case summary_kind::int4:
      return f(std::type_identity<oasiskv::int4_key_summary>{});
    case summary_kind::cascade:
      return f(std::type_identity<oasiskv::qminmax_int4_cascade>{});
    case summary_kind::int2:
      return f(std::type_identity<oasiskv::qminmax_int2_summary>{});
    case summary_kind::minmax:
      break;
  }
  return f(std::type_identity<oasiskv::minmax_summary<>>{});
}

//! The attention kernel of `threads` threads. With more than one it runs on the engine's pool
//! (`shared_engine_pool`, where the products run) when that pool has as many threads, so the
//! products and attention take turns on one pool instead of two pools contending for the cores;
//! otherwise on a pool of its own. `keep` receives the shared pool: declare it before the cache
//! that holds the kernel, so that the pool outlives the kernel.
inline oasiskv::cpu::sparse_decode attention_kernel(
    unsigned threads, std::shared_ptr<oasiskv::cpu::thread_pool>& keep) {
  if (threads > 1 && num_threads() == static_cast<int>(threads)) {
    keep = shared_engine_pool();
    return oasiskv::cpu::sparse_decode(*keep);
  }
  return oasiskv::cpu::sparse_decode(threads);
}

//! Lets `cache`'s predictor score the KV heads of each selection in parallel on `pool` (the
//! engine's pool that `attention_kernel` shared, so the predictor takes its turn on it too),
//! where the predictor can (the summary-scoring ones); nothing for a null pool.
template <class Cache>
void share_pool_with_predictor(Cache& cache, oasiskv::cpu::thread_pool* pool) {
  if constexpr (requires { cache.predictor().set_thread_pool(pool); }) {
    cache.predictor().set_thread_pool(pool);
  }
}

}  // namespace mini_decoder::bundles
