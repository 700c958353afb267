// SPDX-License-Identifier: Apache-2.0
// The HTTP/1.1 event loop (epoll, level-triggered) and its worker threads.
#include <mini_decoder/server/http_server.hpp>

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <mini_decoder/io/error.hpp>

namespace mini_decoder::serving {

namespace {

using clock_type = std::chrono::steady_clock;

double seconds(clock_type::duration d) {
  return std::chrono::duration<double>(d).count();
}
clock_type::duration after(double s) {
  return std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(s));
}

constexpr std::uint64_t listener_key = 1, wake_key = 2, first_connection_key = 16;
constexpr std::size_t read_chunk = 64 * 1024;
constexpr std::size_t high_water = 256 * 1024;  // output a stream waits to go below
constexpr double linger_seconds = 2.0;          // reading what a refused client still sends
constexpr std::size_t linger_bytes = std::size_t{8} << 20;

// Where a connection is.
enum class state : std::uint8_t {
  idle,       // no byte of a request yet (new, or kept alive after an answer)
  head,       // reading a request's head
  body,       // reading its body
  handling,   // its handler runs, or its answer comes later (`later`)
  flushing,   // answered: writing what is left, then the next request or the close
  lingering,  // refused and answered: the answer is written, what the client sends discarded
};

struct route_entry {
  std::string method, path;
  bool prefix = false, on_worker = false;
  http_server::handler h;
};

struct connection {
  int fd = -1;
  std::uint64_t key = 0;
  std::string peer;
  state st = state::idle;
  bool fresh = true;  // no request yet: the head deadline counts from the accept
  std::string in;
  std::size_t scanned = 0;  // of `in`, searched for the end of the head
  std::string out;
  std::size_t out_off = 0;
  clock_type::time_point since;  // accept, last answer, or the current request's first byte
  clock_type::time_point last_write, linger_until;
  std::size_t lingered = 0;
  // The current request.
  request_head head;
  const route_entry* route = nullptr;
  bool head_only = false;    // HEAD: the answer's head alone
  bool close_after = false;  // the connection closes once the answer is written
  std::size_t reserved = 0;  // of the body budget
  std::uint64_t serial = 0;  // which request: worker results and wakes name it
  std::shared_ptr<deferred_response> later;
  bool streaming = false, chunked = false, answered = false;
  std::uint32_t interest = 0;
  bool blocked = false;    // output waits for the client to read
  bool throttled = false;  // a stream stopped polling at the high-water mark

  std::size_t pending() const { return out.size() - out_off; }
};

class worker_pool {
 public:
  void start(unsigned n) {
    for (unsigned i = 0; i < n; ++i) {
      threads_.emplace_back([this] { work(); });
    }
  }
  void post(std::function<void()> f) {
    {
      std::lock_guard<std::mutex> lk(m_);
      q_.push_back(std::move(f));
    }
    cv_.notify_one();
  }
  // Runs no task that has not started; waits for those that have.
  void stop() {
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_ = true;
      q_.clear();
    }
    cv_.notify_all();
    for (auto& t : threads_) {
      t.join();
    }
    threads_.clear();
  }
  std::size_t queued() {
    std::lock_guard<std::mutex> lk(m_);
    return q_.size() + running_;
  }

 private:
  void work() {
    for (;;) {
      std::function<void()> f;
      {
        std::unique_lock<std::mutex> lk(m_);
        cv_.wait(lk, [&] { return stop_ || !q_.empty(); });
        if (stop_) {
          return;
        }
        f = std::move(q_.front());
        q_.pop_front();
        ++running_;
      }
      f();
      std::lock_guard<std::mutex> lk(m_);
      --running_;
    }
  }
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  std::size_t running_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

bool would_block() {
  return errno == EAGAIN || errno == EWOULDBLOCK;
}

std::string address_of(const sockaddr_storage& a) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (a.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&a);
    inet_ntop(AF_INET, &v4->sin_addr, buf, sizeof buf);
  } else if (a.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&a);
    if (IN6_IS_ADDR_V4MAPPED(&v6->sin6_addr)) {  // one client, one address, whatever the family
      inet_ntop(AF_INET, &v6->sin6_addr.s6_addr[12], buf, sizeof buf);
    } else {
      inet_ntop(AF_INET6, &v6->sin6_addr, buf, sizeof buf);
    }
  }
  return buf;
}

}  // namespace

