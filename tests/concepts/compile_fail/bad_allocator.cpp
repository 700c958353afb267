// SPDX-License-Identifier: Apache-2.0
// An allocator whose allocate() returns a raw id (no way to say "full").
#include "oasiskv/oasiskv.hpp"

struct raw_id_allocator {
  oasiskv::slot_id allocate();
  void deallocate(oasiskv::slot_id);
  std::size_t capacity() const;
  std::size_t available() const;
};
struct bundle {
  using allocator = raw_id_allocator;
  using fast_tier = oasiskv::host_tier;
  using kernel = oasiskv::reference_decode;
};
static_assert(oasiskv::check_policy_bundle<bundle>);
