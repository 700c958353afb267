// SPDX-License-Identifier: Apache-2.0
// A kernel with the wrong entry point name.
#include "oasiskv/oasiskv.hpp"

struct misnamed_kernel {
  void run(const oasiskv::decode_params&);
};
struct bundle {
  using allocator = oasiskv::free_list_allocator;
  using kernel = misnamed_kernel;
};
static_assert(oasiskv::check_policy_bundle<bundle>);
