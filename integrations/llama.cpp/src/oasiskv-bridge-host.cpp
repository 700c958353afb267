// SPDX-License-Identifier: Apache-2.0
// The caches over a host-memory capacity tier, one per block summary.
#include "oasiskv-bridge-impl.hpp"

namespace oasiskv_bridge::detail {

std::unique_ptr<cache> make_host_cache(const cache_config& c, const oasiskv::kv_layout& l,
                                       std::uint32_t slow_slots, std::uint32_t fast_slots,
                                       const oasiskv::cache_options& o) {
  return make_cache(c, l, oasiskv::host_tier(l, slow_slots), fast_slots, o);
}

}  // namespace oasiskv_bridge::detail
