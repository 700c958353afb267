// SPDX-License-Identifier: Apache-2.0
// mini_decoder serve: the parts (request queue, routes, HTTP) composed, and their threads.
#include <mini_decoder/server/server.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <thread>
#include <utility>

#include <mini_decoder/io/error.hpp>
#include <mini_decoder/server/access.hpp>
#include <mini_decoder/server/metrics.hpp>
#include <mini_decoder/server/openai.hpp>
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
        queue(m, o.engine),
        http(o.http),
        api(m, o, queue, metrics, http, o.model_id.empty() ? stem_of(m.path) : o.model_id,
            static_cast<std::int64_t>(std::time(nullptr)), stopping) {
    policy.api_key = o.api_key;
    policy.allowed_hosts = o.allowed_hosts;
    policy.allowed_origins = o.allowed_origins;
    policy.loopback_only_hosts = serving::is_loopback_address(o.host);
  }

  const model& m;
  server_options o;
  serving::request_queue queue;  // builds the engine: bad engine options throw here
  serving::server_metrics metrics;
  serving::http_server http;
  std::atomic<bool> stopping{false};
  serving::routes api;
  serving::access_policy policy;

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
  s.http.set_gate([&s](const serving::http_request& r) { return check_access(s.policy, r); });
  s.http.set_error_format([](int status, const std::string& message) {
    return serving::error_response(
        {status, message, "", status >= 500 ? "server_error" : "invalid_request_error"});
  });
  const bool log = s.o.log_requests;
  s.http.set_observer([&s, log](const serving::http_request& r, int status, double seconds) {
    s.metrics.request(r.path, status, seconds);
    if (log) {
      std::fprintf(stderr, "%s %s %s -> %d (%.3f s)\n", r.peer.c_str(), r.method.c_str(),
                   r.path.c_str(), status, seconds);
    }
  });
  const int port = s.http.bind(s.o.host, s.o.port);
  s.bound_port = port;
  s.started = true;
  s.engine_thread = std::thread([&s] { s.queue.run(); });
  s.http_thread = std::thread([&s] { s.http.run(); });
  return port;
}

void server::stop() {
  impl& s = *p_;
  if (!s.started || s.stopped) {
    return;
  }
  s.stopped = true;
  s.stopping = true;
  s.http.stop_accepting();
  // The grace: requests under way go on while there are any, at most this long.
  const auto until = std::chrono::steady_clock::now() +
                     std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                         std::chrono::duration<double>(s.o.shutdown_grace));
  while (!s.queue.idle() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  s.queue.stop();
  s.engine_thread.join();  // ends what is left, marked aborted: every answer can end
  s.http.drain(2.0);       // their last bytes, to clients that read them
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
