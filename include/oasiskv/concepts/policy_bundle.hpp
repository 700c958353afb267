// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Checks an engine author's policy bundle, one readable diagnostic per policy.
//!
//! A bundle is a struct whose member types name the policies (`allocator`, `fast_tier`,
//! `slow_tier`, `transfer`, `summary`, `predictor`, `kernel`). `check_policy_bundle<P>` checks
//! every member that `P` declares against its concept; a member that does not model it stops the
//! build with one `static_assert` that names the member and the concept, instead of pages of
//! template errors from deep inside the library.
#pragma once

#include "oasiskv/concepts/block_allocator.hpp"
#include "oasiskv/concepts/block_summary.hpp"
#include "oasiskv/concepts/importance_predictor.hpp"
#include "oasiskv/concepts/sparse_attention_kernel.hpp"
#include "oasiskv/concepts/tier_backend.hpp"
#include "oasiskv/concepts/transfer_engine.hpp"

namespace oasiskv {

namespace detail {
// Each check is a separate variable template so that a failure names one member only and the
// checks of absent members are never instantiated.
template <class P>
consteval bool check_allocator() {
  if constexpr (requires { typename P::allocator; }) {
    static_assert(block_allocator<typename P::allocator>,
                  "oasiskv: Policies::allocator does not model oasiskv::block_allocator "
                  "(see include/oasiskv/concepts/block_allocator.hpp)");
  }
  return true;
}
template <class P>
consteval bool check_tiers() {
  if constexpr (requires { typename P::fast_tier; }) {
    static_assert(addressable_tier<typename P::fast_tier>,
                  "oasiskv: Policies::fast_tier does not model oasiskv::addressable_tier "
                  "(see include/oasiskv/concepts/tier_backend.hpp)");
  }
  if constexpr (requires { typename P::slow_tier; }) {
    static_assert(tier_backend<typename P::slow_tier>,
                  "oasiskv: Policies::slow_tier does not model oasiskv::tier_backend "
                  "(see include/oasiskv/concepts/tier_backend.hpp)");
  }
  return true;
}
template <class P>
consteval bool check_transfer() {
  if constexpr (requires {
                  typename P::transfer;
                  typename P::fast_tier;
                  typename P::slow_tier;
                }) {
    static_assert(
        transfer_engine<typename P::transfer, typename P::slow_tier, typename P::fast_tier>,
        "oasiskv: Policies::transfer does not model oasiskv::transfer_engine<transfer, "
        "slow_tier, fast_tier> (see include/oasiskv/concepts/transfer_engine.hpp)");
  }
  return true;
}
template <class P>
consteval bool check_prediction() {
  if constexpr (requires { typename P::summary; }) {
    static_assert(block_summary<typename P::summary>,
                  "oasiskv: Policies::summary does not model oasiskv::block_summary "
                  "(see include/oasiskv/concepts/block_summary.hpp)");
  }
  if constexpr (requires { typename P::predictor; }) {
    static_assert(importance_predictor<typename P::predictor>,
                  "oasiskv: Policies::predictor does not model oasiskv::importance_predictor "
                  "(see include/oasiskv/concepts/importance_predictor.hpp)");
  }
  return true;
}
template <class P>
consteval bool check_kernel() {
  if constexpr (requires { typename P::kernel; }) {
    static_assert(sparse_attention_kernel<typename P::kernel>,
                  "oasiskv: Policies::kernel does not model oasiskv::sparse_attention_kernel "
                  "(see include/oasiskv/concepts/sparse_attention_kernel.hpp)");
  }
  return true;
}
}  // namespace detail

//! @brief True for a bundle whose declared policies all model their concepts; instantiating it
//! with one that does not fails with that policy's diagnostic.
template <class P>
inline constexpr bool check_policy_bundle =
    detail::check_allocator<P>() && detail::check_tiers<P>() && detail::check_transfer<P>() &&
    detail::check_prediction<P>() && detail::check_kernel<P>();

}  // namespace oasiskv
