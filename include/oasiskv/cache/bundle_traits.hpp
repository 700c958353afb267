// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief What `tiered_kv_cache` reads off its policies at compile time: which optional paths
//! (shipped summaries, compact summary stores, host-built tables, dense staging) it takes.
#pragma once

#include <type_traits>

#include "oasiskv/concepts/growable_summary.hpp"
#include "oasiskv/concepts/loadable_summary.hpp"
#include "oasiskv/concepts/policy_bundle.hpp"
#include "oasiskv/concepts/prefetch_scheduler.hpp"
#include "oasiskv/concepts/transfer_engine.hpp"
#include "oasiskv/core/selection.hpp"
#include "oasiskv/scheduler/staging_scheduler.hpp"

namespace oasiskv::cache {

//! @brief True for a predictor's summary type other than `no_summary`.
template <class Summary>
inline constexpr bool has_summary_v = !std::is_same_v<Summary, no_summary>;

//! @brief True when adopted blocks can bring their summary entries (`loadable_summary`).
template <class Summary>
inline constexpr bool loads_summaries_v = [] {
  if constexpr (has_summary_v<Summary>) {
    return loadable_summary<Summary>;
  } else {
    return false;
  }
}();

//! @brief True when summary entries go only to the capacity slots in use (`growable_summary`).
template <class Summary>
inline constexpr bool compact_summaries_v = [] {
  if constexpr (has_summary_v<Summary>) {
    return growable_summary<Summary>;
  } else {
    return false;
  }
}();

//! @brief True for the dense baseline's scheduler (`all_resident`): every block is staged as
//! soon as it fills.
template <class Scheduler>
inline constexpr bool stages_everything_v = [] {
  if constexpr (moded_scheduler<Scheduler>) {
    return Scheduler::mode == prefetch_mode::all_resident;
  } else {
    return false;
  }
}();

//! @brief The scheduler of a bundle, its tag bound to the bundle's tiers, engine and
//! allocator; one diagnostic where the tag does not make a `prefetch_scheduler`.
template <class Policies>
struct bound_scheduler {
  static_assert(scheduler_policy<typename Policies::scheduler, typename Policies::fast_tier,
                                 typename Policies::slow_tier, typename Policies::transfer,
                                 typename Policies::allocator>,
                "oasiskv: Policies::scheduler does not model oasiskv::scheduler_policy (a tag "
                "whose bind<fast_tier, slow_tier, transfer, allocator> models "
                "oasiskv::prefetch_scheduler)");
  using type = typename Policies::scheduler::template bind<
      typename Policies::fast_tier, typename Policies::slow_tier, typename Policies::transfer,
      typename Policies::allocator>;
};

//! @brief A cache's transfer engine: built from its capacity tier where it has that
//! constructor (`tier_bound_engine`: `routing_engine` over a `composite_tier`), else by default.
template <class Transfer, class Slow>
Transfer make_engine(Slow& slow) {
  if constexpr (tier_bound_engine<Transfer, Slow>) {
    return Transfer(slow);
  } else {
    (void)slow;
    return Transfer();
  }
}

}  // namespace oasiskv::cache
