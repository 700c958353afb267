// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Building blocks of `file_tier`: aligned buffers, the backing file, one synchronous block
//! transfer, and a pool of reusable objects. Not part of the public API.
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sys/types.h>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "oasiskv/concepts/tier_backend.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/ids.hpp"

namespace oasiskv::detail {

//! O_DIRECT wants buffers, offsets and lengths aligned to the device's logical block; 4096 covers
//! every sector size in use (512 and 4096) without asking each filesystem (statx DIOALIGN is
//! newer than the kernels we support).
inline constexpr std::size_t direct_io_alignment = 4096;

inline constexpr std::size_t round_up(std::size_t n, std::size_t a) noexcept {
  return (n + a - 1) / a * a;
}

//! @brief A heap buffer aligned for O_DIRECT, grown on demand and reused.
class aligned_buffer {
 public:
  aligned_buffer() = default;
  aligned_buffer(aligned_buffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  aligned_buffer& operator=(aligned_buffer&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    return *this;
  }
  ~aligned_buffer() { release(); }

  //! Makes room for `n` bytes; fresh memory is zeroed so padding written to the file is zero.
  std::byte* ensure(std::size_t n) {
    if (n > size_) {
      release();
      data_ = static_cast<std::byte*>(::operator new (n, std::align_val_t{direct_io_alignment}));
      size_ = n;
      std::memset(data_, 0, n);
    }
    return data_;
  }
  //! The buffer (null before the first `ensure`).
  const std::byte* data() const noexcept { return data_; }

 private:
  void release() noexcept {
    if (data_ != nullptr) {
      ::operator delete (data_, std::align_val_t{direct_io_alignment});
      data_ = nullptr;
      size_ = 0;
    }
  }
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

//! @brief Owns a file descriptor.
class unique_fd {
 public:
  unique_fd() = default;
  explicit unique_fd(int fd) noexcept : fd_(fd) {}
  unique_fd(unique_fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  unique_fd& operator=(unique_fd&& o) noexcept {
    std::swap(fd_, o.fd_);
    return *this;
  }
  ~unique_fd() {
    if (fd_ >= 0) {
      ::close(fd_);
    }
  }
  int get() const noexcept { return fd_; }

 private:
  int fd_ = -1;
};

//! @brief What every transfer needs to know about the file.
struct file_geometry {
  int fd = -1;
  std::size_t block_bytes = 0;  // bytes of one block: what callers' buffers hold
  std::size_t stride = 0;       // bytes from one slot to the next in the file: 4096-aligned
  bool direct = false;          // the descriptor has O_DIRECT

  std::uint64_t offset(slot_id s) const noexcept { return std::uint64_t{s} * stride; }
  //! O_DIRECT moves whole aligned units from aligned memory; a caller's buffer that is not
  //! aligned, or a block that is not a whole number of units, goes through a bounce buffer.
  bool needs_bounce(const std::byte* p) const noexcept {
    return direct && (reinterpret_cast<std::uintptr_t>(p) % direct_io_alignment != 0 ||
                      block_bytes % direct_io_alignment != 0);
  }
};

enum class io_dir : std::uint8_t { read, write };

template <class Req>
inline constexpr io_dir direction_of =
    std::is_same_v<Req, block_read> ? io_dir::read : io_dir::write;

inline std::byte* request_buffer(const block_read& r) noexcept {
  return r.out;
}
// The tier only ever reads from a write request's buffer; one pointer type keeps one code path.
inline std::byte* request_buffer(const block_write& w) noexcept {
  return const_cast<std::byte*>(w.in);
}

[[noreturn]] inline void raise_io(io_dir d, slot_id s, std::uint64_t offset, std::size_t len,
                                  int err) {
  raise(errc::io_error, "file_tier: ", d == io_dir::read ? "read" : "write", " of slot ", s,
        " at offset ", offset, " (", len, " bytes) failed: ", std::strerror(err));
}

[[noreturn]] inline void raise_short(io_dir d, slot_id s, std::uint64_t offset, std::size_t done,
                                     std::size_t len) {
  raise(errc::io_error, "file_tier: short ", d == io_dir::read ? "read" : "write", " of slot ", s,
        " at offset ", offset, ": ", done, " of ", len, " bytes (",
        d == io_dir::read ? "end of file" : "no space written", ")");
}

//! @brief Where a request's bytes go to or come from, and how many: the caller's buffer, or a
//! bounce buffer holding the whole aligned slot.
struct io_target {
  std::byte* buf;
  std::size_t len;
  bool bounced;
};

//! Prepares one request: for a bounced write, copies the block in and zeroes the padding (so the
//! file never holds stale bytes past a block).
inline io_target prepare(const file_geometry& g, io_dir d, std::byte* user, std::byte* bounce) {
  if (!g.needs_bounce(user)) {
    return {user, g.block_bytes, false};
  }
  if (d == io_dir::write) {
    std::memcpy(bounce, user, g.block_bytes);
    std::memset(bounce + g.block_bytes, 0, g.stride - g.block_bytes);
  }
  return {bounce, g.stride, true};
}

//! Finishes one request: a bounced read hands the block to the caller.
inline void finish(const file_geometry& g, io_dir d, std::byte* user, const io_target& t) {
  if (t.bounced && d == io_dir::read) {
    std::memcpy(user, t.buf, g.block_bytes);
  }
}

//! @brief One block by pread/pwrite on the calling thread; resumes after short transfers and
//! EINTR, throws `errc::io_error` on failure.
inline void transfer_sync(const file_geometry& g, io_dir d, slot_id s, std::byte* user,
                          aligned_buffer& bounce) {
  const std::uint64_t off = g.offset(s);
  const io_target t = prepare(g, d, user, g.needs_bounce(user) ? bounce.ensure(g.stride) : nullptr);
  std::size_t done = 0;
  while (done < t.len) {
    const auto pos = static_cast<off_t>(off + done);
    const ssize_t r = d == io_dir::read ? ::pread(g.fd, t.buf + done, t.len - done, pos)
                                        : ::pwrite(g.fd, t.buf + done, t.len - done, pos);
    if (r < 0) {
      if (errno == EINTR) {
        continue;
      }
      raise_io(d, s, off, t.len, errno);
    }
    if (r == 0) {
      raise_short(d, s, off, done, t.len);
    }
    done += static_cast<std::size_t>(r);
  }
  finish(g, d, user, t);
}

//! @brief Objects (rings, bounce buffers) handed to one caller at a time and kept for the next,
//! so a call allocates nothing once the pool has warmed up.
template <class T>
class lease_pool {
 public:
  class lease {
   public:
    lease(lease_pool* pool, std::unique_ptr<T> obj) : pool_(pool), obj_(std::move(obj)) {}
    lease(lease&&) = delete;
    ~lease() {
      if (obj_) {
        pool_->put_back(std::move(obj_));
      }
    }
    T& operator*() const noexcept { return *obj_; }
    T* operator->() const noexcept { return obj_.get(); }
    //! The object is in an unknown state: destroy it rather than hand it out again.
    void discard() noexcept { obj_.reset(); }

   private:
    lease_pool* pool_;
    std::unique_ptr<T> obj_;
  };

  //! A free object, or `make()` when none is free.
  template <class Make>
  std::unique_ptr<T> take(Make&& make) {
    {
      std::lock_guard lock(mutex_);
      if (!free_.empty()) {
        std::unique_ptr<T> obj = std::move(free_.back());
        free_.pop_back();
        return obj;
      }
    }
    return make();
  }
  void put_back(std::unique_ptr<T> obj) noexcept {
    std::lock_guard lock(mutex_);
    try {
      free_.push_back(std::move(obj));
    } catch (...) {
      // No room to keep it: it is destroyed, and the next caller makes a new one.
    }
  }

 private:
  std::mutex mutex_;
  std::vector<std::unique_ptr<T>> free_;
};

//! @brief The backing file: an unlinked temporary file in a directory, or a named file.
struct backing_file {
  unique_fd fd;
  bool direct = false;
  bool temporary = false;
  bool had_data = false;  //!< a named file that existed with a non-zero size
};

inline std::string parent_directory(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) {
    return ".";
  }
  return slash == 0 ? "/" : path.substr(0, slash);
}

//! Opens (or creates) the backing file, turns on O_DIRECT where the filesystem allows it, and
//! reserves `bytes` so that a full disk shows at construction rather than mid-transfer.
inline backing_file open_backing_file(const std::string& path, bool want_direct,
                                      std::uint64_t bytes) {
  if (path.empty()) [[unlikely]] {
    raise(errc::invalid_argument, "file_tier_options.path is empty (give a directory or a file)");
  }
  backing_file f;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    f.temporary = true;
    // O_TMPFILE leaves no name behind even if the process dies; mkstemp + unlink covers
    // filesystems without it, with a short window in which the name exists.
    int fd = ::open(path.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
      std::string name = path + "/oasiskv-file-tier-XXXXXX";
      fd = ::mkostemp(name.data(), O_CLOEXEC);
      if (fd >= 0) {
        ::unlink(name.c_str());
      }
    }
    if (fd < 0) [[unlikely]] {
      raise(errc::io_error, "file_tier: cannot create a temporary file in directory '", path,
            "': ", std::strerror(errno));
    }
    f.fd = unique_fd(fd);
  } else if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    raise(errc::invalid_argument, "file_tier_options.path = '", path,
          "' is neither a directory nor a regular file");
  } else {
    const std::string dir = parent_directory(path);
    struct stat dst {};
    if (::stat(dir.c_str(), &dst) != 0 || !S_ISDIR(dst.st_mode)) [[unlikely]] {
      raise(errc::invalid_argument, "file_tier_options.path = '", path, "': directory '", dir,
            "' does not exist");
    }
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) [[unlikely]] {
      raise(errc::io_error, "file_tier: cannot open '", path, "': ", std::strerror(errno));
    }
    f.fd = unique_fd(fd);
    // Two tiers writing one file would corrupt each other's blocks.
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) [[unlikely]] {
      raise(errc::io_error, "file_tier: '", path,
            "' is locked by another user: ", std::strerror(errno));
    }
    struct stat fst {};
    f.had_data = ::fstat(fd, &fst) == 0 && fst.st_size > 0;
  }
  if (want_direct) {
    // Setting O_DIRECT after open lets one code path open the file; filesystems without direct
    // I/O (tmpfs before Linux 6.6, some FUSE mounts) answer EINVAL, and we go buffered.
    const int flags = ::fcntl(f.fd.get(), F_GETFL);
    if (flags >= 0 && ::fcntl(f.fd.get(), F_SETFL, flags | O_DIRECT) == 0) {
      f.direct = true;
    } else if (errno != EINVAL) [[unlikely]] {
      raise(errc::io_error, "file_tier: cannot enable O_DIRECT on '", path,
            "': ", std::strerror(errno));
    }
  }
  if (bytes > 0) {
    // fallocate never shrinks an existing file and reserves the blocks, so a full disk shows
    // here rather than mid-transfer; ftruncate covers filesystems without it (the file is then
    // sparse). Not posix_fallocate: its fallback writes single bytes, which O_DIRECT refuses.
    int r = ::fallocate(f.fd.get(), 0, 0, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
    if (r == EOPNOTSUPP || r == ENOSYS) {
      struct stat fst {};
      if (::fstat(f.fd.get(), &fst) != 0) {
        r = errno;
      } else if (static_cast<std::uint64_t>(fst.st_size) >= bytes) {
        r = 0;
      } else {
        r = ::ftruncate(f.fd.get(), static_cast<off_t>(bytes)) == 0 ? 0 : errno;
      }
    }
    if (r != 0) [[unlikely]] {
      raise(errc::io_error, "file_tier: cannot reserve ", bytes, " bytes in '", path,
            "': ", std::strerror(r));
    }
  }
  return f;
}

}  // namespace oasiskv::detail