struct http_server::impl : response_sink {
  explicit impl(http_server& s) : srv(s) {}

  http_server& srv;
  std::vector<route_entry> routes;
  int ep = -1, listener = -1, efd = -1;
  std::unordered_map<std::uint64_t, connection> conns;
  std::unordered_map<std::string, std::size_t> per_client;
  std::uint64_t next_key = first_connection_key, next_serial = 1;
  std::size_t body_in_flight = 0;
  std::vector<std::uint64_t> again;  // see read_again
  bool draining = false;
  clock_type::time_point accept_paused_until{}, last_sweep{};
  bool accept_paused = false;
  worker_pool workers;

  // Posted from other threads.
  struct result {
    std::uint64_t key, serial;
    http_response res;
  };
  std::mutex post_m;
  std::vector<result> results;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> woken;
  bool stop_requested = false, stop_accepting_requested = false;
  std::atomic<bool> signaled{false};

  // drain(): the loop publishes whether anything is under way.
  std::mutex busy_m;
  std::condition_variable busy_cv;
  bool busy = false, published = false;  // published: `busy` is known since draining began

  connection* current = nullptr;  // the connection a `poll` writes to (the sink's target)

  // --- posting -----------------------------------------------------------------------------
  void signal() {
    if (!signaled.exchange(true)) {
      const std::uint64_t one = 1;
      [[maybe_unused]] const ssize_t n = ::write(efd, &one, sizeof one);
    }
  }
  void post_result(std::uint64_t key, std::uint64_t serial, http_response res) {
    {
      std::lock_guard<std::mutex> lk(post_m);
      results.push_back({key, serial, std::move(res)});
    }
    signal();
  }
  void post_wake(std::uint64_t key, std::uint64_t serial) {
    {
      std::lock_guard<std::mutex> lk(post_m);
      woken.emplace_back(key, serial);
    }
    signal();
  }

  // --- the loop ----------------------------------------------------------------------------
  void run() {
    workers.start(std::max(1u, srv.limits_.worker_threads));
    std::vector<epoll_event> events(256);
    bool stopping = false;
    while (!stopping) {
      const int n = epoll_wait(ep, events.data(), static_cast<int>(events.size()), 100);
      if (n < 0 && errno != EINTR) {
        break;
      }
      for (int i = 0; i < n; ++i) {
        const std::uint64_t key = events[static_cast<std::size_t>(i)].data.u64;
        const std::uint32_t ev = events[static_cast<std::size_t>(i)].events;
        if (key == listener_key) {
          accept_ready();
        } else if (key == wake_key) {
          std::uint64_t v = 0;
          [[maybe_unused]] const ssize_t r = ::read(efd, &v, sizeof v);
        } else if (const auto it = conns.find(key); it != conns.end()) {
          on_event(it->second, ev);
        }
      }
      stopping = handle_posted();
      read_again();
      const auto now = clock_type::now();
      if (now - last_sweep >= std::chrono::milliseconds(100)) {
        last_sweep = now;
        sweep(now);
      }
      publish_busy();
    }
    workers.stop();
    while (!conns.empty()) {
      close_connection(conns.begin()->second, false);
    }
    if (listener >= 0) {
      ::close(listener);
      listener = -1;
    }
    publish_busy();
  }

