// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cpu_copy_engine`: block copies between host-reachable tiers on a worker thread.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "oasiskv/concepts/tier_backend.hpp"
#include "oasiskv/concepts/transfer_engine.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/transfer/detail/sorted_set.hpp"

namespace oasiskv {

//! @brief A tier the CPU can copy blocks in and out of: plain host memory, or a tier with block
//! I/O calls (a file, a remote node). A `batched_block_io_tier` gets one call per batch.
template <class T>
concept cpu_copyable_tier = host_accessible_tier<T> || block_io_tier<T>;

struct cpu_copy_engine_options {
  //! A batch between two host-accessible tiers of at most this many bytes, submitted while no
  //! earlier batch is unfinished, is copied by the submitting thread before `submit` returns:
  //! waking the worker would cost more than the copy (a futex call and, on a VM, an
  //! inter-processor interrupt), and the caller would soon wait for it anyway. Batches still
  //! finish in submission order. 0 sends every batch to the worker.
  std::size_t inline_bytes = std::size_t{64} << 10;
  //! Microseconds the worker stays awake after its last batch, looking for new ones every
  //! `poll_us`. A batch submitted meanwhile starts within `poll_us` without waking the worker:
  //! `submit` then costs no futex call (and, on a VM, no inter-processor interrupt), which a
  //! decoder prefetching once per layer would otherwise pay per layer. `wait` and `drain` wake
  //! the worker at once. 0: the worker sleeps as soon as its queue is empty, and every `submit`
  //! wakes it. At most 1,000,000.
  std::uint32_t linger_us = 1000;
  //! How often a lingering worker looks for batches, in [1, 1,000,000] microseconds.
  std::uint32_t poll_us = 100;
};

//! @brief Performs batches of whole-block copies between `cpu_copyable_tier`s on one worker
//! thread, in submission order, while the caller goes on. A batch is checked as a whole at
//! `submit` (layouts, slot ids, hazards with unfinished batches) so a bad batch moves nothing; a
//! failure while a batch runs (an I/O error of a block-I/O tier) is kept and rethrown by `wait`.
//! Small host-to-host batches may be copied inline (`cpu_copy_engine_options::inline_bytes`).
//! Models `transfer_engine<cpu_copy_engine, Src, Dst>` for any two such tiers. Thread-safe.
class cpu_copy_engine {
 public:
  //! The largest `linger_us` and `poll_us` the options take.
  static constexpr std::uint32_t max_linger_us = 1'000'000;

  //! @brief Identifies one submitted batch. Default-constructed tickets are never issued.
  struct ticket {
    std::uint64_t id = 0;
    friend constexpr bool operator==(const ticket&, const ticket&) = default;
  };

  //! @brief Totals since construction.
  struct statistics {
    std::uint64_t batches = 0;
    std::uint64_t blocks = 0;
    std::uint64_t bytes = 0;
    std::uint64_t failed_batches = 0;
    std::uint64_t inline_batches = 0;  //!< copied by the submitting thread
  };

  cpu_copy_engine() : cpu_copy_engine(cpu_copy_engine_options{}) {}
  //! @brief Throws `errc::invalid_argument` naming a `linger_us` or `poll_us` out of range.
  explicit cpu_copy_engine(cpu_copy_engine_options options)
      : options_(checked(options)), worker_([this] { run(); }) {}
  cpu_copy_engine(const cpu_copy_engine&) = delete;
  cpu_copy_engine& operator=(const cpu_copy_engine&) = delete;

  //! @brief Finishes every submitted batch, then stops the worker.
  ~cpu_copy_engine() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    work_cv_.notify_all();
    worker_.join();
  }

