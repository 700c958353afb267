// SPDX-License-Identifier: Apache-2.0
// oasiskv::file: file_tier with its io_uring backend, linked against liburing.
#include <liburing.h>

#include <cstdio>
#include <oasiskv/tier/file_tier.hpp>

#if !defined(OASISKV_WITH_LIBURING)
#error "oasiskv::file did not define OASISKV_WITH_LIBURING"
#endif

int main() {
  io_uring ring;
  if (io_uring_queue_init(4, &ring, 0) == 0) {
    io_uring_queue_exit(&ring);
  }
  std::printf("file: %zu-byte file_tier\n", sizeof(oasiskv::file_tier));
  return 0;
}
