// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cpu::thread_pool`: a persistent pool that runs one parallel loop at a time, the
//! threading policy of the CPU attention kernels.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include "oasiskv/core/error.hpp"

namespace oasiskv::cpu {

//! @brief `threads - 1` worker threads that stay alive between calls, plus the calling thread,
//! which always takes part. Decode calls last tens of microseconds to milliseconds, so starting
//! threads per call (tens of microseconds each) would cost as much as the work; the workers
//! instead sleep on a condition variable between loops.
//!
//! `parallel_for(n, f)` runs `f(i)` for every `i` in `[0, n)` and returns when all have
//! finished; indices are handed out one at a time from an atomic counter, so uneven items balance
//! themselves. The first exception thrown by `f` is rethrown to the caller (the remaining indices
//! still run, so no item is half-skipped silently). Calls from several threads are serialised; a
//! call from inside `f` runs inline on the calling worker instead of deadlocking.
class thread_pool {
 public:
  //! @brief A pool of `threads` threads in all (the caller included): 1 means run inline.
  explicit thread_pool(unsigned threads = 1) {
    if (threads == 0 || threads > max_threads) [[unlikely]] {
      detail::raise(errc::invalid_argument, "thread_pool threads = ", threads, " must be in [1, ",
                    max_threads, "]");
    }
    workers_.reserve(threads - 1);
    for (unsigned i = 1; i < threads; ++i) {
      workers_.emplace_back([this] { worker_loop(); });
    }
  }
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  ~thread_pool() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) {
      w.join();
    }
  }

  //! @brief Threads that run a loop, the caller included.
  unsigned size() const noexcept { return static_cast<unsigned>(workers_.size()) + 1; }

  static constexpr unsigned max_threads = 1024;

  //! @brief Runs `f(i)` for `i` in `[0, n)` on the pool's threads; blocks until all are done.
  template <class F>
  void parallel_for(std::size_t n, F&& f) {
    if (n == 0) {
      return;
    }
    using fn_type = std::remove_reference_t<F>;
    job j;
    j.ctx = const_cast<void*>(static_cast<const void*>(std::addressof(f)));
    j.call = [](void* ctx, std::size_t i) {
      (*static_cast<fn_type*>(ctx))(i);
    };
    j.n = n;
    if (workers_.empty() || n == 1 || current_pool() == this) {
      run_items(j);  // inline: same semantics (every index runs, first exception rethrown)
      if (j.failure) {
        std::rethrow_exception(j.failure);
      }
      return;
    }
    std::lock_guard serial(call_mutex_);
    {
      std::lock_guard lock(mutex_);
      job_ = &j;
      active_ = static_cast<unsigned>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    run_items(j);
    {
      std::unique_lock lock(mutex_);
      done_.wait(lock, [&] { return active_ == 0; });
      job_ = nullptr;
    }
    if (j.failure) {
      std::rethrow_exception(j.failure);
    }
  }

 private:
  struct job {
    void* ctx = nullptr;
    void (*call)(void*, std::size_t) = nullptr;
    std::size_t n = 0;
    std::atomic<std::size_t> next{0};
    std::mutex failure_mutex;
    std::exception_ptr failure;
  };

  // Lets a nested parallel_for (from inside an item) run inline rather than wait on itself.
  static const thread_pool*& current_pool() noexcept {
    thread_local const thread_pool* pool = nullptr;
    return pool;
  }

  void run_items(job& j) noexcept {
    const thread_pool* outer = current_pool();
    current_pool() = this;
    for (std::size_t i = j.next.fetch_add(1, std::memory_order_relaxed); i < j.n;
         i = j.next.fetch_add(1, std::memory_order_relaxed)) {
      try {
        j.call(j.ctx, i);
      } catch (...) {
        std::lock_guard lock(j.failure_mutex);
        if (!j.failure) {
          j.failure = std::current_exception();
        }
      }
    }
    current_pool() = outer;
  }

  void worker_loop() {
    std::uint64_t seen = 0;
    for (;;) {
      job* j = nullptr;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        if (stopping_) {
          return;
        }
        seen = generation_;
        j = job_;
      }
      run_items(*j);
      bool last = false;
      {
        std::lock_guard lock(mutex_);
        last = --active_ == 0;
      }
      if (last) {
        done_.notify_one();
      }
    }
  }

  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  // one loop at a time
  std::mutex mutex_;       // guards the fields below
  std::condition_variable wake_;
  std::condition_variable done_;
  job* job_ = nullptr;
  std::uint64_t generation_ = 0;
  unsigned active_ = 0;
  bool stopping_ = false;
};

}  // namespace oasiskv::cpu