  // Returns whether the loop should stop.
  bool handle_posted() {
    signaled.store(false);
    std::vector<result> rs;
    std::vector<std::pair<std::uint64_t, std::uint64_t>> ws;
    bool stop = false, stop_accepting = false;
    {
      std::lock_guard<std::mutex> lk(post_m);
      rs.swap(results);
      ws.swap(woken);
      stop = stop_requested;
      stop_accepting = stop_accepting_requested;
    }
    for (result& r : rs) {
      const auto it = conns.find(r.key);
      if (it == conns.end() || it->second.serial != r.serial || it->second.st != state::handling) {
        if (r.res.later) {
          r.res.later->cancel();  // its client left while the handler ran
        }
        continue;
      }
      deliver(it->second, std::move(r.res));
    }
    for (const auto& [key, serial] : ws) {
      const auto it = conns.find(key);
      if (it != conns.end() && it->second.serial == serial && it->second.later) {
        poll_later(it->second);
      }
    }
    if (stop_accepting && !draining) {
      begin_draining();
    }
    return stop;
  }

  // For `drain`, which is only called once accepting has stopped: until then, nothing to do.
  void publish_busy() {
    if (!draining) {
      return;
    }
    bool b = workers.queued() > 0;
    for (const auto& [key, c] : conns) {
      if (c.st == state::handling || c.st == state::flushing || c.pending() > 0) {
        b = true;
        break;
      }
    }
    {
      std::lock_guard<std::mutex> lk(busy_m);
      if (busy != b) {
        busy = b;
      }
      published = true;
    }
    busy_cv.notify_all();
  }

  void begin_draining() {
    draining = true;
    if (listener >= 0) {
      epoll_ctl(ep, EPOLL_CTL_DEL, listener, nullptr);
      ::close(listener);
      listener = -1;
    }
    std::vector<std::uint64_t> idle;
    for (auto& [key, c] : conns) {
      if (c.st == state::idle && c.in.empty() && c.pending() == 0) {
        idle.push_back(key);
      }
    }
    for (const std::uint64_t k : idle) {
      close_connection(conns.at(k), false);
    }
  }

