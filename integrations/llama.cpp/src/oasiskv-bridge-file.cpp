// SPDX-License-Identifier: Apache-2.0
// The caches over a file capacity tier (`file:PATH`), one per block summary.
#include "oasiskv-bridge-impl.hpp"

namespace oasiskv_bridge::detail {

std::unique_ptr<cache> make_file_cache(const cache_config& c, const oasiskv::kv_layout& l,
                                       std::uint32_t slow_slots, std::uint32_t fast_slots,
                                       const oasiskv::cache_options& o) {
  oasiskv::file_tier_options fo;
  fo.path = c.capacity.substr(5);
  fo.write_behind = true;  // a token's partial block is written once per layer and step
  return make_cache(c, l, oasiskv::file_tier(l, slow_slots, fo), fast_slots, o);
}

}  // namespace oasiskv_bridge::detail
