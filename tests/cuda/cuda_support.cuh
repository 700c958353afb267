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

// Setup and readback that are complete when they return. cudaMemset is asynchronous and a
// pageable cudaMemcpy to the device may return before its DMA lands, both on the legacy default
// stream, which a cudaStreamNonBlocking stream does not wait for: a kernel launched there next
// could run before them. These wait for the whole device instead.

namespace detail {
// Keeps its stream busy for `ns` nanoseconds of the global timer.
__global__ void spin_kernel(unsigned long long ns) {
  unsigned long long t0 = 0, t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}
}  // namespace detail

//! Queues `ns` nanoseconds of work on the legacy default stream and returns at once: what is
//! queued there next runs only after it, which makes a missing wait between streams fail the
//! test that uses it instead of passing by luck.
inline void busy_legacy_stream(unsigned long long ns) {
  detail::spin_kernel<<<1, 1>>>(ns);
  OASISKV_CUDA_CHECK(cudaGetLastError());
}

//! cudaMemset, finished before returning.
inline void fill_device(void* p, int byte, std::size_t bytes) {
  OASISKV_CUDA_CHECK(cudaMemset(p, byte, bytes));
  OASISKV_CUDA_CHECK(cudaDeviceSynchronize());
}
//! cudaMemcpy to device memory, finished before returning.
inline void copy_to_device(void* dst, const void* src, std::size_t bytes) {
  OASISKV_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  OASISKV_CUDA_CHECK(cudaDeviceSynchronize());
}
//! cudaMemcpy from device memory after every stream's work (the legacy stream's cudaMemcpy does
//! not wait for non-blocking streams).
inline void copy_to_host(void* dst, const void* src, std::size_t bytes) {
  OASISKV_CUDA_CHECK(cudaDeviceSynchronize());
  OASISKV_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

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
  //! Copies `v` in, finished before returning (`copy_to_device`).
  void upload(const std::vector<T>& v) {
    REQUIRE(v.size() <= n_);
    copy_to_device(p_, v.data(), v.size() * sizeof(T));
  }
  //! Copies everything out after all work on every stream (`copy_to_host`).
  std::vector<T> download() const {
    std::vector<T> v(n_);
    copy_to_host(v.data(), p_, n_ * sizeof(T));
    return v;
  }
  //! Sets every byte to `byte`, finished before returning (`fill_device`).
  void fill(int byte) { fill_device(p_, byte, n_ * sizeof(T)); }

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
