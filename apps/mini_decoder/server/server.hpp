// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `mini_decoder serve`: an OpenAI-compatible HTTP server on the batched engine.
//!
//! Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream`: Server-Sent
//! Events), `POST /tokenize`, `POST /detokenize`, `GET /v1/models`, `GET /health`,
//! `GET /metrics`. One event loop owns every connection (`http_server.hpp`); a few worker
//! threads parse and tokenize; one engine thread owns the `batch_engine` and steps it while
//! there is work. Handlers hand their requests to it through a mutex-protected queue; the engine
//! thread wakes the loop as tokens come, and the loop writes them out: no thread waits for a
//! client, and no client holds a thread.
//!
//! The parts, each in its own file here: `http_parser.hpp` and `http_server.hpp` (HTTP/1.1,
//! limits, timeouts), `access.hpp` (API key, host, origin, content type), `openai.hpp`
//! (requests read and checked, response shapes), `chat.hpp` (the chat template),
//! `request_queue.hpp` (the queue and the engine thread), `generation.hpp` (a generation's
//! answer, whole or streamed), `metrics.hpp` (/metrics), `routes.hpp` (the endpoints); this
//! class composes them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <mini_decoder/batch/batch.hpp>
#include <mini_decoder/model/model.hpp>
#include <mini_decoder/server/chat.hpp>
#include <mini_decoder/server/http_server.hpp>

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
  std::uint32_t max_n = 8;  //!< the most choices (`n`) one request may ask for
  //! Connections: limits, timeouts, and the threads that parse and tokenize (`worker_threads`).
  serving::http_limits http;
  //! The key clients must send as `Authorization: Bearer KEY` (all but /health and /metrics);
  //! empty: none.
  std::string api_key;
  //! `Host` names accepted besides the loopback ones (see `serving::access_policy`).
  std::vector<std::string> allowed_hosts;
  std::vector<std::string> allowed_origins;  //!< browser `Origin`s accepted; by default none
  //! On `stop`: how long running and waiting requests may go on before they are cut (their
  //! streams then end with `finish_reason` "abort" and `data: [DONE]`).
  double shutdown_grace = 10.0;
  bool log_requests = false;  //!< one line per request on stderr
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
  //! Stops serving: stops accepting at once (new connections are refused, new requests on open
  //! ones get 503), lets the requests queued or running go on for `shutdown_grace` seconds, then
  //! cuts what remains (a stream ends with `finish_reason` "abort" and `data: [DONE]`, a whole
  //! answer gets 503), writes what is left to each client for at most 2 seconds, closes every
  //! connection and joins the threads. No client can hold it longer. Safe to call more than once.
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
