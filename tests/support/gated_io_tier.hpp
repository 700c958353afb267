// SPDX-License-Identifier: Apache-2.0
//! A block-I/O tier in memory whose reads can be held back by a gate and can fail on a poisoned
//! slot, and whose writes can fail after a count: it makes in-flight states and run-time
//! transfer and write failures deterministic in tests.
#pragma once

#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "oasiskv/concepts/tier_backend.hpp"

namespace oasiskv::testing {

class gated_io_tier {
 public:
  static constexpr oasiskv::memory_kind memory = oasiskv::memory_kind::file;
  gated_io_tier(const oasiskv::kv_layout& l, std::uint32_t n)
      : layout_(l), data_(n * l.block_bytes()) {}
  const oasiskv::kv_layout& layout() const noexcept { return layout_; }
  std::uint32_t num_slots() const noexcept {
    return static_cast<std::uint32_t>(data_.size() / layout_.block_bytes());
  }
  std::size_t slot_bytes() const noexcept { return layout_.block_bytes(); }
  void read_block(oasiskv::slot_id s, std::byte* out) const {
    std::unique_lock lock(sync_->mutex);
    sync_->cv.wait(lock, [&] { return open_; });
    if (poisoned_ && *poisoned_ == s) {
      throw std::runtime_error("I/O error reading slot " + std::to_string(s));
    }
    std::memcpy(out, data_.data() + s * layout_.block_bytes(), layout_.block_bytes());
  }
  void write_block(oasiskv::slot_id s, const std::byte* in) {
    std::lock_guard lock(sync_->mutex);
    if (writes_left_ == 0) {
      throw std::runtime_error("I/O error writing slot " + std::to_string(s));
    }
    if (writes_left_ > 0) {
      --writes_left_;
    }
    std::memcpy(data_.data() + s * layout_.block_bytes(), in, layout_.block_bytes());
  }
  void set_open(bool open) {
    {
      std::lock_guard lock(sync_->mutex);
      open_ = open;
    }
    sync_->cv.notify_all();
  }
  void poison(oasiskv::slot_id s) {
    std::lock_guard lock(sync_->mutex);
    poisoned_ = s;
  }
  void cure() {
    std::lock_guard lock(sync_->mutex);
    poisoned_.reset();
    writes_left_ = -1;
  }
  //! The next `n` writes succeed, every later one throws (until `cure`).
  void fail_writes_after(int n) {
    std::lock_guard lock(sync_->mutex);
    writes_left_ = n;
  }
  std::byte* raw(oasiskv::slot_id s) { return data_.data() + s * layout_.block_bytes(); }

 private:
  oasiskv::kv_layout layout_;
  std::vector<std::byte> data_;
  struct sync {  // behind a pointer: the tier moves into the cache that owns it
    std::mutex mutex;
    std::condition_variable cv;
  };
  std::unique_ptr<sync> sync_ = std::make_unique<sync>();
  bool open_ = true;
  std::optional<oasiskv::slot_id> poisoned_;
  int writes_left_ = -1;  // -1: no write fails
};

}  // namespace oasiskv::testing
