// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/ops/blas.hpp>

#include <unistd.h>

#include <cstdlib>
#include <cstring>

extern "C" char* openblas_get_corename(void);  // OpenBLAS's own; not in cblas.h

namespace mini_decoder {

namespace {
// Marks the variable as set here (for `blas_kernels`), and a second start as the last one.
constexpr const char* marker = "MINI_DECODER_OPENBLAS_CORETYPE";
}  // namespace

void choose_blas_kernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr || std::getenv(marker) != nullptr) {
    return;
  }
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    return;
  }
  ::setenv("OPENBLAS_CORETYPE", "Haswell", 1);
  ::setenv(marker, "Haswell", 1);
  ::execv("/proc/self/exe", argv);
  // No exec (no /proc): this process keeps OpenBLAS's own pick, and says so.
  ::unsetenv("OPENBLAS_CORETYPE");
  ::setenv(marker, "", 1);
}

std::string blas_kernels() {
  const char* name = openblas_get_corename();
  std::string s = name != nullptr ? name : "unknown";
  const char* by = std::getenv(marker);
  if (by != nullptr && *by != '\0') {
    return s + " (chosen for this AVX2 CPU)";
  }
  if (by == nullptr && std::getenv("OPENBLAS_CORETYPE") != nullptr) {
    return s + " (OPENBLAS_CORETYPE)";
  }
  return s + " (OpenBLAS's own pick)";
}

}  // namespace mini_decoder
