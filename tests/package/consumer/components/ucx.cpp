// SPDX-License-Identifier: Apache-2.0
// oasiskv::ucx: the UCX wrappers of the remote tier, linked against UCP and UCS.
#include <cstdio>
#include <oasiskv/disagg/ucx_common.hpp>

int main() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  std::printf("ucx: UCP %u.%u.%u (%s)\n", major, minor, release, ucs_status_string(UCS_OK));
  return 0;
}
