// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The io_uring backend of `file_tier`: one ring keeps up to its queue depth of block
//! transfers in flight from a single thread. Compiled only with `OASISKV_WITH_LIBURING` (the
//! `oasiskv::file` target); without it this header declares nothing. Not part of the public API.
#pragma once

#if defined(OASISKV_WITH_LIBURING)

#include <liburing.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "oasiskv/tier/detail/file_io.hpp"

namespace oasiskv::detail {

//! @brief A ring and the bounce buffers of its in-flight requests. Not thread-safe: a ring's
//! submission and completion queues have a single owner, so `file_tier` lends each ring to one
//! caller at a time.
class uring_ring {
 public:
  //! Returns null and sets `err` (a positive errno) when the kernel refuses a ring: containers
  //! often do (seccomp: EPERM or ENOSYS; kernel.io_uring_disabled: EPERM).
  static std::unique_ptr<uring_ring> create(std::uint32_t depth, int& err) {
    std::unique_ptr<uring_ring> r(new uring_ring(depth));
    const int rc = ::io_uring_queue_init(depth, &r->ring_, 0);
    if (rc < 0) {
      err = -rc;
      return nullptr;
    }
    r->live_ = true;
    return r;
  }
  uring_ring(const uring_ring&) = delete;
  uring_ring& operator=(const uring_ring&) = delete;
  ~uring_ring() {
    if (live_) {
      ::io_uring_queue_exit(&ring_);
    }
  }

  //! Runs every request with up to `depth` in flight and returns when all have completed. After
  //! a failure no new request is started, the ones in flight are reaped (their buffers must not
  //! be released while the kernel may still use them) and the first failure is rethrown.
  //! Returns false if the ring itself broke: it must then not be reused.
  template <class Req>
  bool run(const file_geometry& g, std::span<const Req> reqs) {
    constexpr io_dir d = direction_of<Req>;
    std::size_t next = 0;
    std::uint32_t in_flight = 0;
    std::exception_ptr failure;
    free_tags_.clear();
    for (std::uint32_t t = depth_; t-- > 0;) {
      free_tags_.push_back(t);
    }
    while (next < reqs.size() || in_flight > 0) {
      // Fill the window; every tag owns one SQE at a time, so the SQ (>= depth) cannot overflow.
      while (!failure && next < reqs.size() && !free_tags_.empty()) {
        const std::uint32_t tag = free_tags_.back();
        entry& st = entries_[tag];
        st.user = request_buffer(reqs[next]);
        st.slot = reqs[next].slot;
        try {
          std::byte* bounce = g.needs_bounce(st.user) ? bounce_[tag].ensure(g.stride) : nullptr;
          st.target = prepare(g, d, st.user, bounce);
        } catch (...) {
          failure = std::current_exception();
          break;
        }
        st.done = 0;
        free_tags_.pop_back();
        queue(g, d, tag);
        ++next;
        ++in_flight;
      }
      if (in_flight == 0) {
        break;  // a failure before anything was started
      }
      const int rc = ::io_uring_submit_and_wait(&ring_, 1);
      if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) [[unlikely]] {
        // The ring is unusable and what it holds in flight unknown; exiting it (in the caller,
        // by discarding the ring) cancels and waits for the kernel's side.
        failure_message(rc);
        return false;
      }
      io_uring_cqe* cqe = nullptr;
      while (::io_uring_peek_cqe(&ring_, &cqe) == 0) {
        const auto tag = static_cast<std::uint32_t>(
            reinterpret_cast<std::uintptr_t>(::io_uring_cqe_get_data(cqe)));
        const int res = cqe->res;
        ::io_uring_cqe_seen(&ring_, cqe);
        entry& st = entries_[tag];
        bool complete = true;
        try {
          if (res < 0) {
            raise_io(d, st.slot, g.offset(st.slot), st.target.len, -res);
          }
          if (res == 0) {
            raise_short(d, st.slot, g.offset(st.slot), st.done, st.target.len);
          }
          st.done += static_cast<std::size_t>(res);
          if (st.done < st.target.len) {
            if (!failure) {  // a short transfer: go on from where it stopped
              queue(g, d, tag);
              complete = false;
            }
          } else {
            finish(g, d, st.user, st.target);
          }
        } catch (...) {
          if (!failure) {
            failure = std::current_exception();
          }
        }
        if (complete) {
          free_tags_.push_back(tag);
          --in_flight;
        }
      }
    }
    if (failure) {
      std::rethrow_exception(failure);
    }
    return true;
  }

  //! The message of the last `run` that returned false.
  const std::string& broken_reason() const noexcept { return broken_; }

 private:
  struct entry {
    std::byte* user = nullptr;
    slot_id slot = 0;
    io_target target{};
    std::size_t done = 0;
  };

  explicit uring_ring(std::uint32_t depth) : depth_(depth), entries_(depth), bounce_(depth) {
    free_tags_.reserve(depth);
  }

  void queue(const file_geometry& g, io_dir d, std::uint32_t tag) {
    const entry& st = entries_[tag];
    io_uring_sqe* sqe = ::io_uring_get_sqe(&ring_);
    const auto len = static_cast<unsigned>(st.target.len - st.done);
    const std::uint64_t off = g.offset(st.slot) + st.done;
    if (d == io_dir::read) {
      ::io_uring_prep_read(sqe, g.fd, st.target.buf + st.done, len, off);
    } else {
      ::io_uring_prep_write(sqe, g.fd, st.target.buf + st.done, len, off);
    }
    ::io_uring_sqe_set_data(sqe, reinterpret_cast<void*>(static_cast<std::uintptr_t>(tag)));
  }

  void failure_message(int rc) {
    broken_ = std::string("io_uring_submit_and_wait failed: ") + std::strerror(-rc);
  }

  io_uring ring_{};
  bool live_ = false;
  std::uint32_t depth_;
  std::vector<entry> entries_;          // [depth]: the request each tag carries
  std::vector<aligned_buffer> bounce_;  // [depth]: allocated on first need, then reused
  std::vector<std::uint32_t> free_tags_;
  std::string broken_;
};

}  // namespace oasiskv::detail

#endif  // OASISKV_WITH_LIBURING