  template <cpu_copyable_tier Src, cpu_copyable_tier Dst>
  ticket submit(const Src& src, Dst& dst, std::span<const block_copy> copies) {
    if (!(src.layout() == dst.layout())) [[unlikely]] {
      detail::raise(errc::layout_mismatch,
                    "cpu_copy_engine::submit: source and destination layouts differ (block bytes ",
                    src.layout().block_bytes(), " vs ", dst.layout().block_bytes(), ")");
    }
    std::unique_ptr<batch> job = take_spare();
    job->block_bytes = src.layout().block_bytes();
    job->copies.reserve(copies.size());
    job->src_tier = &src;
    job->dst_tier = &dst;
    for (std::size_t i = 0; i < copies.size(); ++i) {
      const block_copy c = copies[i];
      if (c.src >= src.num_slots()) [[unlikely]] {
        detail::raise(errc::invalid_slot, "cpu_copy_engine::submit: copy ", i, " reads slot ",
                      c.src, " of a source tier of ", src.num_slots(), " slots");
      }
      if (c.dst >= dst.num_slots()) [[unlikely]] {
        detail::raise(errc::invalid_slot, "cpu_copy_engine::submit: copy ", i, " writes slot ",
                      c.dst, " of a destination tier of ", dst.num_slots(), " slots");
      }
      job->copies.push_back(c);
    }
    job->run = [](batch& b) {
      copy_batch<Src, Dst>(b);
    };

    std::unique_lock lock(mutex_);
    check_hazards(*job);
    job->id = ++issued_;
    if constexpr (host_accessible_tier<Src> && host_accessible_tier<Dst>) {
      // Nothing unfinished, so finishing this one now keeps the completion order. memcpy
      // cannot fail.
      if (completed_ + 1 == job->id && options_.inline_bytes != 0 &&
          job->copies.size() * job->block_bytes <= options_.inline_bytes) {
        copy_batch<Src, Dst>(*job);
        ++stats_.inline_batches;
        retire(*job, {});
        const ticket t{job->id};
        recycle(std::move(job));
        return t;  // nobody holds this ticket yet: no waiter to wake
      }
    }
    for (const block_copy& c : job->copies) {
      reading_.insert({job->src_tier, c.src});
      writing_.insert({job->dst_tier, c.dst});
    }
    const ticket t{job->id};
    queue_.push_back(std::move(job));
    const bool wake = idle_;  // a lingering worker finds it within poll_us
    lock.unlock();
    if (wake) {
      work_cv_.notify_one();
    }
    return t;
  }

  //! @brief Whether batch `t` has finished. Never blocks.
  bool test(const ticket& t) const {
    std::lock_guard lock(mutex_);
    check_issued(t);
    return t.id <= completed_;
  }

  //! @brief Blocks until batch `t` has finished; rethrows its failure (once).
  void wait(const ticket& t) {
    std::unique_lock lock(mutex_);
    check_issued(t);
    if (t.id > completed_ && lingering_) {
      work_cv_.notify_one();
    }
    done_cv_.wait(lock, [&] { return t.id <= completed_; });
    if (auto it = failures_.find(t.id); it != failures_.end()) {
      std::string message = std::move(it->second);
      failures_.erase(it);
      throw error(errc::transfer_failed, message);
    }
  }

  //! @brief Blocks until every batch submitted so far has finished. Failures stay for `wait`.
  void drain() {
    std::unique_lock lock(mutex_);
    const std::uint64_t target = issued_;
    if (completed_ < target && lingering_) {
      work_cv_.notify_one();
    }
    done_cv_.wait(lock, [&] { return completed_ >= target; });
  }

  statistics stats() const {
    std::lock_guard lock(mutex_);
    return stats_;
  }

  const cpu_copy_engine_options& options() const noexcept { return options_; }

 private:
  struct batch {
    std::uint64_t id = 0;
    const void* src_tier = nullptr;
    const void* dst_tier = nullptr;
    std::size_t block_bytes = 0;
    std::vector<block_copy> copies;
    void (*run)(batch&) = nullptr;
  };

  struct slot_key {
    const void* tier;
    slot_id slot;
    friend bool operator==(const slot_key&, const slot_key&) = default;
    friend bool operator<(const slot_key& a, const slot_key& b) noexcept {
      return std::less<const void*>{}(a.tier, b.tier) || (a.tier == b.tier && a.slot < b.slot);
    }
  };

  template <class Src, class Dst>
  static void copy_batch(batch& b) {
    const auto& src = *static_cast<const Src*>(b.src_tier);
    auto& dst = *static_cast<Dst*>(const_cast<void*>(b.dst_tier));
    if constexpr (host_accessible_tier<Src> && host_accessible_tier<Dst>) {
      for (const block_copy& c : b.copies) {
        std::memcpy(dst.slot_data(c.dst), src.slot_data(c.src), b.block_bytes);
      }
    } else if constexpr (host_accessible_tier<Dst>) {
      // One batched call keeps every block of the batch in flight on the device at once.
      if constexpr (batched_block_io_tier<Src>) {
        std::vector<block_read> reads;
        reads.reserve(b.copies.size());
        for (const block_copy& c : b.copies) {
          reads.push_back({c.src, dst.slot_data(c.dst)});
        }
        src.read_blocks(reads);
      } else {
        for (const block_copy& c : b.copies) {
          src.read_block(c.src, dst.slot_data(c.dst));
        }
      }
    } else if constexpr (host_accessible_tier<Src>) {
      if constexpr (batched_block_io_tier<Dst>) {
        std::vector<block_write> writes;
        writes.reserve(b.copies.size());
        for (const block_copy& c : b.copies) {
          writes.push_back({c.dst, src.slot_data(c.src)});
        }
        dst.write_blocks(writes);
      } else {
        for (const block_copy& c : b.copies) {
          dst.write_block(c.dst, src.slot_data(c.src));
        }
      }
    } else {
      copy_through_bounce(src, dst, b);
    }
  }

