// SPDX-License-Identifier: Apache-2.0
// The server's HTTP side (cpp-httplib): connections, error responses, Server-Sent Events.
#include <mini_decoder/server/http.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>

#include <mini_decoder/server/openai.hpp>

namespace mini_decoder::serving {

void send_error(httplib::Response& res, const request_error& e) {
  res.status = e.status;
  res.set_content(dump(error_json(e)), "application/json");
}

void configure_http(httplib::Server& http, const server_options& o) {
  // Anything else (unknown path or method, a failure with no body): an OpenAI-style error.
  http.set_error_handler(
      httplib::Server::HandlerWithResponse([](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty()) {
          return httplib::Server::HandlerResponse::Unhandled;
        }
        request_error e{res.status, "", "", "invalid_request_error"};
        e.message = res.status == 404 ? "unknown endpoint: " + req.method + " " + req.path
                                      : "request failed with HTTP " + std::to_string(res.status);
        send_error(res, e);
        return httplib::Server::HandlerResponse::Handled;
      }));
  http.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr) {
        send_error(res, {500, "internal server error", "", "server_error"});
      });
  if (o.log_requests) {
    http.set_logger([](const httplib::Request& req, const httplib::Response& res) {
      std::fprintf(stderr, "%s %s -> %d\n", req.method.c_str(), req.path.c_str(), res.status);
    });
  }
  const unsigned threads = std::max(2u, o.http_threads);
  http.new_task_queue = [threads] {
    return new httplib::ThreadPool(threads);
  };
  http.set_payload_max_length(std::size_t{16} << 20);
}

int bind_http(httplib::Server& http, const std::string& host, int port) {
  if (port == 0) {
    port = http.bind_to_any_port(host);
    if (port <= 0) {
      fail("server: cannot bind ", host, " to a free port");
    }
  } else if (!http.bind_to_port(host, port)) {
    fail("server: cannot bind ", host, ":", port, " (in use, or not an address of this host)");
  }
  return port;
}

void stream_events(httplib::Response& res, std::shared_ptr<job> j, event_stream ev) {
  struct stream_state {
    std::size_t sent = 0;
    bool opened = false;  // the opening event went out
  };
  auto st = std::make_shared<stream_state>();
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [j, st, ev](std::size_t, httplib::DataSink& sink) {
        auto write = [&](const std::string& s) {
          if (!sink.write(s.data(), s.size())) {
            j->cancelled = true;  // the client went away: the engine ends this request
            return false;
          }
          return true;
        };
        if (!ev.opening.empty() && !st->opened) {
          st->opened = true;
          return write(ev.opening);
        }
        std::unique_lock<std::mutex> lk(j->m);
        // Bounded wait: the HTTP library calls again (and notices a stopping server).
        j->cv.wait_for(lk, std::chrono::milliseconds(200), [&] {
          return j->ready > st->sent || j->ph == phase::done || j->ph == phase::failed;
        });
        if (j->ph == phase::failed) {
          const std::string e = ev.error(j->error);
          lk.unlock();
          write(e);
          sink.done();
          return true;
        }
        const bool done = j->ph == phase::done;
        std::string out;
        if (j->ready > st->sent) {
          out += ev.piece(j->text.substr(st->sent, j->ready - st->sent));
          st->sent = j->ready;
        }
        if (done) {
          out += ev.end(*j);
        }
        lk.unlock();
        if (!out.empty() && !write(out)) {
          return false;
        }
        if (done) {
          sink.done();
        }
        return true;
      },
      [j](bool success) {
        if (!success) {
          j->cancelled = true;
        }
      });
}

}  // namespace mini_decoder::serving
