// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `host_tier`: a pool of block slots in one contiguous host allocation.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <new>
#include <utility>

#include "oasiskv/concepts/tier_backend.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/views.hpp"

namespace oasiskv {

//! @brief How a `host_tier` gets its memory.
struct host_tier_options {
  enum class alignment : std::uint8_t {
    cache_line,  //!< 64 bytes, from the C++ heap: cheapest for small pools
    page,        //!< the OS page, from mmap: needed to pin or to use huge pages
  };
  alignment align = alignment::page;
  //! Ask for transparent huge pages (madvise), which cut TLB misses when a kernel streams
  //! gigabytes of scattered blocks. Implies page alignment; a kernel without THP ignores it.
  bool huge_pages = false;
  //! Touch every page up front so first use does not pay for page faults (and so pinning, which
  //! faults pages in anyway, is not the one that pays).
  bool prefault = false;
  //! Called on each chunk after allocation (e.g. `cudaHostRegister`) and, in reverse, before
  //! release. Chunks hold whole slots, so no block spans two registrations.
  std::function<void(void*, std::size_t)> pin = {};
  std::function<void(void*, std::size_t)> unpin = {};
  std::size_t pin_chunk_bytes = std::size_t{1} << 30;
};

//! @brief `num_slots` slots of `layout.block_bytes()` rounded up to 64 bytes, in one contiguous
//! host allocation (so the whole pool is one `block_pool_view`). Move-only; owns its memory.
//! Models `host_accessible_tier`.
class host_tier {
 public:
  static constexpr memory_kind memory = memory_kind::host;
  static constexpr std::size_t slot_alignment = 64;
  static constexpr std::size_t huge_page_bytes = std::size_t{2} << 20;

  host_tier(const kv_layout& layout, std::uint32_t num_slots, host_tier_options options = {})
      : layout_(layout), num_slots_(num_slots), options_(std::move(options)) {
    layout_.validate();
    if (num_slots_ == 0 || num_slots_ == null_slot) [[unlikely]] {
      detail::raise(errc::invalid_argument, "host_tier num_slots = ", num_slots, " must be in [1, ",
                    null_slot, ")");
    }
    slot_bytes_ = (layout_.block_bytes() + slot_alignment - 1) / slot_alignment * slot_alignment;
    bytes_ = slot_bytes_ * num_slots_;  // < 2^32 slots x 1 GiB: fits in 64 bits
    allocate();
    try {
      if (options_.prefault) {
        std::memset(base_, 0, bytes_);
      }
      pin_all();
    } catch (...) {
      unpin_all();  // the chunks pinned before the failing one
      release_memory();
      throw;
    }
  }

  host_tier(host_tier&& o) noexcept
      : layout_(o.layout_),
        num_slots_(o.num_slots_),
        options_(std::move(o.options_)),
        slot_bytes_(o.slot_bytes_),
        bytes_(o.bytes_),
        mapped_bytes_(o.mapped_bytes_),
        pinned_chunks_(o.pinned_chunks_),
        base_(std::exchange(o.base_, nullptr)) {}
  host_tier& operator=(host_tier&& o) noexcept {
    if (this != &o) {
      release();
      layout_ = o.layout_;
      num_slots_ = o.num_slots_;
      options_ = std::move(o.options_);
      slot_bytes_ = o.slot_bytes_;
      bytes_ = o.bytes_;
      mapped_bytes_ = o.mapped_bytes_;
      pinned_chunks_ = o.pinned_chunks_;
      base_ = std::exchange(o.base_, nullptr);
    }
    return *this;
  }
  host_tier(const host_tier&) = delete;
  host_tier& operator=(const host_tier&) = delete;
  ~host_tier() { release(); }

  const kv_layout& layout() const noexcept { return layout_; }
  std::uint32_t num_slots() const noexcept { return num_slots_; }
  std::size_t slot_bytes() const noexcept { return slot_bytes_; }
  //! @brief Bytes of slot memory (num_slots x slot_bytes).
  std::size_t bytes() const noexcept { return bytes_; }
  //! @brief Registrations the pin hook received (0 without one).
  std::size_t pinned_chunks() const noexcept { return pinned_chunks_; }
  //! @brief Slots per pinned chunk: a copy of consecutive slots that must stay within one
  //! registration may not cross a multiple of this.
  std::uint32_t slots_per_chunk() const noexcept { return chunk_slots(); }

