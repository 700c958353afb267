// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Blocking TCP helpers for the control channel, every wait bounded by a deadline.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "oasiskv/core/error.hpp"
#include "oasiskv/disagg/protocol.hpp"

namespace oasiskv::disagg {

using steady = std::chrono::steady_clock;

//! @brief Owns a file descriptor.
class fd_handle {
 public:
  fd_handle() = default;
  explicit fd_handle(int fd) noexcept : fd_(fd) {}
  fd_handle(fd_handle&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  fd_handle& operator=(fd_handle&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~fd_handle() { reset(); }
  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  void reset() noexcept {
    if (fd_ >= 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }

 private:
  int fd_ = -1;
};

namespace detail {
[[noreturn]] inline void raise_errno(const char* what, const std::string& peer) {
  const int e = errno;
  oasiskv::detail::raise(errc::io_error, "control channel ", peer, ": ", what,
                         " failed: ", std::strerror(e));
}
inline int ms_left(steady::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - steady::now()).count();
  return left < 0 ? 0 : static_cast<int>(left);
}
}  // namespace detail

//! @brief A socket listening on `address:port` (port 0: any free port). The exporter binds to
//! loopback unless told otherwise.
inline fd_handle listen_tcp(const std::string& address, std::uint16_t port,
                            std::uint16_t& bound_port) {
  fd_handle fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) {
    detail::raise_errno("socket", address);
  }
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  if (::inet_pton(AF_INET, address.c_str(), &sa.sin_addr) != 1) [[unlikely]] {
    oasiskv::detail::raise(errc::invalid_argument, "listen address '", address,
                           "' is not an IPv4 address");
  }
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
    detail::raise_errno("bind", address + ":" + std::to_string(port));
  }
  if (::listen(fd.get(), 64) != 0) {
    detail::raise_errno("listen", address);
  }
  socklen_t len = sizeof sa;
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&sa), &len);
  bound_port = ntohs(sa.sin_port);
  return fd;
}

//! @brief Connects to `address:port` within `timeout`.
inline fd_handle connect_tcp(const std::string& address, std::uint16_t port,
                             std::chrono::milliseconds timeout) {
  const std::string peer = address + ":" + std::to_string(port);
  fd_handle fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) {
    detail::raise_errno("socket", peer);
  }
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  if (::inet_pton(AF_INET, address.c_str(), &sa.sin_addr) != 1) [[unlikely]] {
    oasiskv::detail::raise(errc::invalid_argument, "exporter address '", address,
                           "' is not an IPv4 address");
  }
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
    if (errno != EINPROGRESS) {
      detail::raise_errno("connect", peer);
    }
    pollfd p{fd.get(), POLLOUT, 0};
    if (::poll(&p, 1, static_cast<int>(timeout.count())) != 1) {
      oasiskv::detail::raise(errc::io_error, "control channel ", peer, ": connect timed out after ",
                             timeout.count(), " ms");
    }
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      errno = err;
      detail::raise_errno("connect", peer);
    }
  }
  int one = 1;
  ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

//! @brief Sends all of `data` before `deadline`; the socket may be non-blocking.
inline void send_all(int fd, std::span<const std::byte> data, steady::time_point deadline,
                     const std::string& peer) {
  std::size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EINTR) {
      detail::raise_errno("send", peer);
    }
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, detail::ms_left(deadline)) == 0) {
      oasiskv::detail::raise(errc::io_error, "control channel ", peer, ": send timed out");
    }
  }
}

//! @brief Receives exactly `out.size()` bytes before `deadline`. A closed peer throws.
inline void recv_all(int fd, std::span<std::byte> out, steady::time_point deadline,
                     const std::string& peer) {
  std::size_t done = 0;
  while (done < out.size()) {
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, detail::ms_left(deadline));
    if (ready == 0) {
      oasiskv::detail::raise(errc::io_error, "control channel ", peer, ": receive timed out");
    }
    if (ready < 0) {
      if (errno == EINTR) {
        continue;
      }
      detail::raise_errno("poll", peer);
    }
    const ssize_t n = ::recv(fd, out.data() + done, out.size() - done, 0);
    if (n == 0) {
      oasiskv::detail::raise(errc::io_error, "control channel ", peer, ": closed by the peer");
    }
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) {
        continue;
      }
      detail::raise_errno("recv", peer);
    }
    done += static_cast<std::size_t>(n);
  }
}

//! @brief One validated frame: header checked, payload parsed.
struct received_frame {
  frame_header header;
  message body;
};

inline received_frame recv_frame(int fd, steady::time_point deadline, const std::string& peer) {
  std::array<std::byte, header_bytes> hb;
  recv_all(fd, hb, deadline, peer);
  received_frame f;
  f.header = decode_header(hb);
  std::vector<std::byte> payload(f.header.payload_bytes);
  recv_all(fd, payload, deadline, peer);
  f.body = parse_payload(f.header.type, payload);
  return f;
}

}  // namespace oasiskv::disagg
