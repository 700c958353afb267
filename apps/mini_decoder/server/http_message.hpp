// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief HTTP/1.1 requests and responses as the server's handlers see them, and the two
//! interfaces of an answer that comes later (a generation waiting for the engine, or a stream).
//! No sockets here (http_server.hpp) and no JSON.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mini_decoder::serving {

using header_list = std::vector<std::pair<std::string, std::string>>;

//! A request whose head and body have arrived whole.
struct http_request {
  std::string method;   //!< as sent (methods are case-sensitive)
  std::string target;   //!< the request target: path and query
  std::string path;     //!< the target before any '?'
  std::string query;    //!< after the '?', or empty
  int minor = 1;        //!< HTTP/1.minor: 0 or 1
  header_list headers;  //!< names in lower case, values trimmed, in order
  std::string body;
  std::string peer;  //!< the client's address (no port)

  //! The first header named `name` (lower case), or null.
  const std::string* header(std::string_view name) const {
    for (const auto& [k, v] : headers) {
      if (k == name) {
        return &v;
      }
    }
    return nullptr;
  }
};

class deferred_response;

//! What a handler answers: a whole response, or (`later` set) one that comes later.
struct http_response {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  header_list headers;  //!< extra headers (the server writes length, type and connection)
  std::shared_ptr<deferred_response> later;
};

//! Where an answer that comes later writes itself: whole (`respond`), or as a stream of pieces
//! (HTTP/1.1: chunked; HTTP/1.0: until the connection closes).
class response_sink {
 public:
  virtual ~response_sink() = default;
  //! The whole response; the request is then answered.
  virtual void respond(http_response r) = 0;
  //! The head of a streamed response; `send` then adds to its body and `end_stream` ends it.
  virtual void start_stream(int status, const std::string& content_type,
                            const header_list& headers) = 0;
  virtual void send(std::string_view bytes) = 0;
  virtual void end_stream() = 0;
  //! Bytes the connection takes now before its output buffer is full: what more a stream
  //! should wait for (it is polled again as the client reads).
  virtual std::size_t room() const = 0;
};

//! An answer that comes later. Its members are called on the HTTP server's loop thread, never
//! two at once; what it waits for (the engine) calls the `wake` it was attached with, from any
//! thread, whenever something changed, and the loop then polls it.
class deferred_response {
 public:
  virtual ~deferred_response() = default;
  //! Once, before the first `poll`.
  virtual void attach(std::function<void()> wake) = 0;
  //! Writes what is ready to `out`; cheap and never blocking.
  virtual void poll(response_sink& out) = 0;
  //! The client left, or its connection was closed (a timeout, the server stopping) before the
  //! answer ended: stop the work behind it.
  virtual void cancel() = 0;
};

}  // namespace mini_decoder::serving
