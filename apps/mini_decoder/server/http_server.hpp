// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The server's HTTP/1.1 side: one event loop (epoll) that owns every connection, and a
//! few worker threads for the handlers that parse and tokenize.
//!
//! Why not cpp-httplib (Debian's 0.11, which this server used before): it gives each connection
//! a thread of a fixed pool for as long as the connection lives, so 32 open streams, or 32
//! clients sending their headers one byte a second, took every thread and `/health` waited for
//! them; its read timeout is per `recv`, so a client that sends a byte just before it expires
//! is never timed out; it has no limit on connections per client or in all, and no way to let a
//! stream wait for the engine without holding a thread. Here a connection is a few hundred bytes
//! of state in the loop: a stream costs no thread, the head of a request must arrive whole
//! within a deadline, and the loop itself answers the cheap endpoints (`/health`, `/metrics`),
//! so they answer whatever the other connections do.
//!
//! Per connection: read the head (at most `max_header_bytes`, `max_headers` fields, within
//! `header_timeout` of its first byte), refuse it at once when the route, the gate (API key,
//! content type, host) or the limits say so, read the body (at most `max_body_bytes`, within
//! `request_timeout`), run the handler (on the loop, or on a worker), write the answer. HTTP/1.1
//! connections stay open (keep-alive, `keep_alive_timeout` between requests) and may pipeline:
//! the next request is read after the answer to the current one is written, so answers come in
//! order. HTTP/1.0 gets one answer per connection. A client that closes its connection while
//! its request runs cancels it (`deferred_response::cancel`) at once.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <mini_decoder/server/http_message.hpp>
#include <mini_decoder/server/http_parser.hpp>

namespace mini_decoder::serving {

//! What connections may hold and for how long. Times are seconds.
struct http_limits {
  std::size_t max_connections = 1024;           //!< open at once, all clients
  std::size_t max_connections_per_client = 64;  //!< open at once from one address
  std::size_t max_header_bytes = 16 * 1024;     //!< request line and header fields
  std::size_t max_headers = 64;                 //!< header fields
  std::size_t max_body_bytes = std::size_t{4} << 20;
  //! Body bytes all connections may be reading (and their handlers holding) at once: a request
  //! whose body would pass it gets 503 before its body is read.
  std::size_t max_body_bytes_in_flight = std::size_t{256} << 20;
  double header_timeout = 10;     //!< from a request's first byte to the end of its head
  double request_timeout = 60;    //!< from a request's first byte to the end of its body
  double keep_alive_timeout = 5;  //!< an open connection with no request
  double write_timeout = 30;      //!< output waiting with no byte taken by the client
  unsigned worker_threads = 4;    //!< threads for the handlers that run `on_worker`
};

//! Counts the loop keeps (read from any thread).
struct http_counters {
  std::atomic<std::uint64_t> connections_accepted{0};
  std::atomic<std::uint64_t> connections_refused{0};  //!< over a connection limit
  std::atomic<std::uint64_t> timeouts{0};             //!< closed by a timeout
  std::atomic<std::uint64_t> client_gone{0};          //!< closed by their client mid-request
  std::atomic<std::uint64_t> requests{0};             //!< requests answered (any status)
  std::atomic<std::size_t> open{0};                   //!< connections open now
};

class http_server {
 public:
  using handler = std::function<http_response(http_request&)>;
  //! Checks a request's head on the loop thread, before its body is read: a response refuses it
  //! (the connection then closes), nullopt lets it through.
  using gate = std::function<std::optional<http_response>(const http_request&)>;
  //! Shapes an error answer the server makes itself (404, 408, 413, 431, 503, ...).
  using error_format = std::function<http_response(int status, const std::string& message)>;
  //! Sees each answered request on the loop thread: its method, path, status and the seconds
  //! from its first byte to its answer's start.
  using observer = std::function<void(const http_request&, int status, double seconds)>;

  explicit http_server(http_limits limits);
  ~http_server();
  http_server(const http_server&) = delete;
  http_server& operator=(const http_server&) = delete;

  //! Routes `method path` to `h`. `path` is exact, or ends in `*` to match any path with that
  //! prefix. `on_worker`: the handler runs on a worker thread (it may take time: parsing,
  //! tokenizing); otherwise on the loop thread, where it must be quick and never block. A GET
  //! route answers HEAD too. Before `bind`.
  void route(std::string method, std::string path, handler h, bool on_worker);
  void set_gate(gate g) { gate_ = std::move(g); }
  void set_error_format(error_format f) { error_format_ = std::move(f); }
  void set_observer(observer o) { observer_ = std::move(o); }

  //! Binds `host:port` (port 0: a free one) and listens; returns the port. Throws
  //! `decoder_error` naming the address when it cannot.
  int bind(const std::string& host, int port);
  //! Runs the loop on the calling thread until `stop`.
  void run();

  //! Any thread: stops accepting (the listening socket closes). Connections with no request are
  //! closed; requests that arrive get 503 and their connection closes; answers under way go on.
  void stop_accepting();
  //! Any thread: waits until no request is being handled or answered and no answer waits to be
  //! written, at most `seconds`; returns whether that happened.
  bool drain(double seconds);
  //! Any thread: makes `run` close every connection (cancelling what they wait for) and return.
  void stop();

  const http_counters& counters() const { return counters_; }
  const http_limits& limits() const { return limits_; }

  struct impl;  //!< the loop's state

 private:
  http_limits limits_;
  gate gate_;
  error_format error_format_;
  observer observer_;
  http_counters counters_;
  std::unique_ptr<impl> p_;
};

}  // namespace mini_decoder::serving
