// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `mini_decoder serve`: an OpenAI-compatible HTTP server on the batched engine.
//!
//! Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream`: Server-Sent
//! Events), `GET /v1/models`, `GET /health`. The HTTP handlers run on the HTTP library's thread
//! pool; one engine thread owns the `batch_engine` and steps it while there is work. Handlers
//! hand their requests to it through a mutex-protected queue and read the tokens back from
//! per-request state guarded by a mutex and a condition variable.
//!
//! The parts, each in its own file here: `http.hpp` (connections, error responses, streaming),
//! `openai.hpp` (requests read and checked, response shapes), `chat.hpp` (the chat template),
//! `request_queue.hpp` (the queue and the engine thread), `routes.hpp` (the endpoints); this
//! class composes them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <mini_decoder/batch/batch.hpp>
#include <mini_decoder/model/model.hpp>
#include <mini_decoder/server/chat.hpp>

namespace mini_decoder {

//! How the server is built.
struct server_options {
  std::string host = "127.0.0.1";  //!< address to listen on
  int port = 0;                    //!< 0: a free port, chosen by the system (see `server::port`)
  //! The name `/v1/models` lists and responses carry; empty: the model file's name without its
  //! directory and extension.
  std::string model_id;
  batch_options engine;  //!< the batched engine (mode, fast-tier budget, batch size, context)
  //! `max_tokens` of a chat completion that gives none: this, capped by what the context leaves.
  //! (A completion without `max_tokens` gets 16, as OpenAI's API.)
  std::uint32_t default_max_tokens = 256;
  unsigned http_threads = 32;  //!< threads that run the HTTP handlers (each open stream holds one)
  bool log_requests = false;   //!< one line per request on stderr
};

//! The server. `start` binds and starts its threads; `stop` (or the destructor) ends them.
class server {
 public:
  //! Builds the engine (throws `decoder_error` for bad engine options); listens on nothing yet.
  //! `m` must outlive the server.
  server(const model& m, server_options o);
  ~server();
  server(const server&) = delete;
  server& operator=(const server&) = delete;

  //! Binds `host:port` and starts the HTTP and engine threads; returns the port bound. Throws
  //! `decoder_error` when the address cannot be bound, or when called twice.
  int start();
  //! Stops serving: requests still queued or running end (a stream gets an error event, a
  //! waiting request HTTP 503), then the threads are joined. Safe to call more than once.
  void stop();
  //! The port bound by `start` (0 before it).
  int port() const;
  //! The model name the API reports.
  const std::string& model_id() const;

  struct impl;  //!< the HTTP server, the request queue, the routes and the threads

 private:
  std::unique_ptr<impl> p_;
};

}  // namespace mini_decoder
