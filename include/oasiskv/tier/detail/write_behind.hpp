// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The write-behind queue of `file_tier`: writes return once their block is copied, a
//! writer thread hands them to the device in batches, and reads of a slot whose newest content
//! is not on the device yet are served from that copy. Not part of the public API.
#pragma once

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "oasiskv/concepts/tier_backend.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/tier/detail/file_io.hpp"

namespace oasiskv::detail {

//! @brief Pending writes of one file. The newest content of a slot lives in exactly one place:
//! a queued copy (not started), else an in-flight copy (being written), else a copy whose write
//! failed (kept until a later write or `flush` puts the slot on the device), else the file.
class write_behind {
 public:
  //! Writes a batch to the device synchronously; throws on the first failure.
  using device_writer = std::function<void(std::span<const block_write>)>;

  //! `background`: the writer runs at SCHED_IDLE, on cores no other thread wants. `linger`: once
  //! woken, the writer gathers writes for this long before each batch, and stays awake while
  //! they keep coming; only a writer asleep for lack of writes is woken by `enqueue` (or one
  //! whose queue is half full), so a decoder writing a block per layer does not pay a wake-up
  //! per write. Zero: each batch starts at once.
  write_behind(std::size_t block_bytes, std::size_t stride, std::uint32_t capacity,
               device_writer write, bool background,
               std::chrono::microseconds linger = std::chrono::microseconds{0})
      : block_bytes_(block_bytes),
        stride_(stride),
        capacity_(capacity),
        linger_(linger),
        write_(std::move(write)) {
    writer_ = std::thread([this] { run(); });
    if (background) {
      // Best effort: where the system refuses, the writer keeps the normal class.
      sched_param p{};
      background_ = ::pthread_setschedparam(writer_.native_handle(), SCHED_IDLE, &p) == 0;
    }
  }

  write_behind(const write_behind&) = delete;
  write_behind& operator=(const write_behind&) = delete;

  //! Writes everything still pending and stops (see `close`).
  ~write_behind() { (void)close(); }

  //! Writes everything still pending, stops the writer, and retries once each write the device
  //! refused. Returns how many slots still could not be written: their newest content is lost
  //! with this object, which the owner must record (`file_tier` marks its file). Idempotent.
  std::size_t close() noexcept {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    work_cv_.notify_all();
    if (writer_.joinable()) {
      writer_.join();
    }
    std::lock_guard lock(mutex_);
    for (auto it = failed_.begin(); it != failed_.end();) {
      const block_write w{it->first, it->second.held->data.ensure(stride_)};
      it = attempt(w).empty() ? failed_.erase(it) : std::next(it);
    }
    return failed_.size();
  }

  //! Copies each block and queues it; returns once copied. A slot already queued and not yet
  //! started has its copy replaced (the device sees the newest content only). Waits while
  //! `capacity` copies are pending. Where earlier writes of other slots failed, retries them
  //! first and, if one still fails, throws `errc::io_error` naming it, queuing nothing: a device
  //! error surfaces at the next write, not only at `flush`.
  void enqueue(std::span<const block_write> writes) {
    std::unique_lock lock(mutex_);
    retry_failed(writes);
    for (const block_write& w : writes) {
      if (auto it = queued_.find(w.slot); it != queued_.end()) {
        std::memcpy(it->second->data.ensure(stride_), w.in, block_bytes_);
        continue;
      }
      if (pending_ >= capacity_) {
        work_cv_.notify_one();  // the writer may be asleep with the queue full
        done_cv_.wait(lock, [&] { return pending_ < capacity_; });
      }
      std::unique_ptr<copy> c = take_copy();
      std::byte* p = c->data.ensure(stride_);
      std::memcpy(p, w.in, block_bytes_);
      std::memset(p + block_bytes_, 0, stride_ - block_bytes_);
      c->slot = w.slot;
      failed_.erase(w.slot);  // superseded: the new content is what the slot must hold
      queued_.emplace(w.slot, c.get());
      queue_.push_back(std::move(c));
      ++pending_;
    }
    // A lingering writer takes the queue at its next deadline, unless it is filling up.
    const bool wake = idle_ || 2 * pending_ >= capacity_;
    lock.unlock();
    if (wake) {
      work_cv_.notify_one();
    }
  }

