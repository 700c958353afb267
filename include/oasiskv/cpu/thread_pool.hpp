// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cpu::thread_pool`: a persistent pool that runs one parallel loop at a time, the
//! threading policy of the CPU kernels (attention, batched prediction, the engine's matmuls).
#pragma once

#include <atomic>
#include <chrono>
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
#include "oasiskv/cpu/loop_runner.hpp"

namespace oasiskv::cpu {

//! @brief `threads - 1` worker threads that stay alive between calls, plus the calling thread,
//! which always takes part. Decode calls last tens of microseconds to milliseconds, so starting
//! threads per call (tens of microseconds each) would cost as much as the work. Between loops a
//! worker first spins for a short while (`spin`, 50 microseconds by default: a decode step's
//! loops follow each other closer than that, and waking a sleeping thread costs about as much
//! as a small loop), then sleeps on a condition variable; the caller waits for the last item the
//! same way. Spinning is bounded, so a pool on a machine whose cores are busy with other work
//! loses at most that much time per loop to a descheduled thread, never a whole time slice per
//! barrier as unbounded spinning does.
//!
//! `parallel_for(n, f)` runs `f(i)` for every `i` in `[0, n)` and returns when all have
//! finished; indices are handed out one at a time from an atomic counter, so uneven items balance
//! themselves. The first exception thrown by `f` is rethrown to the caller (the remaining indices
//! still run, so no item is half-skipped silently). Calls from several threads are serialised; a
//! call from inside `f` runs inline on the calling worker instead of deadlocking.
class thread_pool final : public loop_runner {
 public:
  //! @brief A pool of `threads` threads in all (the caller included): 1 means run inline.
  //! `spin`: how long an idle thread polls for the next loop before it sleeps (0: never spin).
  explicit thread_pool(unsigned threads = 1,
                       std::chrono::nanoseconds spin = std::chrono::microseconds(50))
      : spin_(spin) {
    if (threads == 0 || threads > max_threads) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "thread_pool threads = ", threads,
                             " must be in [1, ", max_threads, "]");
    }
    if (spin.count() < 0) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "thread_pool spin = ", spin.count(),
                             " ns must not be negative");
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
      stopping_.store(true, std::memory_order_release);
    }
    wake_.notify_all();
    for (auto& w : workers_) {
      w.join();
    }
  }

  //! @brief Threads that run a loop, the caller included.
  unsigned size() const noexcept override { return static_cast<unsigned>(workers_.size()) + 1; }

  //! @brief `parallel_for` through a function pointer (`loop_runner`).
  void run(std::size_t n, void (*fn)(void* ctx, std::size_t i), void* ctx) override {
    parallel_for(n, [fn, ctx](std::size_t i) { fn(ctx, i); });
  }

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
      active_.store(static_cast<unsigned>(workers_.size()), std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    run_items(j);
    spin_until([&] { return active_.load(std::memory_order_acquire) == 0; });
    {
      std::unique_lock lock(mutex_);
      done_.wait(lock, [&] { return active_.load(std::memory_order_acquire) == 0; });
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

  // Polls `ready` until it holds or `spin_` has passed (then the caller sleeps on its condition
  // variable, which rechecks the same state under the mutex, so no wake-up is lost).
  template <class Ready>
  void spin_until(Ready&& ready) const noexcept {
    if (spin_.count() == 0 || ready()) {
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + spin_;
    for (unsigned i = 1;; ++i) {
      if (ready()) {
        return;
      }
      if (i % 64 == 0 && std::chrono::steady_clock::now() >= deadline) {
        return;
      }
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
  }

  void worker_loop() {
    std::uint64_t seen = 0;
    for (;;) {
      spin_until([&] {
        return stopping_.load(std::memory_order_acquire) ||
               generation_.load(std::memory_order_acquire) != seen;
      });
      job* j = nullptr;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] {
          return stopping_.load(std::memory_order_relaxed) ||
                 generation_.load(std::memory_order_relaxed) != seen;
        });
        if (stopping_.load(std::memory_order_relaxed)) {
          return;
        }
        seen = generation_.load(std::memory_order_relaxed);
        j = job_;
      }
      run_items(*j);
      bool last = false;
      {
        std::lock_guard lock(mutex_);
        last = active_.fetch_sub(1, std::memory_order_acq_rel) == 1;
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
  // Written under mutex_ (so a sleeper cannot miss a change), read without it while spinning.
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<unsigned> active_{0};
  std::atomic<bool> stopping_{false};
  std::chrono::nanoseconds spin_;
};

}  // namespace oasiskv::cpu