  // Between two block-I/O tiers, through host memory: a chunk of blocks is read, then written,
  // each with one batched call where the tier has one. Chunks cap the bounce memory; its blocks
  // are 4096-aligned and 4096 apart so an O_DIRECT tier can use them without bouncing again.
  template <class Src, class Dst>
  static void copy_through_bounce(const Src& src, Dst& dst, const batch& b) {
    if (b.copies.empty()) {
      return;
    }
    constexpr std::size_t align = 4096;
    constexpr std::size_t max_bounce_bytes = std::size_t{64} << 20;
    const std::size_t stride = (b.block_bytes + align - 1) / align * align;
    const std::size_t chunk = std::max<std::size_t>(1, max_bounce_bytes / stride);
    const std::size_t blocks = std::min(chunk, b.copies.size());
    struct aligned_delete {
      void operator()(std::byte* p) const noexcept {
        ::operator delete[](p, std::align_val_t{align});
      }
    };
    std::unique_ptr<std::byte[], aligned_delete> bounce(
        static_cast<std::byte*>(::operator new[](blocks* stride, std::align_val_t{align})));
    std::vector<block_read> reads;
    std::vector<block_write> writes;
    for (std::size_t first = 0; first < b.copies.size(); first += chunk) {
      const std::size_t n = std::min(chunk, b.copies.size() - first);
      reads.clear();
      writes.clear();
      for (std::size_t i = 0; i < n; ++i) {
        reads.push_back({b.copies[first + i].src, bounce.get() + i * stride});
        writes.push_back({b.copies[first + i].dst, bounce.get() + i * stride});
      }
      if constexpr (batched_block_io_tier<Src>) {
        src.read_blocks(reads);
      } else {
        for (const block_read& r : reads) {
          src.read_block(r.slot, r.out);
        }
      }
      if constexpr (batched_block_io_tier<Dst>) {
        dst.write_blocks(writes);
      } else {
        for (const block_write& w : writes) {
          dst.write_block(w.slot, w.in);
        }
      }
    }
  }

  // Called with the lock held. A batch may not read a slot an unfinished batch writes (it would
  // read a half-written block), nor write a slot an unfinished batch reads or writes; within the
  // batch, a destination may appear once and may not also be a source.
  void check_hazards(const batch& b) const {
    dst_keys_.clear();
    for (const block_copy& c : b.copies) {
      dst_keys_.push_back({b.dst_tier, c.dst});
    }
    if (const std::size_t i = detail::first_repeat<slot_key>(dst_keys_, sorted_keys_);
        i != dst_keys_.size()) [[unlikely]] {
      detail::raise(errc::invalid_argument, "cpu_copy_engine::submit: copy ", i, " writes slot ",
                    dst_keys_[i].slot, " which an earlier copy of the batch writes");
    }
    for (std::size_t i = 0; i < dst_keys_.size(); ++i) {
      const slot_key& d = dst_keys_[i];
      if (writing_.contains(d) || reading_.contains(d)) [[unlikely]] {
        detail::raise(errc::slot_in_flight, "cpu_copy_engine::submit: copy ", i, " writes slot ",
                      d.slot, " which an unfinished batch still ",
                      writing_.contains(d) ? "writes" : "reads");
      }
    }
    for (std::size_t i = 0; i < b.copies.size(); ++i) {
      const slot_key s{b.src_tier, b.copies[i].src};
      if (writing_.contains(s)) [[unlikely]] {
        detail::raise(errc::slot_in_flight, "cpu_copy_engine::submit: copy ", i, " reads slot ",
                      s.slot, " which an unfinished batch still writes");
      }
      if (std::binary_search(sorted_keys_.begin(), sorted_keys_.end(), s)) [[unlikely]] {
        detail::raise(errc::invalid_argument, "cpu_copy_engine::submit: copy ", i, " reads slot ",
                      s.slot, " which the same batch writes");
      }
    }
  }

  // A batch from the spare list, else a new one.
  std::unique_ptr<batch> take_spare() {
    {
      std::lock_guard lock(mutex_);
      if (!spare_.empty()) {
        std::unique_ptr<batch> b = std::move(spare_.back());
        spare_.pop_back();
        return b;
      }
    }
    return std::make_unique<batch>();
  }

