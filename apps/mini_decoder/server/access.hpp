// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Who may use the server, checked on each request's head before its body is read: the
//! API key (a bearer token, compared in constant time), the `Host` a loopback server answers
//! to (a page that rebinds its DNS name to 127.0.0.1 sends its own), the `Origin` of browser
//! pages, and JSON bodies (a page may send `text/plain` or a form to any address without asking
//! first; JSON it may not).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <mini_decoder/server/http_message.hpp>

namespace mini_decoder::serving {

struct access_policy {
  std::string api_key;  //!< empty: no key asked
  //! `Host` values accepted besides the loopback names (localhost, 127.0.0.0/8, [::1]), any
  //! port. When it is empty and the server listens on a loopback address, only those are.
  std::vector<std::string> allowed_hosts;
  bool loopback_only_hosts = true;           //!< the server listens on loopback (see above)
  std::vector<std::string> allowed_origins;  //!< `Origin` values accepted (exact); else none
};

//! Whether `a` and `b` are equal, in time that depends on their lengths alone.
bool constant_time_equal(std::string_view a, std::string_view b);

//! Whether `host` (a Host header: name or address, optional port) names this machine's
//! loopback: localhost, 127.0.0.0/8 or [::1].
bool is_loopback_host(std::string_view host);

//! Whether `address` (a listening address: name or literal) is a loopback one.
bool is_loopback_address(const std::string& address);

//! Checks a request's head against `p`: 403 for a Host or Origin not accepted, 401 (OpenAI's
//! `invalid_api_key`) without the right `Authorization: Bearer` key except on /health and
//! /metrics, 415 for a POST body that is not `application/json`. The response is the refusal's
//! (OpenAI-style JSON error); nullopt lets the request through.
std::optional<http_response> check_access(const access_policy& p, const http_request& r);

}  // namespace mini_decoder::serving
