// SPDX-License-Identifier: Apache-2.0
// Which machine-dependent paths a test ran (an ISA's kernels, io_uring, O_DIRECT, F16C): each is
// appended once per process, as one line, to the file that OASISKV_PATHS_LOG names.
// scripts/test.sh prints the union and fails when a path this machine supports did not run, so
// a path that silently stops being tested cannot leave CI green.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <mutex>
#include <set>
#include <string>
#include <string_view>

namespace oasiskv::testing {

inline void note_path(std::string_view what) {
  const char* file = std::getenv("OASISKV_PATHS_LOG");
  if (file == nullptr || *file == '\0') {
    return;
  }
  static std::mutex mutex;
  static std::set<std::string, std::less<>> seen;
  const std::lock_guard lock(mutex);
  if (!seen.emplace(what).second) {
    return;
  }
  const std::string line = std::string(what) + "\n";
  const int fd = ::open(file, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd >= 0) {
    // One write of a short line with O_APPEND: lines from parallel tests never interleave.
    [[maybe_unused]] const ssize_t n = ::write(fd, line.data(), line.size());
    ::close(fd);
  }
}

}  // namespace oasiskv::testing
