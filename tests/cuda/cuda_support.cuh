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

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "oasiskv/core/decode_params.hpp"
#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/error.hpp"

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

//! Fills `n` floats with fresh uniform values in [lo, hi) (never all zeros, which would hide a
//! missing write).
inline std::vector<float> random_floats(std::size_t n, std::mt19937& rng, float lo = -1.0f,
                                        float hi = 1.0f) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) {
    x = u(rng);
  }
  return v;
}

//! Fills `elems` values of type `t` at `at` (host memory) with `random_floats(elems, rng, lo, hi)`.
inline void fill_random(std::byte* at, oasiskv::dtype t, std::size_t elems, std::mt19937& rng,
                        float lo, float hi) {
  const auto v = random_floats(elems, rng, lo, hi);
  oasiskv::visit_dtype(t, [&](auto e) {
    using T = decltype(e);
    auto* p = reinterpret_cast<T*>(at);
    for (std::size_t i = 0; i < elems; ++i) {
      p[i] = oasiskv::from_float<T>(v[i]);
    }
  });
}

//! 0, 1, ..., n - 1: every entry (or slot) id of a summary (or tier) of `n`.
inline std::vector<std::uint32_t> iota(std::uint32_t n) {
  std::vector<std::uint32_t> v(n);
  for (std::uint32_t e = 0; e < n; ++e) {
    v[e] = e;
  }
  return v;
}

//! The code of the `oasiskv::error` that `f()` throws (its message into `*what` if given);
//! `errc{}` when it throws none.
template <class F>
oasiskv::errc error_code_of(F&& f, std::string* what = nullptr) {
  try {
    f();
  } catch (const oasiskv::error& e) {
    if (what != nullptr) {
      *what = e.what();
    }
    return e.code();
  }
  return oasiskv::errc{};
}

//! A cudaStreamNonBlocking stream (converts to `cudaStream_t`), destroyed unchecked at scope
//! end unless `destroy()` destroyed it, checked, before.
class stream_guard {
 public:
  stream_guard() { OASISKV_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  stream_guard(const stream_guard&) = delete;
  stream_guard& operator=(const stream_guard&) = delete;
  ~stream_guard() {
    if (s != nullptr) {
      (void)cudaStreamDestroy(s);
    }
  }
  operator cudaStream_t() const noexcept { return s; }
  //! cudaStreamDestroy, checked (it also reports an earlier asynchronous error).
  void destroy() { OASISKV_CUDA_CHECK(cudaStreamDestroy(std::exchange(s, nullptr))); }

  cudaStream_t s = nullptr;
};

//! Finishes a host decode batch `h` whose refs name slots 0, 1, ... in order: the slots
//! shuffled across the pool, the pool random in [-2, 2) (`fill_random`), the queries random.
template <class Problem>
void scatter_and_fill_decode_batch(Problem& h, std::mt19937& rng) {
  std::vector<std::uint32_t> perm = iota(h.slots);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (oasiskv::block_ref& r : h.refs) {
    r.slot = perm[r.slot];
  }
  const oasiskv::kv_layout& l = h.layout;
  h.pool.resize(std::size_t{h.slots} * l.block_bytes());
  fill_random(h.pool.data(), l.kv_dtype, h.pool.size() / l.elem_bytes(), rng, -2.0f, 2.0f);
  h.q = random_floats(std::size_t{h.num_seqs} * h.q_len * l.num_q_heads * l.head_dim, rng);
}

//! The `decode_params` of a host decode batch `h` (fields layout, num_seqs, q_len, pool, slots,
//! q, refs, offsets, lens) with `tables_per_seq` tables a sequence, writing `out` and `lse`.
template <class Problem>
oasiskv::decode_params host_decode_params(const Problem& h, std::uint32_t tables_per_seq,
                                          float* out, float* lse) {
  oasiskv::decode_params p;
  p.q = h.q.data();
  p.pool = {const_cast<std::byte*>(h.pool.data()), h.layout.block_bytes(), h.slots, h.layout};
  p.table = {h.refs.data(), h.offsets.data(), h.num_seqs, tables_per_seq};
  p.seq_lens = h.lens.data();
  p.out = out;
  p.lse = lse;
  p.num_seqs = h.num_seqs;
  p.q_len = h.q_len;
  p.scale = 1.0f / std::sqrt(static_cast<float>(h.layout.head_dim));
  return p;
}

//! The device copy of a host decode batch `h` (as `host_decode_params` reads it): its inputs
//! uploaded, `p` pointing at them, the outputs poisoned.
template <class Problem>
struct device_decode_problem {
  device_buffer<std::byte> pool;
  device_buffer<float> q, out, lse;
  device_buffer<oasiskv::block_ref> refs;
  device_buffer<std::uint32_t> offsets, lens;
  oasiskv::decode_params p;

  explicit device_decode_problem(const Problem& h)
      : pool(h.pool),
        q(h.q),
        out(h.q.size()),
        lse(h.q.size() / h.layout.head_dim),
        refs(h.refs),
        offsets(h.offsets),
        lens(h.lens) {
    p = h.host_params(out.get(), lse.get());
    p.q = q.get();
    p.pool.base = pool.get();
    p.table.refs = refs.get();
    p.table.offsets = offsets.get();
    p.seq_lens = lens.get();
    poison();
  }
  //! Every element must be written: NaN (all bits set) where one is not.
  void poison() {
    fill_device(out.get(), 0xff, out.size() * sizeof(float));
    fill_device(lse.get(), 0xff, lse.size() * sizeof(float));
  }
};

}  // namespace oasiskv::testing
