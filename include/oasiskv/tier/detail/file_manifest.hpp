// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The manifest beside a named `file_tier` file (`<path>.oasiskv`): the layout its blocks
//! were written with, and whether the last tier that used it closed it with every write on the
//! device. A tier refuses a file whose manifest disagrees with its layout or says writes were
//! lost, so no block is ever read back stale or with another shape. Not part of the public API.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/layout.hpp"

namespace oasiskv::detail {

//! @brief What a manifest records.
struct file_manifest {
  kv_layout layout{};
  std::uint64_t slot_bytes = 0;
  std::uint32_t slots = 0;
  //! `clean`: every write on the device and synced; `open`: a tier uses the file (or died
  //! using it); `lost`: `lost_writes` writes the device refused were dropped; `unsynced`: the
  //! final sync failed.
  std::string state = "open";
  bool write_behind = false;      //!< with `open`: the tier wrote behind (writes may be lost)
  std::uint64_t lost_writes = 0;  //!< with `lost`

  static std::string path_for(const std::string& data_path) { return data_path + ".oasiskv"; }

  std::string text() const {
    std::ostringstream o;
    o << "oasiskv file_tier 1\n"
      << "layout " << layout.num_layers << ' ' << layout.num_q_heads << ' ' << layout.num_kv_heads
      << ' ' << layout.head_dim << ' ' << layout.tokens_per_block << ' '
      << to_string(layout.kv_dtype) << '\n'
      << "slot_bytes " << slot_bytes << '\n'
      << "slots " << slots << '\n'
      << "state " << state;
    if (state == "open") {
      o << (write_behind ? " write_behind" : " write_through");
    } else if (state == "lost") {
      o << ' ' << lost_writes;
    }
    o << '\n';
    return o.str();
  }

  //! @brief Parses `path`; throws `errc::invalid_argument` naming the file and the first line
  //! it cannot read.
  static file_manifest read(const std::string& path) {
    std::ifstream in(path);
    if (!in) [[unlikely]] {
      raise(errc::io_error, "file_tier: cannot read the manifest '", path,
            "': ", std::strerror(errno));
    }
    auto bad = [&](const std::string& what) {
      raise(errc::invalid_argument, "file_tier: the manifest '", path, "' is not one this ",
            "version writes (", what, ")");
    };
    std::string line, word;
    file_manifest m;
    if (!std::getline(in, line) || line != "oasiskv file_tier 1") {
      bad("first line '" + line + "'");
    }
    std::string dt;
    if (!std::getline(in, line)) {
      bad("no layout line");
    }
    {
      std::istringstream l(line);
      if (!(l >> word >> m.layout.num_layers >> m.layout.num_q_heads >> m.layout.num_kv_heads >>
            m.layout.head_dim >> m.layout.tokens_per_block >> dt) ||
          word != "layout") {
        bad("layout line '" + line + "'");
      }
      bool known = false;
      for (const dtype d : {dtype::f32, dtype::f16, dtype::bf16}) {
        if (dt == to_string(d)) {
          m.layout.kv_dtype = d;
          known = true;
        }
      }
      if (!known) {
        bad("dtype '" + dt + "'");
      }
    }
    if (!std::getline(in, line) || !(std::istringstream(line) >> word >> m.slot_bytes) ||
        word != "slot_bytes") {
      bad("slot_bytes line '" + line + "'");
    }
    if (!std::getline(in, line) || !(std::istringstream(line) >> word >> m.slots) ||
        word != "slots") {
      bad("slots line '" + line + "'");
    }
    if (!std::getline(in, line)) {
      bad("no state line");
    }
    std::istringstream st(line);
    std::string extra;
    if (!(st >> word >> m.state) || word != "state") {
      bad("state line '" + line + "'");
    }
    if (m.state == "open") {
      st >> extra;
      m.write_behind = extra == "write_behind";
    } else if (m.state == "lost") {
      st >> m.lost_writes;
    } else if (m.state != "clean" && m.state != "unsynced") {
      bad("state '" + m.state + "'");
    }
    return m;
  }

