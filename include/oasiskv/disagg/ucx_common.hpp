// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Thin owning wrappers over the UCX objects both sides use: a context with RMA, a worker,
//! a memory registration with its packed rkey. Errors become `oasiskv::error`.
#pragma once

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "oasiskv/core/error.hpp"

#if defined(__SANITIZE_THREAD__)
#define OASISKV_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define OASISKV_TSAN 1
#endif
#endif
#if defined(OASISKV_TSAN)
extern "C" void AnnotateIgnoreReadsBegin(const char* file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char* file, int line);
#endif

namespace oasiskv::disagg {

namespace detail {

//! @brief While alive, ThreadSanitizer ignores this thread's reads. The exporter's progress
//! thread holds one around `ucp_worker_progress`: over tcp and shared memory UCX serves remote
//! gets there with plain copies of the arena and the generation words, ordered by the protocol
//! (a block is published before its request is opened; a generation is bumped before its slot
//! is reused, and a reader that races with the bump finds it), not by memory synchronisation
//! that ThreadSanitizer can see in an uninstrumented library. Nothing without ThreadSanitizer.
struct ignore_reads_for_tsan {
#if defined(OASISKV_TSAN)
  ignore_reads_for_tsan() noexcept {
    AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
  }
  ~ignore_reads_for_tsan() {
    AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
  }
#else
  ignore_reads_for_tsan() noexcept {}  // user-provided: a guard object, not an unused variable
  ~ignore_reads_for_tsan() {}
#endif
  ignore_reads_for_tsan(const ignore_reads_for_tsan&) = delete;
  ignore_reads_for_tsan& operator=(const ignore_reads_for_tsan&) = delete;
};
inline void ucx_check(ucs_status_t s, const char* what) {
  if (s != UCS_OK) [[unlikely]] {
    oasiskv::detail::raise(errc::transfer_failed, "UCX ", what, " failed: ", ucs_status_string(s));
  }
}
}  // namespace detail

//! @brief A UCP context with the RMA feature, and with the wake-up feature when `wakeup` (a
//! worker of it can then sleep on its event descriptor, `ucx_worker::event_fd`). Move-only.
class ucx_context {
 public:
  explicit ucx_context(bool wakeup = false) {
    ucp_config_t* config = nullptr;
    detail::ucx_check(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA | (wakeup ? UCP_FEATURE_WAKEUP : 0);
    const ucs_status_t s = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    detail::ucx_check(s, "ucp_init");
  }
  ucx_context(ucx_context&& o) noexcept : context_(std::exchange(o.context_, nullptr)) {}
  ucx_context& operator=(ucx_context&&) = delete;
  ~ucx_context() {
    if (context_ != nullptr) {
      ucp_cleanup(context_);
    }
  }
  ucp_context_h get() const noexcept { return context_; }

 private:
  ucp_context_h context_ = nullptr;
};

//! @brief A UCP worker. The caller serialises every call on it (one mutex per worker), so it is
//! created in serialized mode: no UCX-internal locking on the hot path.
class ucx_worker {
 public:
  explicit ucx_worker(const ucx_context& ctx) {
    ucp_worker_params_t params{};
    params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    params.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    detail::ucx_check(ucp_worker_create(ctx.get(), &params, &worker_), "ucp_worker_create");
  }
  ucx_worker(const ucx_worker&) = delete;
  ucx_worker& operator=(const ucx_worker&) = delete;
  ~ucx_worker() {
    if (worker_ != nullptr) {
      ucp_worker_destroy(worker_);
    }
  }
  ucp_worker_h get() const noexcept { return worker_; }

  //! @brief The descriptor that becomes readable when a worker armed by `ucp_worker_arm` has
  //! events (its context needs the wake-up feature). Owned by the worker.
  int event_fd() const {
    int fd = -1;
    detail::ucx_check(ucp_worker_get_efd(worker_, &fd), "ucp_worker_get_efd");
    return fd;
  }

  //! @brief The worker's address, which a peer needs to create an endpoint to it.
  std::vector<std::byte> address() const {
    ucp_address_t* addr = nullptr;
    std::size_t len = 0;
    detail::ucx_check(ucp_worker_get_address(worker_, &addr, &len), "ucp_worker_get_address");
    std::vector<std::byte> out(reinterpret_cast<const std::byte*>(addr),
                               reinterpret_cast<const std::byte*>(addr) + len);
    ucp_worker_release_address(worker_, addr);
    return out;
  }

 private:
  ucp_worker_h worker_ = nullptr;
};

//! @brief A registration of `[base, base + length)` with a context, and its packed rkey. On TCP
//! and shared memory an rkey protects nothing (see docs/disagg.md): register only what may be
//! read.
class ucx_registration {
 public:
  ucx_registration(const ucx_context& ctx, void* base, std::size_t length)
      : context_(ctx.get()), base_(base), length_(length) {
    ucp_mem_map_params_t p{};
    p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    p.address = base;
    p.length = length;
    detail::ucx_check(ucp_mem_map(context_, &p, &memh_), "ucp_mem_map");
    void* packed = nullptr;
    std::size_t n = 0;
    const ucs_status_t s = ucp_rkey_pack(context_, memh_, &packed, &n);
    if (s != UCS_OK) {
      ucp_mem_unmap(context_, memh_);
      detail::ucx_check(s, "ucp_rkey_pack");
    }
    rkey_.assign(static_cast<const std::byte*>(packed), static_cast<const std::byte*>(packed) + n);
    ucp_rkey_buffer_release(packed);
  }
  ucx_registration(const ucx_registration&) = delete;
  ucx_registration& operator=(const ucx_registration&) = delete;
  ~ucx_registration() { ucp_mem_unmap(context_, memh_); }

  std::uint64_t base() const noexcept { return reinterpret_cast<std::uint64_t>(base_); }
  std::size_t length() const noexcept { return length_; }
  const std::vector<std::byte>& rkey() const noexcept { return rkey_; }

 private:
  ucp_context_h context_;
  void* base_;
  std::size_t length_;
  ucp_mem_h memh_ = nullptr;
  std::vector<std::byte> rkey_;
};

}  // namespace oasiskv::disagg
