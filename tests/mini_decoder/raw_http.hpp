// SPDX-License-Identifier: Apache-2.0
// A raw HTTP/1.x client for the server's tests: a TCP connection from a chosen loopback address
// (127.0.0.x: a distinct client to the server), bytes sent as they are, answers read whole or
// until the server closes. Every wait is bounded.
#pragma once

#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <string_view>

namespace mini_decoder::test {

using clock_type = std::chrono::steady_clock;
inline double since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

// A raw TCP client from `from` (a loopback address: a distinct client).
struct raw {
  int fd = -1;
  explicit raw(int port, const char* from = "127.0.0.1") {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(fd >= 0);
    sockaddr_in src{};
    src.sin_family = AF_INET;
    inet_pton(AF_INET, from, &src.sin_addr);
    REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof src) == 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  }
  ~raw() { close(); }
  raw(const raw&) = delete;
  raw& operator=(const raw&) = delete;
  void close() {
    if (fd >= 0) {
      ::close(fd);
      fd = -1;
    }
  }
  bool send(std::string_view s) {
    while (!s.empty()) {
      const ssize_t n = ::send(fd, s.data(), s.size(), MSG_NOSIGNAL);
      if (n <= 0) {
        return false;
      }
      s.remove_prefix(static_cast<std::size_t>(n));
    }
    return true;
  }
  // Appends what arrives within `timeout` seconds to `got`; false at EOF or error.
  bool read_some(std::string& got, double timeout) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(timeout * 1000)) <= 0) {
      return true;  // nothing yet
    }
    char buf[65536];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) {
      return false;
    }
    got.append(buf, static_cast<std::size_t>(n));
    return true;
  }
  // Everything until the server closes, at most `timeout` seconds.
  std::string until_closed(double timeout, bool* closed = nullptr) {
    std::string got;
    const auto t0 = clock_type::now();
    bool open = true;
    while (open && since(t0) < timeout) {
      open = read_some(got, 0.05);
    }
    if (closed != nullptr) {
      *closed = !open;
    }
    return got;
  }
  // One whole response (Content-Length or chunked), at most `timeout` seconds; "" if none.
  std::string response(double timeout = 10) {
    const auto t0 = clock_type::now();
    while (since(t0) < timeout) {
      const std::size_t end = buffer.find("\r\n\r\n");
      if (end != std::string::npos) {
        const std::string head = buffer.substr(0, end + 4);
        const std::size_t cl = head.find("Content-Length: ");
        if (cl != std::string::npos) {
          const std::size_t len = std::stoul(head.substr(cl + 16));
          if (buffer.size() >= end + 4 + len) {
            std::string r = buffer.substr(0, end + 4 + len);
            buffer.erase(0, end + 4 + len);
            return r;
          }
        } else if (head.find("chunked") != std::string::npos) {
          const std::size_t last = buffer.find("\r\n0\r\n\r\n", end);
          if (last != std::string::npos) {
            std::string r = buffer.substr(0, last + 7);
            buffer.erase(0, last + 7);
            return r;
          }
        }
      }
      if (!read_some(buffer, 0.05)) {
        std::string r = buffer;
        buffer.clear();
        return r;
      }
    }
    return {};
  }
  std::string buffer;
};

inline int status_of(const std::string& response) {
  if (response.rfind("HTTP/1.1 ", 0) != 0 || response.size() < 12) {
    return 0;
  }
  return std::stoi(response.substr(9, 3));
}

inline std::string body_of(const std::string& response) {
  const std::size_t end = response.find("\r\n\r\n");
  return end == std::string::npos ? std::string() : response.substr(end + 4);
}

inline std::string get(const std::string& path, const std::string& extra = "") {
  return "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n" + extra + "\r\n";
}

inline std::string post(const std::string& path, const std::string& body,
                        const std::string& extra = "") {
  return "POST " + path +
         " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: " + std::to_string(body.size()) + "\r\n" +
         extra + "\r\n" + body;
}

// A chunked body (after the head) as its plain bytes.
inline std::string dechunk(const std::string& body) {
  std::string out;
  std::size_t at = 0;
  while (at < body.size()) {
    const std::size_t eol = body.find("\r\n", at);
    if (eol == std::string::npos) {
      break;
    }
    const std::size_t n = std::stoul(body.substr(at, eol - at), nullptr, 16);
    if (n == 0) {
      break;
    }
    out += body.substr(eol + 2, n);
    at = eol + 2 + n + 2;
  }
  return out;
}

}  // namespace mini_decoder::test