  // --- connections -------------------------------------------------------------------------
  void accept_ready() {
    for (;;) {
      sockaddr_storage addr{};
      socklen_t len = sizeof addr;
      const int fd = ::accept4(listener, reinterpret_cast<sockaddr*>(&addr), &len,
                               SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // Out of descriptors: stop accepting for a moment rather than spin on the listener.
          epoll_ctl(ep, EPOLL_CTL_DEL, listener, nullptr);
          accept_paused = true;
          accept_paused_until = clock_type::now() + std::chrono::milliseconds(100);
        }
        return;
      }
      const std::string peer = address_of(addr);
      std::size_t& mine = per_client[peer];
      if (conns.size() >= srv.limits_.max_connections ||
          mine >= srv.limits_.max_connections_per_client) {
        const bool all = conns.size() >= srv.limits_.max_connections;
        if (mine == 0) {
          per_client.erase(peer);
        }
        ++srv.counters_.connections_refused;
        // The refusal as a whole answer, best effort (a fresh socket takes it), then close.
        const http_response r =
            error(503, all ? "the server has " + std::to_string(srv.limits_.max_connections) +
                                 " connections open, its limit; try again later"
                           : "your address has " +
                                 std::to_string(srv.limits_.max_connections_per_client) +
                                 " connections open, the limit per client; close some first");
        const std::string bytes =
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: " + r.content_type +
            "\r\nContent-Length: " + std::to_string(r.body.size()) +
            "\r\nConnection: close\r\nRetry-After: 1\r\n\r\n" + r.body;
        [[maybe_unused]] const ssize_t n = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
        ::shutdown(fd, SHUT_WR);
        ::close(fd);
        continue;
      }
      ++mine;
      const int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // small SSE chunks, now
      const std::uint64_t key = next_key++;
      connection& c = conns[key];
      c.fd = fd;
      c.key = key;
      c.peer = peer;
      c.since = c.last_write = clock_type::now();
      ++srv.counters_.connections_accepted;
      srv.counters_.open = conns.size();
      update_interest(c);
    }
  }

  void close_connection(connection& c, bool gone) {
    if (c.later) {
      c.later->cancel();
      c.later.reset();
    }
    if (gone && (c.st == state::handling || c.st == state::body || c.st == state::head)) {
      ++srv.counters_.client_gone;
    }
    body_in_flight -= c.reserved;
    epoll_ctl(ep, EPOLL_CTL_DEL, c.fd, nullptr);
    ::close(c.fd);
    if (const auto it = per_client.find(c.peer); it != per_client.end() && --it->second == 0) {
      per_client.erase(it);
    }
    if (current == &c) {
      current = nullptr;
    }
    conns.erase(c.key);
    srv.counters_.open = conns.size();
  }

  void update_interest(connection& c) {
    std::uint32_t want = EPOLLRDHUP;
    if (c.st == state::idle || c.st == state::head || c.st == state::body ||
        c.st == state::lingering) {
      want |= EPOLLIN;
    }
    if (c.pending() > 0) {
      want |= EPOLLOUT;
    }
    if (want == c.interest) {
      return;
    }
    epoll_event e{};
    e.events = want;
    e.data.u64 = c.key;
    epoll_ctl(ep, c.interest == 0 ? EPOLL_CTL_ADD : EPOLL_CTL_MOD, c.fd, &e);
    c.interest = want;
  }

  void on_event(connection& c, std::uint32_t ev) {
    const std::uint64_t key = c.key;
    if ((ev & EPOLLERR) != 0 || ((ev & EPOLLHUP) != 0 && (ev & EPOLLIN) == 0)) {
      close_connection(c, true);
      return;
    }
    if ((ev & EPOLLOUT) != 0) {
      flush(c);
      if (conns.count(key) == 0) {
        return;
      }
    }
    if ((ev & EPOLLIN) != 0 && (c.interest & EPOLLIN) != 0) {
      read_ready(c);
      return;
    }
    if ((ev & (EPOLLRDHUP | EPOLLHUP)) != 0) {
      // Not reading (a request runs, or its answer is being written): the client closed its
      // side, so it is gone. Its request is cancelled now, not at the next write.
      close_connection(c, true);
    }
  }

  void read_ready(connection& c) {
    const std::uint64_t key = c.key;
    char buf[read_chunk];
    for (;;) {
      const ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
      if (n == 0) {
        close_connection(c, true);  // the client closed: nothing it sent is answered
        return;
      }
      if (n < 0) {
        if (errno == EINTR) {
          continue;
        }
        if (!would_block()) {
          close_connection(c, true);
        }
        return;
      }
      if (c.st == state::lingering) {
        c.lingered += static_cast<std::size_t>(n);
        if (c.lingered > linger_bytes) {
          close_connection(c, false);
          return;
        }
        continue;
      }
      if (c.st == state::idle) {
        c.st = state::head;
        if (!c.fresh) {
          c.since = clock_type::now();  // a kept-alive connection: the head's clock starts now
        }
      }
      c.in.append(buf, static_cast<std::size_t>(n));
      process_input(c);
      if (conns.count(key) == 0) {
        return;
      }
      if (c.st != state::head && c.st != state::body) {
        update_interest(c);
        return;  // a request is complete: the rest waits in the socket until it is answered
      }
    }
  }

  // Reads what `in` holds: a head, then its body, then hands the request on.
  void process_input(connection& c) {
    if (c.st == state::idle && !c.in.empty()) {
      c.st = state::head;
      c.since = clock_type::now();
    }
    if (c.st == state::head) {
      const std::size_t end = head_end(c.in, c.scanned);
      if (end == std::string::npos) {
        c.scanned = c.in.size();
        if (c.in.size() > srv.limits_.max_header_bytes) {
          refuse(c, 431,
                 "the request head is longer than " + std::to_string(srv.limits_.max_header_bytes) +
                     " bytes");
        }
        return;
      }
      c.head = request_head{};
      const head_limits hl{srv.limits_.max_header_bytes, srv.limits_.max_headers};
      if (const auto e = parse_head(std::string_view(c.in).substr(0, end), hl, c.head)) {
        refuse(c, e->status, e->message);
        return;
      }
      c.in.erase(0, end);
      c.scanned = 0;
      c.head.request.peer = c.peer;
      if (!start_request(c)) {
        return;
      }
      c.st = state::body;
    }
    if (c.st == state::body && c.in.size() >= c.head.content_length) {
      c.head.request.body = c.in.substr(0, c.head.content_length);
      c.in.erase(0, c.head.content_length);
      dispatch(c);
    }
  }

  // The head arrived: route, gate and limits. Returns false when it refused the request.
  bool start_request(connection& c) {
    http_request& r = c.head.request;
    c.fresh = false;
    c.head_only = r.method == "HEAD";
    c.route = nullptr;
    bool path_known = false;
    std::string allow;
    for (const route_entry& e : routes) {
      const bool path_ok =
          e.prefix ? r.path.compare(0, e.path.size(), e.path) == 0 : r.path == e.path;
      if (!path_ok) {
        continue;
      }
      path_known = true;
      if (e.method == r.method || (c.head_only && e.method == "GET")) {
        c.route = &e;
        break;
      }
      allow += (allow.empty() ? "" : ", ") + e.method;
    }
    if (c.route == nullptr) {
      if (path_known) {
        refuse(c, 405,
               "method " + r.method + " is not allowed on " + r.path + " (allowed: " + allow + ")");
      } else {
        refuse(c, 404, "unknown endpoint: " + r.method + " " + r.path);
      }
      return false;
    }
    if (draining) {
      refuse(c, 503, "the server is shutting down");
      return false;
    }
    if (srv.gate_) {
      if (std::optional<http_response> no = srv.gate_(r)) {
        refuse_with(c, std::move(*no));
        return false;
      }
    }
    const std::size_t len = c.head.content_length;
    if (len > srv.limits_.max_body_bytes) {
      refuse(c, 413,
             "the body is " + std::to_string(len) + " bytes, more than the limit of " +
                 std::to_string(srv.limits_.max_body_bytes));
      return false;
    }
    if (body_in_flight + len > srv.limits_.max_body_bytes_in_flight) {
      refuse(c, 503, "the server holds too many request bodies at once; try again later");
      return false;
    }
    body_in_flight += len;
    c.reserved = len;
    if (c.head.expect_continue && c.in.size() < len) {
      const std::uint64_t key = c.key;
      c.out += "HTTP/1.1 100 Continue\r\n\r\n";
      flush(c);
      return conns.count(key) != 0;  // a client gone on that write: nothing more to read
    }
    return true;
  }

  void dispatch(connection& c) {
    c.st = state::handling;
    c.serial = next_serial++;
    c.answered = false;
    c.streaming = false;
    c.close_after = !c.head.keep_alive || draining;
    update_interest(c);
    const route_entry& e = *c.route;
    if (!e.on_worker) {
      http_response res = call(e, c.head.request);
      deliver(c, std::move(res));
      return;
    }
    // The worker gets the request; the connection keeps its head for the log.
    auto req = std::make_shared<http_request>(c.head.request);
    c.head.request.body.clear();
    c.head.request.body.shrink_to_fit();
    workers.post([this, &e, req, key = c.key, serial = c.serial] {
      post_result(key, serial, call(e, *req));
    });
  }

  http_response call(const route_entry& e, http_request& r) {
    try {
      return e.h(r);
    } catch (const std::exception& x) {
      return error(500, std::string("internal server error: ") + x.what());
    } catch (...) {
      return error(500, "internal server error");
    }
  }

  http_response error(int status, const std::string& message) const {
    if (srv.error_format_) {
      return srv.error_format_(status, message);
    }
    http_response r;
    r.status = status;
    r.content_type = "text/plain; charset=utf-8";
    r.body = message + "\n";
    return r;
  }

  // --- answers -----------------------------------------------------------------------------
  void deliver(connection& c, http_response res) {
    if (res.later) {
      c.later = std::move(res.later);
      const std::uint64_t key = c.key, serial = c.serial;
      c.later->attach([this, key, serial] { post_wake(key, serial); });
      poll_later(c);
      return;
    }
    write_whole(c, res);
    answer_done(c);
  }

  void poll_later(connection& c) {
    if (!c.later || (c.streaming && c.pending() >= high_water)) {
      c.throttled = c.later != nullptr;
      return;
    }
    const std::uint64_t key = c.key;
    std::shared_ptr<deferred_response> keep = c.later;
    current = &c;
    keep->poll(*this);
    current = nullptr;
    if (const auto it = conns.find(key); it != conns.end()) {
      connection& d = it->second;
      d.throttled = d.later != nullptr && d.pending() >= high_water;
      flush(d);
    }
  }

  // response_sink, for the connection being polled.
  void respond(http_response r) override {
    if (current == nullptr || current->answered) {
      return;
    }
    connection& c = *current;
    write_whole(c, r);
    c.later.reset();
    answer_done(c);
  }
  void start_stream(int status, const std::string& content_type,
                    const header_list& headers) override {
    if (current == nullptr || current->answered) {
      return;
    }
    connection& c = *current;
    c.answered = true;
    c.streaming = true;
    c.chunked = c.head.request.minor == 1;
    if (!c.chunked) {
      c.close_after = true;  // HTTP/1.0: the body ends when the connection does
    }
    std::string h = status_line(status) + "Content-Type: " + content_type + "\r\n";
    if (c.chunked) {
      h += "Transfer-Encoding: chunked\r\n";
    }
    h += c.close_after ? "Connection: close\r\n" : "Connection: keep-alive\r\n";
    for (const auto& [k, v] : headers) {
      h += k + ": " + v + "\r\n";
    }
    c.out += h + "\r\n";
    observe(c, status);
  }
  void send(std::string_view bytes) override {
    if (current == nullptr || !current->streaming || bytes.empty() || current->head_only) {
      return;
    }
    connection& c = *current;
    if (c.chunked) {
      char size[32];
      std::snprintf(size, sizeof size, "%zx\r\n", bytes.size());
      c.out += size;
      c.out.append(bytes);
      c.out += "\r\n";
    } else {
      c.out.append(bytes);
    }
  }
  void end_stream() override {
    if (current == nullptr || !current->streaming) {
      return;
    }
    connection& c = *current;
    if (c.chunked && !c.head_only) {
      c.out += "0\r\n\r\n";
    }
    c.later.reset();
    answer_done(c);
  }
  std::size_t room() const override {
    return current == nullptr || current->pending() >= high_water ? 0
                                                                  : high_water - current->pending();
  }

  static std::string status_line(int status) {
    return "HTTP/1.1 " + std::to_string(status) + " " + reason_phrase(status) + "\r\n";
  }

  void write_whole(connection& c, const http_response& r) {
    c.answered = true;
    std::string h = status_line(r.status) + "Content-Type: " + r.content_type +
                    "\r\nContent-Length: " + std::to_string(r.body.size()) + "\r\n";
    h += c.close_after ? "Connection: close\r\n" : "Connection: keep-alive\r\n";
    for (const auto& [k, v] : r.headers) {
      h += k + ": " + v + "\r\n";
    }
    c.out += h + "\r\n";
    if (!c.head_only) {
      c.out += r.body;
    }
    observe(c, r.status);
  }

  void observe(connection& c, int status) {
    ++srv.counters_.requests;
    if (srv.observer_) {
      srv.observer_(c.head.request, status, seconds(clock_type::now() - c.since));
    }
  }

  // The answer is complete in `out`: write it, then read the next request or close.
  void answer_done(connection& c) {
    body_in_flight -= c.reserved;
    c.reserved = 0;
    c.st = state::flushing;
    flush(c);
  }

  // A request refused before its handler: the error, then the connection closes (its body, if
  // any, was not read), after lingering to read what the client still sends so that it sees
  // the answer rather than a reset.
  void refuse(connection& c, int status, const std::string& message) {
    refuse_with(c, error(status, message));
  }
  void refuse_with(connection& c, http_response r) {
    c.close_after = true;
    c.later.reset();
    write_whole(c, r);
    body_in_flight -= c.reserved;
    c.reserved = 0;
    c.in.clear();
    c.st = state::lingering;
    c.linger_until = clock_type::now() + after(linger_seconds);
    flush(c);
  }

  void flush(connection& c) {
    const std::uint64_t key = c.key;
    if (!c.blocked) {
      c.last_write = clock_type::now();  // the write clock starts when output starts waiting
    }
    while (c.pending() > 0) {
      const ssize_t n =
          ::send(c.fd, c.out.data() + c.out_off, c.pending(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        c.out_off += static_cast<std::size_t>(n);
        c.last_write = clock_type::now();
        continue;
      }
      if (n < 0 && errno == EINTR) {
        continue;
      }
      if (n < 0 && would_block()) {
        break;
      }
      close_connection(c, true);
      return;
    }
    if (c.out_off == c.out.size()) {
      c.out.clear();
      c.out_off = 0;
    } else if (c.out_off > read_chunk) {
      c.out.erase(0, c.out_off);
      c.out_off = 0;
    }
    c.blocked = c.pending() > 0;
    if (c.pending() == 0) {
      if (c.st == state::lingering) {
        ::shutdown(c.fd, SHUT_WR);
      } else if (c.st == state::flushing) {
        if (c.close_after) {
          close_connection(c, false);
          return;
        }
        next_request(c);
        if (conns.count(key) == 0) {
          return;
        }
      }
    }
    update_interest(c);
    if (c.throttled && c.pending() < high_water / 2 && current == nullptr) {
      c.throttled = false;  // the client read: the stream may go on
      poll_later(c);
    }
  }

  // The answer is written and the connection stays: the next request, maybe already here.
  void next_request(connection& c) {
    c.st = state::idle;
    c.since = clock_type::now();
    c.head = request_head{};
    c.route = nullptr;
    c.answered = c.streaming = false;
    if (draining) {
      if (c.in.empty()) {
        close_connection(c, false);
        return;
      }
    }
    if (!c.in.empty()) {
      again.push_back(c.key);  // a pipelined request: read by the loop, not from this call
    }
    update_interest(c);
  }

  // Connections whose next request (pipelined) waits in `in`.
  void read_again() {
    while (!again.empty()) {
      std::vector<std::uint64_t> keys;
      keys.swap(again);
      for (const std::uint64_t key : keys) {
        const auto it = conns.find(key);
        if (it == conns.end() || it->second.st != state::idle || it->second.in.empty()) {
          continue;
        }
        process_input(it->second);
        if (const auto jt = conns.find(key); jt != conns.end()) {
          update_interest(jt->second);
        }
      }
    }
  }

  void sweep(clock_type::time_point now) {
    if (accept_paused && now >= accept_paused_until && listener >= 0) {
      epoll_event e{};
      e.events = EPOLLIN;
      e.data.u64 = listener_key;
      epoll_ctl(ep, EPOLL_CTL_ADD, listener, &e);
      accept_paused = false;
    }
    const http_limits& l = srv.limits_;
    std::vector<std::pair<std::uint64_t, int>> due;  // key, 0: close, 408: refuse
    for (auto& [key, c] : conns) {
      if (c.blocked && now - c.last_write > after(l.write_timeout)) {
        due.emplace_back(key, 0);  // the client reads nothing: it holds nothing longer
        continue;
      }
      switch (c.st) {
        case state::idle:
          if (now - c.since > after(c.fresh ? l.header_timeout : l.keep_alive_timeout) ||
              (draining && c.pending() == 0)) {
            due.emplace_back(key, -1);
          }
          break;
        case state::head:
          if (now - c.since > after(l.header_timeout)) {
            due.emplace_back(key, 408);
          }
          break;
        case state::body:
          if (now - c.since > after(l.request_timeout)) {
            due.emplace_back(key, 408);
          }
          break;
        case state::lingering:
          if (now > c.linger_until) {
            due.emplace_back(key, -1);
          }
          break;
        default:
          break;
      }
    }
    for (const auto& [key, what] : due) {
      const auto it = conns.find(key);
      if (it == conns.end()) {
        continue;
      }
      if (what == 408) {
        ++srv.counters_.timeouts;
        refuse(it->second, 408,
               it->second.st == state::head ? "the request head did not arrive within " +
                                                  std::to_string(l.header_timeout) + " s"
                                            : "the request body did not arrive within " +
                                                  std::to_string(l.request_timeout) + " s");
      } else {
        if (what == 0) {
          ++srv.counters_.timeouts;
        }
        close_connection(it->second, what == 0);
      }
    }
  }
};

