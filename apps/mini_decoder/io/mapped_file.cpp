// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/io/mapped_file.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <mini_decoder/io/error.hpp>

namespace mini_decoder {

mapped_file::mapped_file(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    fail("cannot open model file '", path, "': ", std::strerror(errno), fetch_hint);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("model path '", path, "' is not a regular file", fetch_hint);
  }
  size_ = static_cast<std::size_t>(st.st_size);
  if (size_ == 0) {
    ::close(fd);
    fail("model file '", path, "' is empty", fetch_hint);
  }
  void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);  // the mapping keeps the file alive
  if (p == MAP_FAILED) {
    fail("cannot map model file '", path, "': ", std::strerror(errno));
  }
  data_ = static_cast<const std::byte*>(p);
}

mapped_file::~mapped_file() {
  if (data_ != nullptr) {
    ::munmap(const_cast<std::byte*>(data_), size_);
  }
}

page_buffer::page_buffer(std::size_t bytes) : size_(bytes) {
  if (bytes == 0) {
    return;
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    size_ = 0;
    fail("cannot allocate ", bytes, " bytes: ", std::strerror(errno));
  }
#ifdef MADV_HUGEPAGE
  ::madvise(p, bytes, MADV_HUGEPAGE);  // advisory: without THP the pages are just smaller
#endif
  data_ = static_cast<std::byte*>(p);
}

page_buffer::~page_buffer() {
  if (data_ != nullptr) {
    ::munmap(data_, size_);
  }
}

}  // namespace mini_decoder