  std::byte* slot_data(slot_id s) {
    check_slot(s);
    return base_ + std::size_t{s} * slot_bytes_;
  }
  const std::byte* slot_data(slot_id s) const {
    check_slot(s);
    return base_ + std::size_t{s} * slot_bytes_;
  }
  block_pool_view view() const noexcept { return {base_, slot_bytes_, num_slots_, layout_}; }

 private:
  void check_slot(slot_id s) const {
    if (s >= num_slots_) [[unlikely]] {
      detail::raise(errc::invalid_slot, "host_tier: slot ", s, " is outside the pool of ",
                    num_slots_, " slots");
    }
  }

  std::uint32_t chunk_slots() const noexcept {
    const std::size_t n = options_.pin_chunk_bytes / slot_bytes_;
    return n == 0 ? 1u : (n >= num_slots_ ? num_slots_ : static_cast<std::uint32_t>(n));
  }

  void allocate() {
    const bool use_mmap =
        options_.huge_pages || options_.align == host_tier_options::alignment::page;
    if (!use_mmap) {
      base_ = static_cast<std::byte*>(
          ::operator new (bytes_, std::align_val_t{slot_alignment}, std::nothrow));
      if (base_ == nullptr) [[unlikely]] {
        detail::raise(errc::out_of_memory, "host_tier: cannot allocate ", bytes_, " bytes (",
                      num_slots_, " slots of ", slot_bytes_, ")");
      }
      return;
    }
    const std::size_t page =
        options_.huge_pages ? huge_page_bytes : static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    mapped_bytes_ = (bytes_ + page - 1) / page * page;
    void* p =
        ::mmap(nullptr, mapped_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) [[unlikely]] {
      const int err = errno;
      mapped_bytes_ = 0;
      detail::raise(errc::out_of_memory, "host_tier: mmap of ", bytes_, " bytes (", num_slots_,
                    " slots of ", slot_bytes_, ") failed: ", std::strerror(err));
    }
#ifdef MADV_HUGEPAGE
    if (options_.huge_pages) {
      ::madvise(p, mapped_bytes_, MADV_HUGEPAGE);  // advisory: no THP is not an error
    }
#endif
    base_ = static_cast<std::byte*>(p);
  }

  void pin_all() {
    if (!options_.pin) {
      return;
    }
    const std::size_t chunk = std::size_t{chunk_slots()} * slot_bytes_;
    for (std::size_t off = 0; off < bytes_; off += chunk) {
      options_.pin(base_ + off, std::min(chunk, bytes_ - off));
      ++pinned_chunks_;
    }
  }

  void unpin_all() noexcept {
    if (!options_.unpin || pinned_chunks_ == 0) {
      pinned_chunks_ = 0;
      return;
    }
    const std::size_t chunk = std::size_t{chunk_slots()} * slot_bytes_;
    for (std::size_t i = pinned_chunks_; i-- > 0;) {
      const std::size_t off = i * chunk;
      try {
        options_.unpin(base_ + off, std::min(chunk, bytes_ - off));
      } catch (...) {
        // Releasing must not throw; the memory goes back to the OS regardless.
      }
    }
    pinned_chunks_ = 0;
  }

  void release_memory() noexcept {
    if (base_ == nullptr) {
      return;
    }
    if (mapped_bytes_ != 0) {
      ::munmap(base_, mapped_bytes_);
    } else {
      ::operator delete (base_, std::align_val_t{slot_alignment});
    }
    base_ = nullptr;
  }

  void release() noexcept {
    if (base_ != nullptr) {
      unpin_all();
    }
    release_memory();
  }

  kv_layout layout_;
  std::uint32_t num_slots_;
  host_tier_options options_;
  std::size_t slot_bytes_ = 0;
  std::size_t bytes_ = 0;
  std::size_t mapped_bytes_ = 0;  // nonzero: the memory came from mmap
  std::size_t pinned_chunks_ = 0;
  std::byte* base_ = nullptr;
};

}  // namespace oasiskv
