// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Bounds-checked little-endian encoding for the disaggregation control protocol. Every
//! read is checked against what is left, so a hostile or truncated message raises
//! `oasiskv::error` instead of reading past the buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "oasiskv/core/error.hpp"

namespace oasiskv::disagg {

//! @brief Appends little-endian fields to a byte vector.
class wire_writer {
 public:
  explicit wire_writer(std::vector<std::byte>& out) : out_(out) {}
  void u8(std::uint8_t v) { out_.push_back(std::byte{v}); }
  void u16(std::uint16_t v) { put(v, 2); }
  void u32(std::uint32_t v) { put(v, 4); }
  void u64(std::uint64_t v) { put(v, 8); }
  void bytes(std::span<const std::byte> b) { out_.insert(out_.end(), b.begin(), b.end()); }
  //! @brief A u32 length, then the bytes.
  void blob(std::span<const std::byte> b) {
    u32(static_cast<std::uint32_t>(b.size()));
    bytes(b);
  }
  void str(std::string_view s) { blob(std::as_bytes(std::span(s.data(), s.size()))); }

 private:
  void put(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) {
      out_.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xff));
    }
  }
  std::vector<std::byte>& out_;
};

//! @brief Reads little-endian fields from a span; any read past the end throws
//! `errc::invalid_argument` naming the field.
class wire_reader {
 public:
  explicit wire_reader(std::span<const std::byte> in) : in_(in) {}
  std::uint8_t u8(const char* field) { return static_cast<std::uint8_t>(get(1, field)); }
  std::uint16_t u16(const char* field) { return static_cast<std::uint16_t>(get(2, field)); }
  std::uint32_t u32(const char* field) { return static_cast<std::uint32_t>(get(4, field)); }
  std::uint64_t u64(const char* field) { return get(8, field); }
  std::span<const std::byte> bytes(std::size_t n, const char* field) {
    need(n, field);
    auto s = in_.subspan(pos_, n);
    pos_ += n;
    return s;
  }
  //! @brief A u32 length (at most `max`), then that many bytes.
  std::span<const std::byte> blob(std::size_t max, const char* field) {
    const std::uint32_t n = u32(field);
    if (n > max) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "control message: ", field, " length ", n,
                             " exceeds the limit ", max);
    }
    return bytes(n, field);
  }
  std::string str(std::size_t max, const char* field) {
    auto b = blob(max, field);
    return std::string(reinterpret_cast<const char*>(b.data()), b.size());
  }
  std::size_t remaining() const noexcept { return in_.size() - pos_; }
  //! @brief Throws unless every byte was consumed: trailing bytes mean a malformed message.
  void finish(const char* what) const {
    if (remaining() != 0) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "control message ", what, ": ", remaining(),
                             " trailing bytes");
    }
  }

 private:
  void need(std::size_t n, const char* field) const {
    if (n > remaining()) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "control message truncated reading ", field,
                             " (", n, " bytes needed, ", remaining(), " left)");
    }
  }
  std::uint64_t get(int n, const char* field) {
    need(static_cast<std::size_t>(n), field);
    std::uint64_t v = 0;
    for (int i = 0; i < n; ++i) {
      v |= static_cast<std::uint64_t>(in_[pos_ + static_cast<std::size_t>(i)]) << (8 * i);
    }
    pos_ += static_cast<std::size_t>(n);
    return v;
  }
  std::span<const std::byte> in_;
  std::size_t pos_ = 0;
};

}  // namespace oasiskv::disagg
