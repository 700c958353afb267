// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/server/access.hpp>

#include <arpa/inet.h>

#include <algorithm>
#include <cctype>

#include <mini_decoder/server/openai.hpp>

namespace mini_decoder::serving {

namespace {

std::string lower(std::string_view s) {
  std::string r(s);
  for (char& c : r) {
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  return r;
}

// The host part of a Host value: "name:port" -> name, "[::1]:8080" -> ::1.
std::string host_part(std::string_view h) {
  if (!h.empty() && h.front() == '[') {
    const std::size_t close = h.find(']');
    return close == std::string_view::npos ? std::string(h) : std::string(h.substr(1, close - 1));
  }
  const std::size_t colon = h.find(':');
  return std::string(colon == std::string_view::npos ? h : h.substr(0, colon));
}

http_response refusal(int status, const std::string& message, const char* code) {
  http_response r;
  r.status = status;
  request_error e{status, message, "", "invalid_request_error", code};
  r.body = dump(error_json(e));
  if (status == 401) {
    r.headers.emplace_back("WWW-Authenticate", "Bearer");
  }
  return r;
}

}  // namespace

bool constant_time_equal(std::string_view a, std::string_view b) {
  volatile unsigned char diff = a.size() == b.size() ? 0 : 1;
  const std::size_t n = std::max(a.size(), b.size());
  for (std::size_t i = 0; i < n; ++i) {
    const auto x = static_cast<unsigned char>(i < a.size() ? a[i] : 0);
    const auto y = static_cast<unsigned char>(i < b.size() ? b[i] : 0);
    diff = diff | static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

bool is_loopback_host(std::string_view host) {
  return is_loopback_address(host_part(host));
}

bool is_loopback_address(const std::string& address) {
  const std::string a = lower(address);
  if (a == "localhost" || a.ends_with(".localhost") || a == "::1") {
    return true;
  }
  in_addr v4{};
  if (inet_pton(AF_INET, a.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  return false;
}

std::optional<http_response> check_access(const access_policy& p, const http_request& r) {
  if (const std::string* host = r.header("host"); host != nullptr) {
    const std::string name = lower(host_part(*host));
    const bool listed = std::any_of(p.allowed_hosts.begin(), p.allowed_hosts.end(),
                                    [&](const std::string& h) { return lower(h) == name; });
    if (!listed && (p.loopback_only_hosts || !p.allowed_hosts.empty()) &&
        !is_loopback_host(*host)) {
      return refusal(403,
                     "Host '" + *host +
                         "' is not served here (a loopback server answers to localhost and "
                         "127.0.0.1; add names with --allowed-host)",
                     "host_not_allowed");
    }
  }
  if (const std::string* origin = r.header("origin"); origin != nullptr) {
    if (std::find(p.allowed_origins.begin(), p.allowed_origins.end(), *origin) ==
        p.allowed_origins.end()) {
      return refusal(403,
                     "requests from web pages (Origin '" + *origin +
                         "') are refused; allow one with --allowed-origin",
                     "origin_not_allowed");
    }
  }
  if (!p.api_key.empty() && r.path != "/health" && r.path != "/metrics") {
    const std::string* auth = r.header("authorization");
    std::string_view given;
    if (auth != nullptr && auth->size() > 7 && lower(auth->substr(0, 7)) == "bearer ") {
      given = std::string_view(*auth).substr(7);
    }
    if (!constant_time_equal(given, p.api_key)) {
      return refusal(401,
                     auth == nullptr ? "no API key: send 'Authorization: Bearer <key>'"
                                     : "incorrect API key provided",
                     "invalid_api_key");
    }
  }
  if (r.method == "POST") {
    const std::string* type = r.header("content-type");
    const std::string media =
        type == nullptr ? std::string() : lower(type->substr(0, type->find(';')));
    const std::size_t end = media.find_last_not_of(" \t");
    if (end == std::string::npos || media.substr(0, end + 1) != "application/json") {
      return refusal(415,
                     "the body must be JSON with 'Content-Type: application/json' (got " +
                         (type == nullptr ? std::string("none") : "'" + *type + "'") + ")",
                     "unsupported_media_type");
    }
  }
  return std::nullopt;
}

}  // namespace mini_decoder::serving