  //! Serves the reads of slots whose newest content is held here; appends the others, which the
  //! device holds, to `rest`.
  void serve(std::span<const block_read> reads, std::vector<block_read>& rest) const {
    std::lock_guard lock(mutex_);
    for (const block_read& r : reads) {
      if (const std::byte* p = newest(r.slot)) {
        std::memcpy(r.out, p, block_bytes_);
      } else {
        rest.push_back(r);
      }
    }
  }

  //! Waits until every queued write has reached the device; retries the writes that failed,
  //! once each; throws `errc::io_error` naming the slots still failing (their content stays
  //! here, and reads keep returning it).
  void flush() {
    std::unique_lock lock(mutex_);
    ++urgent_;  // a lingering writer starts the batch now
    work_cv_.notify_one();
    done_cv_.wait(lock, [&] { return queue_.empty() && in_flight_.empty(); });
    --urgent_;
    if (failed_.empty()) {
      return;
    }
    std::string message;
    std::size_t still = 0;
    for (auto it = failed_.begin(); it != failed_.end();) {
      const block_write w{it->first, it->second.held->data.ensure(stride_)};
      std::string reason = attempt(w);
      if (reason.empty()) {
        it = failed_.erase(it);
        continue;
      }
      it->second.reason = std::move(reason);
      if (still++ == 0) {
        message = it->second.reason;
      }
      ++it;
    }
    if (still > 0) {
      raise(errc::io_error, "file_tier::flush: ", still,
            " block(s) could not be written and are held in memory; the first: ", message);
    }
  }

  //! Whether the writer runs at SCHED_IDLE.
  bool background() const noexcept { return background_; }
  //! Copies queued or being written.
  std::size_t pending() const {
    std::lock_guard lock(mutex_);
    return pending_;
  }
  //! Slots whose last write failed and whose content is held here until `flush` succeeds.
  std::size_t failed() const {
    std::lock_guard lock(mutex_);
    return failed_.size();
  }

 private:
  struct copy {
    slot_id slot = 0;
    aligned_buffer data;
  };
  struct failure {
    std::unique_ptr<copy> held;
    std::string reason;
  };

  // Writes one block; returns why it failed, or nothing.
  std::string attempt(const block_write& w) const {
    try {
      write_(std::span<const block_write>(&w, 1));
      return {};
    } catch (const std::exception& e) {
      return e.what();
    } catch (...) {
      return "unknown exception";
    }
  }

  // Called with the lock held. Retries the failed writes of slots that `writes` does not
  // supersede; throws naming the first that still fails.
  void retry_failed(std::span<const block_write> writes) {
    if (failed_.empty()) {
      return;
    }
    std::size_t still = 0;
    const std::string* first = nullptr;
    slot_id first_slot = 0;
    for (auto it = failed_.begin(); it != failed_.end();) {
      const bool superseded = std::any_of(
          writes.begin(), writes.end(), [&](const block_write& w) { return w.slot == it->first; });
      if (superseded) {
        ++it;
        continue;
      }
      const block_write w{it->first, it->second.held->data.ensure(stride_)};
      if (std::string reason = attempt(w); reason.empty()) {
        it = failed_.erase(it);
        continue;
      } else {
        it->second.reason = std::move(reason);
      }
      if (still++ == 0) {
        first = &it->second.reason;
        first_slot = it->first;
      }
      ++it;
    }
    if (still > 0) {
      raise(errc::io_error, "file_tier: ", still, " earlier write(s) failed and are held in ",
            "memory (slot ", first_slot, ": ", *first, "); this write was not queued");
    }
  }

