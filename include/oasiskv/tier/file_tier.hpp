// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `file_tier`: a pool of block slots in a file on local storage (an SSD), read and
//! written with O_DIRECT through io_uring or a pread thread pool.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "oasiskv/concepts/tier_backend.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/layout.hpp"
#include "oasiskv/tier/detail/file_io.hpp"
#include "oasiskv/tier/detail/file_manifest.hpp"
#include "oasiskv/tier/detail/pread_pool.hpp"
#include "oasiskv/tier/detail/uring_ring.hpp"
#include "oasiskv/tier/detail/write_behind.hpp"

namespace oasiskv {

//! @brief How a `file_tier` moves blocks.
enum class file_backend : std::uint8_t {
  automatic,   //!< io_uring where this build has it and the kernel allows it, else pread_pool
  io_uring,    //!< io_uring (liburing); refused with `errc::unsupported` where unavailable
  pread_pool,  //!< pread/pwrite on a pool of threads: works everywhere
};

constexpr std::string_view to_string(file_backend b) noexcept {
  switch (b) {
    case file_backend::automatic:
      return "automatic";
    case file_backend::io_uring:
      return "io_uring";
    case file_backend::pread_pool:
      return "pread_pool";
  }
  return "unknown";
}

//! @brief Where a `file_tier` keeps its blocks and how it reaches them.
struct file_tier_options {
  //! A directory: the tier creates an unlinked temporary file there (O_TMPFILE, or mkstemp and
  //! unlink), gone when the tier is. Otherwise a file path, created if missing and kept
  //! afterwards (its blocks survive the tier), locked (flock) while the tier uses it, with a
  //! manifest beside it (`<path>.oasiskv`: the layout, and how the last tier left the file). A
  //! tier refuses a file whose blocks have another layout (`errc::layout_mismatch`), one whose
  //! last tier lost writes or died writing behind (`errc::io_error`), and data without a
  //! manifest (`errc::invalid_argument`).
  std::string path;
  //! Bypass the page cache (O_DIRECT), so the tier costs no host memory and measures the
  //! device. Where the filesystem refuses (tmpfs before Linux 6.6), the tier uses buffered I/O
  //! and `direct_io()` says false.
  bool direct_io = true;
  file_backend backend = file_backend::automatic;
  //! Requests one io_uring caller keeps in flight; also the number of bounce buffers per ring.
  std::uint32_t queue_depth = 64;
  //! Threads of the pread_pool backend (not started with io_uring).
  std::uint32_t pool_threads = 4;
  //! Write-behind: a write returns once its blocks are copied into memory the tier owns (at
  //! most `queue_depth` blocks, the oldest writes wait beyond that); a writer thread hands them
  //! to the device in batches, and a read of a slot whose newest content is not on the device
  //! yet is served from that copy, so every read still returns the last write. A decoder that
  //! writes each token's partial block then pays a copy instead of a device round trip per
  //! layer. Device errors show at the next write (which retries the failed ones first and
  //! throws `errc::io_error`, queuing nothing, if one still fails) and at `flush()`, which waits
  //! for every pending write; the content of a failed write is kept, and read back, until a
  //! later write or `flush` succeeds. A tier destroyed with writes the device still refuses
  //! marks its named file as having lost them. Off: a write returns when the device has the
  //! block, and a device error is that write's.
  bool write_behind = false;
  //! With `write_behind`: the writer thread runs at SCHED_IDLE, so waking it never takes a core
  //! from a running thread (a decode step); it runs on cores nothing else wants. On a machine
  //! whose cores are all busy, writes then wait for room more often (`queue_depth`). False: the
  //! writer competes as a normal thread.
  bool background_writer = true;
  //! With `write_behind`: microseconds the writer gathers writes before each batch, staying
  //! awake while they keep coming. A decoder's writes (a partial block per layer) then join one
  //! batch, a slot written again meanwhile is written once, and a write wakes the writer only
  //! after a whole linger without writes (or when half of `queue_depth` is pending). Writes
  //! reach the device up to this much later; `flush()` does not wait for it. 0: the writer is
  //! woken by every write and starts at once. At most 1,000,000.
  std::uint32_t write_linger_us = 1000;
};

// The class's layout and code differ with OASISKV_WITH_LIBURING; a distinct inline namespace per
// variant makes a program that mixes the two a link error instead of an ODR violation.
#if defined(OASISKV_WITH_LIBURING)
#define OASISKV_FILE_TIER_ABI file_tier_uring
#else
#define OASISKV_FILE_TIER_ABI file_tier_pread
#endif
inline namespace OASISKV_FILE_TIER_ABI {

//! @brief `num_slots` block slots in one file, slot `s` at offset `s * slot_bytes()`, with
//! `slot_bytes()` = `layout.block_bytes()` rounded up to 4096 so every slot is aligned for
//! O_DIRECT. Callers' buffers may have any alignment: ones that O_DIRECT cannot use go through
//! bounce buffers the tier owns and reuses. Models `batched_block_io_tier`; every call is safe
//! from several threads at once for distinct slots. Move-only.
class file_tier {
 public:
  static constexpr memory_kind memory = memory_kind::file;
  static constexpr std::size_t slot_alignment = detail::direct_io_alignment;
  static constexpr std::uint32_t max_queue_depth = 4096;
  static constexpr std::uint32_t max_pool_threads = 256;
  static constexpr std::uint32_t max_write_linger_us = 1'000'000;

  //! @brief Opens or creates the file and reserves `num_slots * slot_bytes()` bytes. Throws
  //! `errc::invalid_layout`, `errc::invalid_argument` (bad options or path naming the value),
  //! `errc::io_error` (the system refused: permissions, no space), `errc::unsupported` (an
  //! io_uring backend that this build or kernel lacks).
  file_tier(const kv_layout& layout, std::uint32_t num_slots, file_tier_options options)
      : layout_(layout), num_slots_(num_slots) {
    layout_.validate();
    if (num_slots_ == 0 || num_slots_ == null_slot) [[unlikely]] {
      detail::raise(errc::invalid_argument, "file_tier num_slots = ", num_slots, " must be in [1, ",
                    null_slot, ")");
    }
    if (options.queue_depth == 0 || options.queue_depth > max_queue_depth) [[unlikely]] {
      detail::raise(errc::invalid_argument, "file_tier_options.queue_depth = ", options.queue_depth,
                    " must be in [1, ", max_queue_depth, "]");
    }
    if (options.pool_threads == 0 || options.pool_threads > max_pool_threads) [[unlikely]] {
      detail::raise(errc::invalid_argument,
                    "file_tier_options.pool_threads = ", options.pool_threads, " must be in [1, ",
                    max_pool_threads, "]");
    }
    if (options.write_linger_us > max_write_linger_us) [[unlikely]] {
      detail::raise(errc::invalid_argument,
                    "file_tier_options.write_linger_us = ", options.write_linger_us,
                    " must be at most ", max_write_linger_us);
    }
    if (options.backend != file_backend::automatic && options.backend != file_backend::io_uring &&
        options.backend != file_backend::pread_pool) [[unlikely]] {
      detail::raise(errc::invalid_argument, "file_tier_options.backend = ", options.backend,
                    " is not a file_backend");
    }
    slot_bytes_ = detail::round_up(layout_.block_bytes(), slot_alignment);
    state_ = std::make_unique<state>();
    state_->options = options;
    detail::backing_file f = detail::open_backing_file(options.path, options.direct_io,
                                                       std::uint64_t{num_slots_} * slot_bytes_);
    state_->file = std::move(f.fd);
    state_->temporary = f.temporary;
    state_->geo = {state_->file.get(), layout_.block_bytes(), slot_bytes_, f.direct};
    choose_backend();
    if (options.write_behind) {
      state* st = state_.get();  // stable: the tier may move, its state does not
      state_->behind = std::make_unique<detail::write_behind>(
          layout_.block_bytes(), slot_bytes_, options.queue_depth,
          [st](std::span<const block_write> w) { device_run(*st, w); }, options.background_writer,
          std::chrono::microseconds{options.write_linger_us});
    }
    if (!f.temporary) {
      // Last: the manifest says "open" only once the tier exists (its destructor closes it).
      detail::adopt_manifest(options.path, f.had_data, layout_, slot_bytes_, num_slots_,
                             options.write_behind);
      state_->manifest.layout = layout_;
      state_->manifest.slot_bytes = slot_bytes_;
      state_->manifest.slots = num_slots_;
      state_->manifest_path = detail::file_manifest::path_for(options.path);
    }
  }

  file_tier(file_tier&&) noexcept = default;
  file_tier& operator=(file_tier&&) noexcept = default;
  file_tier(const file_tier&) = delete;
  file_tier& operator=(const file_tier&) = delete;
  ~file_tier() = default;

  const kv_layout& layout() const noexcept { return layout_; }
  std::uint32_t num_slots() const noexcept { return num_slots_; }
  //! @brief Bytes from one slot to the next in the file: `block_bytes()` rounded up to 4096.
  std::size_t slot_bytes() const noexcept { return slot_bytes_; }
  //! @brief Bytes of the file the slots occupy (num_slots x slot_bytes).
  std::uint64_t file_bytes() const noexcept { return std::uint64_t{num_slots_} * slot_bytes_; }
  //! @brief Whether transfers bypass the page cache (false where the filesystem refused).
  bool direct_io() const noexcept { return state_->geo.direct; }
  //! @brief The backend in use: `io_uring` or `pread_pool`, never `automatic`.
  file_backend backend() const noexcept { return state_->backend; }
  //! @brief Whether the file is an unlinked temporary (the path named a directory).
  bool temporary() const noexcept { return state_->temporary; }
  const file_tier_options& options() const noexcept { return state_->options; }
  //! @brief The file descriptor, e.g. to fsync or to register it elsewhere. Owned by the tier.
  //! With `write_behind`, call `flush()` first: the file may lag the tier's newest writes.
  int native_handle() const noexcept { return state_->geo.fd; }
  //! @brief Whether writes return before the device has their blocks (`write_behind`).
  bool write_behind() const noexcept { return state_->behind != nullptr; }
  //! @brief Whether the write-behind writer runs at SCHED_IDLE (`background_writer`, where the
  //! system allows it).
  bool background_writer() const noexcept {
    return state_->behind != nullptr && state_->behind->background();
  }
  //! @brief Blocks written (with `write_behind`) that are not on the device yet.
  std::size_t pending_writes() const { return state_->behind ? state_->behind->pending() : 0; }
  //! @brief Slots (with `write_behind`) whose write the device refused: their content is held
  //! in memory, and read back, until a later write or `flush()` succeeds.
  std::size_t failed_writes() const { return state_->behind ? state_->behind->failed() : 0; }
  //! @brief Waits until every write has reached the device, and retries (once) those it had
  //! refused. Throws `errc::io_error` naming the first that still fails. Without `write_behind`
  //! there is nothing to wait for.
  void flush() {
    if (state_->behind) {
      state_->behind->flush();
    }
  }

  //! @brief Whether this build has io_uring and the kernel lets this process create a ring.
  static bool io_uring_available() noexcept {
#if defined(OASISKV_WITH_LIBURING)
    int err = 0;
    return detail::uring_ring::create(1, err) != nullptr;
#else
    return false;
#endif
  }

  //! @brief Copies slot `s` into the `layout().block_bytes()` bytes at `out`. Blocks.
  void read_block(slot_id s, std::byte* out) const {
    const block_read r{s, out};
    read_blocks(std::span<const block_read>(&r, 1));
  }
  //! @brief Copies the `layout().block_bytes()` bytes at `in` into slot `s`. Blocks (with
  //! `write_behind`, only until the block is copied).
  void write_block(slot_id s, const std::byte* in) {
    const block_write w{s, in};
    write_blocks(std::span<const block_write>(&w, 1));
  }
  //! @brief Performs every read with all of them in flight at once (up to the queue depth per
  //! call with io_uring, spread over the threads with the pool); returns when all are done.
  //! Throws `errc::invalid_slot` / `errc::invalid_argument` before any I/O for a bad request,
  //! `errc::io_error` (naming slot, offset and the system's reason) for a failed one.
  void read_blocks(std::span<const block_read> reads) const {
    run(reads, "read_blocks");
  }
  //! @brief As `read_blocks`, for writes. A slot should appear once per batch (the order of
  //! writes within a batch is unspecified). With `write_behind`, returns once the blocks are
  //! copied, and device errors show at `flush()`.
  void write_blocks(std::span<const block_write> writes) {
    run(writes, "write_blocks");
  }

 private:
  struct state {
    state() = default;
    state(const state&) = delete;
    state& operator=(const state&) = delete;
    // A named file: its last writes reach the device (or are counted as lost), then the
    // manifest records how the tier left it: `clean`, `lost` or `unsynced`.
    ~state() {
      std::size_t lost = 0;
      if (behind) {
        lost = behind->close();
        behind.reset();
      }
      if (!manifest_path.empty()) {
        if (lost > 0) {
          manifest.state = "lost";
          manifest.lost_writes = lost;
        } else {
          manifest.state = ::fdatasync(file.get()) == 0 ? "clean" : "unsynced";
        }
        (void)manifest.write(manifest_path);  // best effort: a destructor cannot throw
      }
    }
    // First member: destroyed last, after the threads and rings that use the descriptor.
    detail::unique_fd file;
    std::string manifest_path;  // empty for a temporary file
    detail::file_manifest manifest;
    file_tier_options options;
    detail::file_geometry geo;
    file_backend backend = file_backend::pread_pool;
    bool temporary = false;
    // Single calls on the pread backend run on the caller's thread with a leased bounce buffer.
    detail::lease_pool<detail::aligned_buffer> bounce;
    std::unique_ptr<detail::pread_pool> pool;
#if defined(OASISKV_WITH_LIBURING)
    // A ring per concurrent caller, lent out under a mutex held only to take or return one. A
    // ring has a single owner (its queues are not thread-safe); one ring behind a mutex would
    // serialize concurrent callers for the whole duration of their I/O, and thread_local rings
    // would outlive the tier or leak with short-lived threads. With one caller (the usual copy
    // engine worker) this is exactly one ring.
    detail::lease_pool<detail::uring_ring> rings;
#endif
    // Last member: destroyed first, while the rings or pool its writer uses still exist.
    std::unique_ptr<detail::write_behind> behind;
  };

  void choose_backend() {
    state& st = *state_;
    const file_backend wanted = st.options.backend;
#if defined(OASISKV_WITH_LIBURING)
    if (wanted != file_backend::pread_pool) {
      int err = 0;
      std::unique_ptr<detail::uring_ring> ring = detail::uring_ring::create(queue_depth(), err);
      if (ring) {
        st.rings.put_back(std::move(ring));
        st.backend = file_backend::io_uring;
        return;
      }
      if (wanted == file_backend::io_uring) {
        detail::raise(errc::unsupported, "file_tier: io_uring_queue_init(", queue_depth(),
                      ") failed: ", std::strerror(err), " (the kernel or a seccomp filter refuses ",
                      "io_uring; use file_backend::pread_pool or automatic)");
      }
    }
#else
    if (wanted == file_backend::io_uring) {
      detail::raise(errc::unsupported,
                    "file_tier: file_backend::io_uring needs liburing: link oasiskv::file "
                    "(which defines OASISKV_WITH_LIBURING)");
    }
#endif
    st.backend = file_backend::pread_pool;
    st.pool = std::make_unique<detail::pread_pool>(st.geo, st.options.pool_threads);
  }

  std::uint32_t queue_depth() const noexcept {
    return state_->options.queue_depth;
  }

  template <class Req>
  void run(std::span<const Req> reqs, const char* what) const {
    for (std::size_t i = 0; i < reqs.size(); ++i) {
      if (reqs[i].slot >= num_slots_) [[unlikely]] {
        detail::raise(errc::invalid_slot, "file_tier::", what, ": request ", i, ": slot ",
                      reqs[i].slot, " is outside the pool of ", num_slots_, " slots");
      }
      if (detail::request_buffer(reqs[i]) == nullptr) [[unlikely]] {
        detail::raise(errc::invalid_argument, "file_tier::", what, ": request ", i, " (slot ",
                      reqs[i].slot, ") has a null buffer");
      }
    }
    if (reqs.empty()) {
      return;
    }
    state& st = *state_;
    if (st.behind) {
      if constexpr (std::is_same_v<Req, block_write>) {
        st.behind->enqueue(reqs);
        return;
      } else {
        std::vector<block_read> rest;
        st.behind->serve(reqs, rest);
        device_run(st, std::span<const block_read>(rest));
        return;
      }
    }
    device_run(st, reqs);
  }

  // The requests, checked, on the device.
  template <class Req>
  static void device_run(state& st, std::span<const Req> reqs) {
    if (reqs.empty()) {
      return;
    }
#if defined(OASISKV_WITH_LIBURING)
    if (st.backend == file_backend::io_uring) {
      run_uring(st, reqs);
      return;
    }
#endif
    if (reqs.size() == 1) {
      // A lone request gains nothing from a hand-off to a worker: two context switches saved.
      detail::lease_pool<detail::aligned_buffer>::lease b(
          &st.bounce, st.bounce.take([] { return std::make_unique<detail::aligned_buffer>(); }));
      detail::transfer_sync(st.geo, detail::direction_of<Req>, reqs[0].slot,
                            detail::request_buffer(reqs[0]), *b);
      return;
    }
    st.pool->run(reqs);
  }

#if defined(OASISKV_WITH_LIBURING)
  template <class Req>
  static void run_uring(state& st, std::span<const Req> reqs) {
    std::unique_ptr<detail::uring_ring> ring = st.rings.take([&] {
      int err = 0;
      auto r = detail::uring_ring::create(st.options.queue_depth, err);
      if (!r) [[unlikely]] {
        // A first ring was created at construction; a later one can fail only for resources.
        detail::raise(errc::io_error, "file_tier: cannot create another io_uring ring for a ",
                      "concurrent caller: ", std::strerror(err));
      }
      return r;
    });
    detail::lease_pool<detail::uring_ring>::lease lease(&st.rings, std::move(ring));
    if (!lease->run(st.geo, reqs)) [[unlikely]] {
      const std::string reason = lease->broken_reason();
      lease.discard();
      detail::raise(errc::io_error, "file_tier: ", reason);
    }
  }
#endif

  kv_layout layout_;
  std::uint32_t num_slots_;
  std::size_t slot_bytes_ = 0;
  std::unique_ptr<state> state_;
};

}  // namespace OASISKV_FILE_TIER_ABI

static_assert(batched_block_io_tier<file_tier>);

}  // namespace oasiskv
