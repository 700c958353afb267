// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief CUDA runtime helpers shared by the CUDA models: error translation into
//! `oasiskv::error`, device selection, and the pointer checks that guard every kernel boundary.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "oasiskv/core/error.hpp"

namespace oasiskv::cuda::detail {

//! @brief The `errc` a CUDA error maps to; `fallback` for errors with no closer meaning.
inline errc code_of(cudaError_t e, errc fallback) noexcept {
  switch (e) {
    case cudaErrorMemoryAllocation:
      return errc::out_of_memory;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorNotSupported:
    case cudaErrorStreamCaptureUnsupported:
    case cudaErrorStreamCaptureImplicit:
      return errc::unsupported;
    default:
      return fallback;
  }
}

//! @brief Throws `oasiskv::error` naming `what` and the CUDA error when `e` is not success.
//! Clears the runtime's last-error slot first, so that a non-sticky error does not resurface in
//! an unrelated later check.
inline void check(cudaError_t e, const char* what, errc fallback = errc::transfer_failed) {
  if (e != cudaSuccess) [[unlikely]] {
    (void)cudaGetLastError();
    oasiskv::detail::raise(code_of(e, fallback), what, " failed: ", cudaGetErrorName(e), " (",
                           cudaGetErrorString(e), ")");
  }
}

//! @brief The calling thread's current device.
inline int current_device() {
  int d = 0;
  check(cudaGetDevice(&d), "cudaGetDevice", errc::unsupported);
  return d;
}

//! @brief Makes `device` current for a scope and restores the previous one (no-op for -1).
class device_guard {
 public:
  explicit device_guard(int device) {
    if (device >= 0) {
      check(cudaGetDevice(&previous_), "cudaGetDevice", errc::unsupported);
      if (previous_ != device) {
        check(cudaSetDevice(device), "cudaSetDevice", errc::invalid_argument);
      } else {
        previous_ = -1;
      }
    }
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  ~device_guard() {
    if (previous_ >= 0) {
      (void)cudaSetDevice(previous_);
    }
  }

 private:
  int previous_ = -1;
};

//! @brief Where a pointer points, as the CUDA runtime sees it.
enum class pointer_kind : std::uint8_t { unregistered_host, pinned_host, device, managed };

struct pointer_info {
  pointer_kind kind = pointer_kind::unregistered_host;
  int device = -1;  //!< the owning device (device, managed memory) or -1
  //! The address a kernel reads it at (`cudaPointerAttributes::devicePointer`): for pinned host
  //! memory, null unless it is mapped into the device's address space.
  const void* device_address = nullptr;
};

//! @brief Asks the runtime what `p` is. Never throws for a plain host pointer.
inline pointer_info query_pointer(const void* p) {
  cudaPointerAttributes a{};
  const cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e == cudaErrorInvalidValue) {  // runtimes before 11 report unknown host memory this way
    (void)cudaGetLastError();
    return {};
  }
  check(e, "cudaPointerGetAttributes", errc::invalid_argument);
  switch (a.type) {
    case cudaMemoryTypeDevice:
      return {pointer_kind::device, a.device, a.devicePointer};
    case cudaMemoryTypeManaged:
      return {pointer_kind::managed, a.device, a.devicePointer};
    case cudaMemoryTypeHost:
      return {pointer_kind::pinned_host, a.device, a.devicePointer};
    default:
      return {};
  }
}

inline const char* to_string(pointer_kind k) noexcept {
  switch (k) {
    case pointer_kind::unregistered_host:
      return "pageable host memory";
    case pointer_kind::pinned_host:
      return "pinned host memory";
    case pointer_kind::device:
      return "device memory";
    case pointer_kind::managed:
      return "managed memory";
  }
  return "unknown memory";
}

//! @brief Throws unless `p` is device (or managed) memory that `device` can read directly.
//! `what` names the argument in the message, e.g. "decode_params.q".
inline void require_device_pointer(const void* p, int device, const char* what) {
  if (p == nullptr) [[unlikely]] {
    oasiskv::detail::raise(errc::invalid_argument, what, " is null");
  }
  const pointer_info info = query_pointer(p);
  if (info.kind != pointer_kind::device && info.kind != pointer_kind::managed) [[unlikely]] {
    oasiskv::detail::raise(errc::invalid_argument, what, " = ", p, " is ", to_string(info.kind),
                           ": it must be device memory of device ", device);
  }
  if (info.kind == pointer_kind::device && info.device != device) [[unlikely]] {
    oasiskv::detail::raise(errc::invalid_argument, what, " = ", p, " is memory of device ",
                           info.device, " but the kernel runs on device ", device);
  }
}

//! @brief Whether `stream` is being captured into a CUDA graph, and whether that capture was
//! invalidated.
inline cudaStreamCaptureStatus capture_status(cudaStream_t stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(stream, &st), "cudaStreamIsCapturing", errc::invalid_argument);
  return st;
}

//! @brief Whether `stream` is being captured into a CUDA graph (then nothing may synchronise,
//! allocate or read results back).
inline bool is_capturing(cudaStream_t stream) {
  return capture_status(stream) != cudaStreamCaptureStatusNone;
}

//! @brief Multiprocessors of `device` (cached per call site by the callers).
inline int multiprocessor_count(int device) {
  int n = 0;
  check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute(MultiProcessorCount)", errc::unsupported);
  return n;
}

}  // namespace oasiskv::cuda::detail

//! @brief Evaluates a CUDA runtime call and throws `oasiskv::error` if it fails.
#define OASISKV_CUDA_TRY(expr) ::oasiskv::cuda::detail::check((expr), #expr)
