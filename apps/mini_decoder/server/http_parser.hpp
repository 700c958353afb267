// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The head of an HTTP/1.x request, read and checked strictly (RFC 9112): the request
//! line, the header fields, and what they say about the body. A pure function of the bytes, so
//! that every malformed head is a unit test.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include <mini_decoder/server/http_message.hpp>

namespace mini_decoder::serving {

//! The limits a head is read under.
struct head_limits {
  std::size_t max_header_bytes = 16 * 1024;  //!< request line + fields + the blank line
  std::size_t max_headers = 64;              //!< header fields
};

//! Where a head ends in `in`: the offset just past its blank line (CRLF CRLF, or bare LFs,
//! which RFC 9112 lets a server accept), or npos when it has not arrived. `from` is where the
//! previous search stopped (the search resumes a little before it).
std::size_t head_end(std::string_view in, std::size_t from);

//! A head that was read: the request without its body, and what its fields say of the body.
struct request_head {
  http_request request;
  std::size_t content_length = 0;
  bool keep_alive = true;        //!< HTTP/1.1 without `Connection: close`; HTTP/1.0 never
  bool expect_continue = false;  //!< `Expect: 100-continue`
};

//! A head refused: the status to answer with (the connection then closes) and why.
struct head_error {
  int status = 400;
  std::string message;
};

//! Reads `head` (up to and including its blank line). Refuses, naming the reason: a malformed
//! request line or field (400), a target that is not a path (400), an HTTP version other than
//! 1.0 and 1.1 (505), more than `max_headers` fields or a head longer than `max_header_bytes`
//! (431), HTTP/1.1 without exactly one `Host` (400), `Transfer-Encoding` (chunked: 411, as
//! bodies must have a `Content-Length`; else 501; with `Content-Length` too: 400, the request
//! smuggling case), a `Content-Length` that is not one decimal number or two that differ (400),
//! an `Expect` other than 100-continue (417).
std::optional<head_error> parse_head(std::string_view head, const head_limits& limits,
                                     request_head& out);

//! The reason phrase of `status` ("OK", "Not Found", ...).
const char* reason_phrase(int status);

}  // namespace mini_decoder::serving
