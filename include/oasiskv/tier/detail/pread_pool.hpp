// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The portable `file_tier` backend: a few threads doing pread/pwrite, so that a batch's
//! blocks are in flight together even where io_uring is unavailable. Not part of the public API.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "oasiskv/tier/detail/file_io.hpp"

namespace oasiskv::detail {

//! @brief `threads` workers serving batches of block transfers. Batches from several callers
//! share the workers in arrival order; each worker owns one bounce buffer.
class pread_pool {
 public:
  pread_pool(const file_geometry& g, std::uint32_t threads) : geo_(g) {
    workers_.reserve(threads);
    try {
      for (std::uint32_t i = 0; i < threads; ++i) {
        workers_.emplace_back([this] { work(); });
      }
    } catch (...) {
      stop();
      throw;
    }
  }
  pread_pool(const pread_pool&) = delete;
  pread_pool& operator=(const pread_pool&) = delete;
  ~pread_pool() { stop(); }

  //! Runs every request, then returns; after a failure the requests not yet started are
  //! skipped and the first failure is rethrown once all running ones have finished.
  template <class Req>
  void run(std::span<const Req> reqs) {
    job j;
    j.count = reqs.size();
    j.reqs = reqs.data();
    j.execute = [](const file_geometry& g, const void* r, std::size_t i, aligned_buffer& b) {
      const Req& q = static_cast<const Req*>(r)[i];
      transfer_sync(g, direction_of<Req>, q.slot, request_buffer(q), b);
    };
    std::unique_lock lock(mutex_);
    queue_.push_back(&j);
    lock.unlock();
    work_cv_.notify_all();
    lock.lock();
    done_cv_.wait(lock, [&] { return j.finished == j.count; });
    if (j.failure) {
      std::rethrow_exception(j.failure);
    }
  }

 private:
  struct job {
    const void* reqs = nullptr;
    std::size_t count = 0;
    void (*execute)(const file_geometry&, const void*, std::size_t, aligned_buffer&) = nullptr;
    // Guarded by the pool's mutex. A worker claims an index under the lock, so the job (on the
    // caller's stack) outlives every worker that touches it: the caller returns only after the
    // last claimed index has been counted finished.
    std::size_t next = 0;
    std::size_t finished = 0;
    std::exception_ptr failure;
  };

  void work() {
    aligned_buffer bounce;
    std::unique_lock lock(mutex_);
    for (;;) {
      work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) {
        return;
      }
      job* j = queue_.front();
      const std::size_t i = j->next++;
      if (j->next == j->count) {
        queue_.pop_front();
      }
      const bool skip = static_cast<bool>(j->failure);
      lock.unlock();
      std::exception_ptr failure;
      if (!skip) {
        try {
          j->execute(geo_, j->reqs, i, bounce);
        } catch (...) {
          failure = std::current_exception();
        }
      }
      lock.lock();
      if (failure && !j->failure) {
        j->failure = failure;
      }
      if (++j->finished == j->count) {
        done_cv_.notify_all();
      }
    }
  }

  void stop() noexcept {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    work_cv_.notify_all();
    for (std::thread& t : workers_) {
      t.join();
    }
    workers_.clear();
  }

  file_geometry geo_;
  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<job*> queue_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;  // last: they start once the members they use exist
};

}  // namespace oasiskv::detail
