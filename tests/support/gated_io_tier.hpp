// SPDX-License-Identifier: Apache-2.0
//! A block-I/O tier in memory whose reads can be held back by a gate and can fail on a poisoned
//! slot: it makes in-flight states and run-time transfer failures deterministic in tests.
#pragma once

#include <condition_variable>
#include <cstring>
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
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return open_; });
    if (poisoned_ && *poisoned_ == s) {
      throw std::runtime_error("I/O error reading slot " + std::to_string(s));
    }
    std::memcpy(out, data_.data() + s * layout_.block_bytes(), layout_.block_bytes());
  }
  void write_block(oasiskv::slot_id s, const std::byte* in) {
    std::lock_guard lock(mutex_);
    std::memcpy(data_.data() + s * layout_.block_bytes(), in, layout_.block_bytes());
  }
  void set_open(bool open) {
    {
      std::lock_guard lock(mutex_);
      open_ = open;
    }
    cv_.notify_all();
  }
  void poison(oasiskv::slot_id s) {
    std::lock_guard lock(mutex_);
    poisoned_ = s;
  }
  void cure() {
    std::lock_guard lock(mutex_);
    poisoned_.reset();
  }
  std::byte* raw(oasiskv::slot_id s) { return data_.data() + s * layout_.block_bytes(); }

 private:
  oasiskv::kv_layout layout_;
  std::vector<std::byte> data_;
  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
  bool open_ = true;
  std::optional<oasiskv::slot_id> poisoned_;
};

}  // namespace oasiskv::testing