  // Called with the lock held.
  const std::byte* newest(slot_id s) const {
    if (auto it = queued_.find(s); it != queued_.end()) {
      return it->second->data.data();
    }
    if (auto it = flying_.find(s); it != flying_.end()) {
      return it->second->data.data();
    }
    if (auto it = failed_.find(s); it != failed_.end()) {
      return it->second.held->data.data();
    }
    return nullptr;
  }

  std::unique_ptr<copy> take_copy() {
    if (spare_.empty()) {
      return std::make_unique<copy>();
    }
    std::unique_ptr<copy> c = std::move(spare_.back());
    spare_.pop_back();
    return c;
  }

  void run() {
    std::unique_lock lock(mutex_);
    std::vector<block_write> batch;
    for (;;) {
      idle_ = true;
      work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      idle_ = false;
      if (queue_.empty()) {
        return;  // stopping, and everything queued has been written
      }
      // Batches until a whole linger passes without a write.
      for (;;) {
        if (linger_.count() > 0) {
          work_cv_.wait_for(lock, linger_,
                            [&] { return stopping_ || urgent_ > 0 || 2 * pending_ >= capacity_; });
        }
        if (queue_.empty()) {
          break;
        }
        write_batch(lock, batch);
      }
    }
  }

  // Writes the whole queue as one batch; called with `lock` held, releases it meanwhile.
  void write_batch(std::unique_lock<std::mutex>& lock, std::vector<block_write>& batch) {
    // A slot is queued at most once, so no two writes of a slot are ever in flight together
    // and the device applies them in order.
    in_flight_ = std::move(queue_);
    queue_.clear();
    queued_.clear();
    batch.clear();
    for (const auto& c : in_flight_) {
      flying_.emplace(c->slot, c.get());
      batch.push_back({c->slot, c->data.ensure(stride_)});
    }
    lock.unlock();
    std::vector<std::size_t> failed_at;
    std::vector<std::string> reasons;
    try {
      write_(batch);
    } catch (...) {
      // Which writes failed: try each on its own, so the others complete.
      for (std::size_t i = 0; i < batch.size(); ++i) {
        if (std::string reason = attempt(batch[i]); !reason.empty()) {
          failed_at.push_back(i);
          reasons.push_back(std::move(reason));
        }
      }
    }
    lock.lock();
    std::size_t f = 0;
    for (std::size_t i = 0; i < in_flight_.size(); ++i) {
      std::unique_ptr<copy>& c = in_flight_[i];
      flying_.erase(c->slot);
      if (f < failed_at.size() && failed_at[f] == i) {
        // Keep the content, unless a newer write of the slot is already queued.
        if (!queued_.contains(c->slot)) {
          const slot_id s = c->slot;
          failed_[s] = failure{std::move(c), std::move(reasons[f])};
        } else {
          spare_.push_back(std::move(c));
        }
        ++f;
      } else {
        spare_.push_back(std::move(c));
      }
    }
    pending_ -= in_flight_.size();
    in_flight_.clear();
    done_cv_.notify_all();
  }

  std::size_t block_bytes_;
  std::size_t stride_;
  std::uint32_t capacity_;
  std::chrono::microseconds linger_;
  device_writer write_;
  mutable std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<std::unique_ptr<copy>> queue_;      // queued, oldest first
  std::unordered_map<slot_id, copy*> queued_;    // slot -> its queued copy
  std::deque<std::unique_ptr<copy>> in_flight_;  // the batch being written
  std::unordered_map<slot_id, copy*> flying_;    // slot -> its copy being written
  std::unordered_map<slot_id, failure> failed_;  // slot -> content the device refused
  std::vector<std::unique_ptr<copy>> spare_;     // reused buffers
  std::size_t pending_ = 0;                      // queued + in flight
  std::size_t urgent_ = 0;                       // callers in flush()
  bool idle_ = false;                            // the writer sleeps until a write comes
  bool stopping_ = false;
  bool background_ = false;
  std::thread writer_;  // last: starts after every member it uses is constructed
};

}  // namespace oasiskv::detail
