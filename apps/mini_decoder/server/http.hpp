// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The HTTP side of the server (cpp-httplib): what every connection gets, errors as
//! responses, and a job's text streamed as Server-Sent Events while the engine produces it.
//!
//! Connection-level policy (handler threads, body size, and where limits or timeouts would go)
//! is `configure_http`'s; a request's JSON is openai.hpp's.
#pragma once

#include <httplib.h>

#include <exception>
#include <functional>
#include <memory>
#include <string>

#include <mini_decoder/io/error.hpp>
#include <mini_decoder/server/request_error.hpp>
#include <mini_decoder/server/request_queue.hpp>
#include <mini_decoder/server/server.hpp>

namespace mini_decoder::serving {

//! Answers with `e`: its status and its OpenAI-style JSON body.
void send_error(httplib::Response& res, const request_error& e);

//! Runs a handler body, turning what it throws into an error response: a `request_error` as it
//! is, a `decoder_error` as 400, anything else as 500.
template <class F>
void guarded(httplib::Response& res, F&& f) {
  try {
    f();
  } catch (const request_error& e) {
    send_error(res, e);
  } catch (const decoder_error& e) {
    send_error(res, {400, e.what(), "", "invalid_request_error"});
  } catch (const std::exception& e) {
    send_error(res, {500, e.what(), "", "server_error"});
  }
}

//! What every connection gets, after the routes are added: OpenAI-style errors for unknown paths
//! and methods and for exceptions no handler caught, the request log (`o.log_requests`), the
//! handler threads (`o.http_threads`, at least 2; each open stream holds one) and the largest
//! body (16 MiB).
void configure_http(httplib::Server& http, const server_options& o);

//! Binds `host:port` (port 0: a free one) and returns the port bound; throws `decoder_error`
//! naming the address when it cannot.
int bind_http(httplib::Server& http, const std::string& host, int port);

//! The events of one stream, as whole Server-Sent Events text. `piece` and `end` run with the
//! job's lock held.
struct event_stream {
  std::string opening;                                   //!< sent first, alone; empty: none
  std::function<std::string(const std::string&)> piece;  //!< new text of the answer
  std::function<std::string(const job&)> end;  //!< after the last piece: what ends the stream
  std::function<std::string(const request_error&)> error;  //!< a failed job's event
};

//! Answers with `j`'s text as it grows: `ev.opening`, then an event per piece of text the job
//! made final, then `ev.end`; a failed job sends `ev.error` and ends the stream. A client that
//! goes away cancels the job (the engine then ends it alone). Waits at most 200 ms per call of
//! the HTTP library, so that it notices a stopping server.
void stream_events(httplib::Response& res, std::shared_ptr<job> j, event_stream ev);

}  // namespace mini_decoder::serving
