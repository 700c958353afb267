// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Read-only file mapping and page-aligned buffers: what the loaders keep the weights in.
#pragma once

#include <cstddef>
#include <string>
#include <utility>

namespace mini_decoder {

//! A read-only memory map of a whole file: model weights are used in place (the products' panel
//! copies, `pack_weight_panels`, aside).
class mapped_file {
 public:
  mapped_file() = default;
  explicit mapped_file(const std::string& path);
  mapped_file(mapped_file&& o) noexcept { swap(o); }
  mapped_file& operator=(mapped_file&& o) noexcept {
    swap(o);
    return *this;
  }
  mapped_file(const mapped_file&) = delete;
  mapped_file& operator=(const mapped_file&) = delete;
  ~mapped_file();

  const std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  const std::string& path() const noexcept { return path_; }

 private:
  void swap(mapped_file& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    std::swap(path_, o.path_);
  }
  const std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  std::string path_;
};

//! Zero-filled, page-aligned anonymous memory, with transparent huge pages asked for (fewer TLB
//! misses when a product streams it): the weights repacked at load live here.
class page_buffer {
 public:
  page_buffer() = default;
  explicit page_buffer(std::size_t bytes);
  page_buffer(page_buffer&& o) noexcept { swap(o); }
  page_buffer& operator=(page_buffer&& o) noexcept {
    swap(o);
    return *this;
  }
  page_buffer(const page_buffer&) = delete;
  page_buffer& operator=(const page_buffer&) = delete;
  ~page_buffer();

  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }

 private:
  void swap(page_buffer& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
  }
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace mini_decoder
