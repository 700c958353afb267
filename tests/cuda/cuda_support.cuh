//! Shared by the CUDA tests: skip cleanly where no device can run them.
#pragma once

#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>

namespace oasiskv::testing {

//! Exits the test binary with 77 (ctest: skipped) when there is no driver or no device; any
//! other CUDA failure is a real failure.
inline void require_cuda_device_or_skip() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice ||
      (e == cudaSuccess && count == 0)) {
    std::printf("no CUDA device (%s): skipped\n", cudaGetErrorName(e));
    std::exit(77);
  }
  if (e != cudaSuccess) {
    std::printf("cudaGetDeviceCount failed: %s\n", cudaGetErrorString(e));
    std::exit(1);
  }
}

#define OASISKV_CUDA_CHECK(expr)                                                                 \
  do {                                                                                           \
    const cudaError_t oasiskv_err_ = (expr);                                                     \
    REQUIRE_MESSAGE(oasiskv_err_ == cudaSuccess, #expr, ": ", cudaGetErrorString(oasiskv_err_)); \
  } while (0)

}  // namespace oasiskv::testing
