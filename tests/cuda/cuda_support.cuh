// SPDX-License-Identifier: Apache-2.0
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

#include <cstddef>
#include <random>
#include <vector>

namespace oasiskv::testing {

//! A device array that frees itself; copies to and from host vectors.
template <class T>
class device_buffer {
 public:
  device_buffer() = default;
  explicit device_buffer(std::size_t n) : n_(n) {
    void* p = nullptr;
    OASISKV_CUDA_CHECK(cudaMalloc(&p, n == 0 ? 1 : n * sizeof(T)));
    p_ = static_cast<T*>(p);
  }
  explicit device_buffer(const std::vector<T>& v) : device_buffer(v.size()) { upload(v); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  device_buffer(device_buffer&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr; }
  device_buffer& operator=(device_buffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~device_buffer() { (void)cudaFree(p_); }
  T* get() const noexcept { return p_; }
  std::size_t size() const noexcept { return n_; }
  void upload(const std::vector<T>& v) {
    REQUIRE(v.size() <= n_);
    OASISKV_CUDA_CHECK(cudaMemcpy(p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> v(n_);
    OASISKV_CUDA_CHECK(cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

//! Fills `n` floats with fresh uniform values in [lo, hi) (never zeros everywhere: METHOD.md).
inline std::vector<float> random_floats(std::size_t n, std::mt19937& rng, float lo = -1.0f,
                                        float hi = 1.0f) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) {
    x = u(rng);
  }
  return v;
}

}  // namespace oasiskv::testing
