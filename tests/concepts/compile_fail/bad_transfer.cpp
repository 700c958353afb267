// SPDX-License-Identifier: Apache-2.0
// An engine without test(): the caller could never poll a transfer.
#include <span>

#include "oasiskv/oasiskv.hpp"

struct blocking_engine {
  struct ticket {};
  ticket submit(const oasiskv::host_tier&, oasiskv::host_tier&,
                std::span<const oasiskv::block_copy>);
  void wait(const ticket&);
};
struct bundle {
  using allocator = oasiskv::free_list_allocator;
  using fast_tier = oasiskv::host_tier;
  using slow_tier = oasiskv::host_tier;
  using transfer = blocking_engine;
};
static_assert(oasiskv::check_policy_bundle<bundle>);