  static constexpr std::size_t max_spare_batches = 64;

  // Lock held. Keeps a finished batch for reuse, emptied, with its vector's capacity: in steady
  // state a submit allocates nothing.
  void recycle(std::unique_ptr<batch> b) {
    if (spare_.size() >= max_spare_batches) {
      return;
    }
    b->id = 0;
    b->src_tier = nullptr;
    b->dst_tier = nullptr;
    b->copies.clear();
    b->run = nullptr;
    spare_.push_back(std::move(b));
  }

  void check_issued(const ticket& t) const {
    if (t.id == 0 || t.id > issued_) [[unlikely]] {
      detail::raise(errc::unknown_ticket, "cpu_copy_engine: ticket ", t.id,
                    " was never issued (last issued: ", issued_, ")");
    }
  }

  // Lock held. Counts finished batch `job` (failed if `failure` is not empty); it is the oldest
  // unfinished one.
  void retire(const batch& job, const std::string& failure) {
    ++stats_.batches;
    stats_.blocks += job.copies.size();
    if (failure.empty()) {
      stats_.bytes += job.copies.size() * job.block_bytes;
    } else {
      ++stats_.failed_batches;
      failures_.emplace(job.id, "batch " + std::to_string(job.id) + " failed: " + failure);
    }
    completed_ = job.id;
  }

  static cpu_copy_engine_options checked(cpu_copy_engine_options o) {
    if (o.linger_us > max_linger_us) [[unlikely]] {
      detail::raise(errc::invalid_argument, "cpu_copy_engine_options.linger_us = ", o.linger_us,
                    " must be at most ", max_linger_us);
    }
    if (o.poll_us == 0 || o.poll_us > max_linger_us) [[unlikely]] {
      detail::raise(errc::invalid_argument, "cpu_copy_engine_options.poll_us = ", o.poll_us,
                    " must be in [1, ", max_linger_us, "]");
    }
    return o;
  }

  void run() {
    using clock = std::chrono::steady_clock;
    const std::chrono::microseconds linger{options_.linger_us}, poll{options_.poll_us};
    std::unique_lock lock(mutex_);
    for (;;) {
      idle_ = true;
      work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      idle_ = false;
      if (queue_.empty()) {
        return;  // stopping, and everything submitted has finished
      }
      // Run batches until a whole linger passes without one.
      clock::time_point last = clock::now();
      for (;;) {
        if (!queue_.empty()) {
          run_one(lock);
          last = clock::now();
          continue;
        }
        if (stopping_ || clock::now() - last >= linger) {
          break;
        }
        lingering_ = true;
        work_cv_.wait_for(lock, poll, [&] { return stopping_ || !queue_.empty(); });
        lingering_ = false;
      }
    }
  }

  // Runs the oldest queued batch; called with `lock` held, releases it meanwhile.
  void run_one(std::unique_lock<std::mutex>& lock) {
    std::unique_ptr<batch> job = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    std::string failure;
    try {
      job->run(*job);
    } catch (const std::exception& e) {
      failure = e.what();
    } catch (...) {
      failure = "unknown exception";
    }
    lock.lock();
    for (const block_copy& c : job->copies) {
      reading_.erase({job->src_tier, c.src});
      writing_.erase({job->dst_tier, c.dst});
    }
    retire(*job, failure);
    recycle(std::move(job));
    done_cv_.notify_all();
  }

  cpu_copy_engine_options options_;
  mutable std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<std::unique_ptr<batch>> queue_;
  // Slots that unfinished batches read (once per batch that reads it) and write. Sorted vectors:
  // a submit and its retirement allocate nothing once they have grown.
  oasiskv::detail::sorted_set<slot_key> reading_;
  oasiskv::detail::sorted_set<slot_key> writing_;
  std::vector<std::unique_ptr<batch>> spare_;  // finished batches kept for reuse
  mutable std::vector<slot_key> dst_keys_;     // check_hazards' scratch (lock held)
  mutable std::vector<slot_key> sorted_keys_;
  std::unordered_map<std::uint64_t, std::string> failures_;
  std::uint64_t issued_ = 0;
  std::uint64_t completed_ = 0;
  bool idle_ = false;       // the worker sleeps until a submit wakes it
  bool lingering_ = false;  // the worker sleeps until its next look at the queue
  bool stopping_ = false;
  statistics stats_{};
  std::thread worker_;  // last: starts after every member it uses is constructed
};

}  // namespace oasiskv
