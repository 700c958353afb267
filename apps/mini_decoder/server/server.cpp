// SPDX-License-Identifier: Apache-2.0
// mini_decoder serve: the parts (request queue, routes, HTTP) composed, and their threads.
#include <mini_decoder/server/server.hpp>

#include <httplib.h>

#include <cstdint>
#include <ctime>
#include <filesystem>
#include <thread>
#include <utility>

#include <mini_decoder/io/error.hpp>
#include <mini_decoder/server/http.hpp>
#include <mini_decoder/server/request_queue.hpp>
#include <mini_decoder/server/routes.hpp>

namespace mini_decoder {

namespace {

std::string stem_of(const std::string& path) {
  return std::filesystem::path(path).stem().string();
}

}  // namespace

struct server::impl {
  impl(const model& mod, server_options opt)
      : m(mod),
        o(std::move(opt)),
        tok(*m.tok),
        queue(m, o.engine, tok),
        api(m, o, queue, tok, o.model_id.empty() ? stem_of(m.path) : o.model_id,
            static_cast<std::int64_t>(std::time(nullptr))) {}

  const model& m;
  server_options o;
  serving::shared_tokenizer tok;
  serving::request_queue queue;  // builds the engine: bad engine options throw here
  serving::routes api;

  httplib::Server http;
  std::thread http_thread, engine_thread;
  int bound_port = 0;
  bool started = false, stopped = false;
};

server::server(const model& m, server_options o) : p_(std::make_unique<impl>(m, std::move(o))) {}

server::~server() {
  stop();
}

int server::start() {
  impl& s = *p_;
  if (s.started) {
    fail("server: start called twice");
  }
  s.api.add_to(s.http);
  serving::configure_http(s.http, s.o);
  const int port = serving::bind_http(s.http, s.o.host, s.o.port);
  s.bound_port = port;
  s.started = true;
  s.engine_thread = std::thread([&s] { s.queue.run(); });
  s.http_thread = std::thread([&s] { s.http.listen_after_bind(); });
  return port;
}

void server::stop() {
  impl& s = *p_;
  if (!s.started || s.stopped) {
    return;
  }
  s.stopped = true;
  s.queue.stop();
  s.engine_thread.join();  // fails what is queued or running: every waiting handler returns
  s.http.stop();
  s.http_thread.join();
}

int server::port() const {
  return p_->bound_port;
}

const std::string& server::model_id() const {
  return p_->api.model_id();
}

}  // namespace mini_decoder