  //! @brief Replaces the manifest at `path` (a temporary file renamed over it, so a reader sees
  //! the old or the new one whole). Returns false, with `errno`, where the system refused.
  bool write(const std::string& path) const noexcept {
    try {
      const std::string tmp = path + ".tmp";
      const std::string body = text();
      const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      if (fd < 0) {
        return false;
      }
      const bool ok = ::write(fd, body.data(), body.size()) == static_cast<ssize_t>(body.size()) &&
                      ::fsync(fd) == 0;
      const int saved = errno;
      ::close(fd);
      if (!ok) {
        ::unlink(tmp.c_str());
        errno = saved;
        return false;
      }
      return ::rename(tmp.c_str(), path.c_str()) == 0;
    } catch (...) {
      errno = ENOMEM;
      return false;
    }
  }
};

//! @brief Checks the manifest of the named file `data_path` before a tier of `layout` and
//! `slot_bytes` uses it, then records the tier as using it. `had_data`: the file existed with a
//! non-zero size. Throws `errc::layout_mismatch` (blocks of another shape),
//! `errc::io_error` (writes were lost, or the last tier writing behind did not close it),
//! `errc::invalid_argument` (data without a manifest, or a manifest this version cannot read).
inline void adopt_manifest(const std::string& data_path, bool had_data, const kv_layout& layout,
                           std::uint64_t slot_bytes, std::uint32_t slots, bool write_behind) {
  const std::string path = file_manifest::path_for(data_path);
  const bool exists = ::access(path.c_str(), F_OK) == 0;
  if (had_data && !exists) [[unlikely]] {
    raise(errc::invalid_argument, "file_tier: '", data_path, "' holds data but has no manifest '",
          path, "' beside it, so the layout of its blocks is unknown (remove the file to start ",
          "afresh)");
  }
  if (had_data) {
    const file_manifest m = file_manifest::read(path);
    if (!(m.layout == layout) || m.slot_bytes != slot_bytes) [[unlikely]] {
      raise(errc::layout_mismatch, "file_tier: '", data_path, "' holds blocks of layout ",
            m.layout.num_layers, "x", m.layout.num_q_heads, "x", m.layout.num_kv_heads, "x",
            m.layout.head_dim, "x", m.layout.tokens_per_block, " ", to_string(m.layout.kv_dtype),
            " (", m.slot_bytes, "-byte slots); this tier's is ", layout.num_layers, "x",
            layout.num_q_heads, "x", layout.num_kv_heads, "x", layout.head_dim, "x",
            layout.tokens_per_block, " ", to_string(layout.kv_dtype), " (", slot_bytes,
            "-byte slots)");
    }
    if (m.state == "lost") [[unlikely]] {
      raise(errc::io_error, "file_tier: '", data_path, "': the tier that last used it could not ",
            "write ", m.lost_writes, " block(s), so its content is stale (remove the file to ",
            "start afresh)");
    }
    if (m.state == "unsynced") [[unlikely]] {
      raise(errc::io_error, "file_tier: '", data_path, "': the tier that last used it could not ",
            "sync it to the device, so its content may be stale (remove the file to start ",
            "afresh)");
    }
    if (m.state == "open" && m.write_behind) [[unlikely]] {
      raise(errc::io_error, "file_tier: '", data_path, "': the tier that last used it wrote ",
            "behind and did not close it (the process died?), so writes may be lost (remove ",
            "the file to start afresh)");
    }
  }
  file_manifest m;
  m.layout = layout;
  m.slot_bytes = slot_bytes;
  m.slots = slots;
  m.state = "open";
  m.write_behind = write_behind;
  if (!m.write(path)) [[unlikely]] {
    raise(errc::io_error, "file_tier: cannot write the manifest '", path,
          "': ", std::strerror(errno));
  }
}

}  // namespace oasiskv::detail