http_server::http_server(http_limits limits) : limits_(limits), p_(std::make_unique<impl>(*this)) {
  p_->ep = epoll_create1(EPOLL_CLOEXEC);
  p_->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (p_->ep < 0 || p_->efd < 0) {
    fail("server: cannot create the event loop: ", std::strerror(errno));
  }
  epoll_event e{};
  e.events = EPOLLIN;
  e.data.u64 = wake_key;
  epoll_ctl(p_->ep, EPOLL_CTL_ADD, p_->efd, &e);
}

http_server::~http_server() {
  if (p_->listener >= 0) {
    ::close(p_->listener);
  }
  for (auto& [key, c] : p_->conns) {
    ::close(c.fd);
  }
  ::close(p_->efd);
  ::close(p_->ep);
}

void http_server::route(std::string method, std::string path, handler h, bool on_worker) {
  route_entry e;
  e.method = std::move(method);
  e.prefix = !path.empty() && path.back() == '*';
  if (e.prefix) {
    path.pop_back();
  }
  e.path = std::move(path);
  e.h = std::move(h);
  e.on_worker = on_worker;
  p_->routes.push_back(std::move(e));
}

int http_server::bind(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &res); rc != 0) {
    fail("server: cannot resolve ", host, ": ", gai_strerror(rc));
  }
  int fd = -1;
  std::string why;
  for (addrinfo* a = res; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      why = std::strerror(errno);
      continue;
    }
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 511) != 0) {
      why = std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(res);
  if (fd < 0) {
    fail("server: cannot bind ", host, ":", port, " (", why,
         "; in use, or not an address of this host)");
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  const int got = bound.ss_family == AF_INET6
                      ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                      : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  p_->listener = fd;
  epoll_event e{};
  e.events = EPOLLIN;
  e.data.u64 = listener_key;
  epoll_ctl(p_->ep, EPOLL_CTL_ADD, fd, &e);
  return got;
}

void http_server::run() {
  p_->run();
}

void http_server::stop_accepting() {
  {
    std::lock_guard<std::mutex> lk(p_->post_m);
    p_->stop_accepting_requested = true;
  }
  p_->signal();
}

bool http_server::drain(double s) {
  std::unique_lock<std::mutex> lk(p_->busy_m);
  return p_->busy_cv.wait_for(lk, after(s), [&] { return p_->published && !p_->busy; });
}

void http_server::stop() {
  {
    std::lock_guard<std::mutex> lk(p_->post_m);
    p_->stop_requested = true;
  }
  p_->signal();
}

}  // namespace mini_decoder::serving
