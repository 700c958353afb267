// SPDX-License-Identifier: Apache-2.0
// The server's HTTP/1.1 layer (server/http_parser, server/http_server) on loopback with stub
// handlers and raw sockets, as hostile and careless clients use it: heads dribbled one byte at
// a time, floods of header fields, pipelined requests, HTTP/1.0 streams, dozens of streams and
// idle keep-alive connections at once, clients that leave mid-request or never read, more
// connections than a client may hold, and a server that stops while all that goes on. Clients
// bind to different loopback addresses (127.0.0.x) to be different clients. Every wait is
// bounded; the limits are set short so the timeouts show within a second or two.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <mini_decoder/server/http_parser.hpp>
#include <mini_decoder/server/http_server.hpp>

#include "raw_http.hpp"

using namespace mini_decoder::serving;
using namespace mini_decoder::test;
using namespace std::chrono_literals;

namespace {

// A streamed answer fed by a ticker thread: `chunks` pieces, one per tick.
struct ticking_stream : deferred_response {
  explicit ticking_stream(int n, std::atomic<int>& cancels) : chunks(n), cancelled(cancels) {}
  void attach(std::function<void()> w) override {
    std::lock_guard<std::mutex> lk(m);
    wake = std::move(w);
  }
  void poll(response_sink& out) override {
    std::lock_guard<std::mutex> lk(m);
    if (!started) {
      out.start_stream(200, "text/event-stream", {{"Cache-Control", "no-cache"}});
      started = true;
    }
    while (sent < ticks && sent < chunks && out.room() > 0) {
      out.send("data: " + std::to_string(sent) + "\n\n");
      ++sent;
    }
    if (sent == chunks) {
      out.end_stream();
    }
  }
  void cancel() override { ++cancelled; }
  void tick() {
    std::function<void()> w;
    {
      std::lock_guard<std::mutex> lk(m);
      ++ticks;
      w = wake;
    }
    if (w) {
      w();
    }
  }
  std::mutex m;
  std::function<void()> wake;
  int chunks, ticks = 0, sent = 0;
  bool started = false;
  std::atomic<int>& cancelled;
};

// An answer that never comes (a request that waits for the engine): counts its cancellation.
struct never : deferred_response {
  explicit never(std::atomic<int>& c) : cancelled(c) {}
  void attach(std::function<void()>) override {}
  void poll(response_sink&) override {}
  void cancel() override { ++cancelled; }
  std::atomic<int>& cancelled;
};

// A stub server on a free loopback port: /health (loop), /echo (worker), /stream/N (a stream
// of N chunks, a tick every 20 ms), /hang (never answers), /big (a 4 MiB stream at once).
struct stub {
  explicit stub(http_limits l = short_limits()) : http(l) {
    http.route(
        "GET", "/health",
        [](http_request&) {
          http_response r;
          r.body = "{\"status\":\"ok\"}";
          return r;
        },
        false);
    http.route(
        "POST", "/echo",
        [](http_request& q) {
          http_response r;
          r.body = q.body;
          r.content_type = "text/plain";
          return r;
        },
        true);
    http.route(
        "GET", "/stream/*",
        [this](http_request& q) {
          auto s = std::make_shared<ticking_stream>(std::stoi(q.path.substr(8)), cancels);
          {
            std::lock_guard<std::mutex> lk(m);
            streams.push_back(s);
          }
          http_response r;
          r.later = s;
          return r;
        },
        true);
    http.route(
        "GET", "/hang",
        [this](http_request&) {
          http_response r;
          r.later = std::make_shared<never>(cancels);
          return r;
        },
        true);
    http.route(
        "GET", "/big",
        [this](http_request&) {
          auto s = std::make_shared<ticking_stream>(5000000, cancels);  // ~100 MB
          s->ticks = 5000000;  // all ready at once: only the client limits it
          http_response r;
          r.later = s;
          return r;
        },
        true);
    port = http.bind("127.0.0.1", 0);
    loop = std::thread([this] { http.run(); });
    ticker = std::thread([this] {
      while (!done) {
        std::this_thread::sleep_for(20ms);
        std::vector<std::shared_ptr<ticking_stream>> all;
        {
          std::lock_guard<std::mutex> lk(m);
          all = streams;
        }
        for (auto& s : all) {
          s->tick();
        }
      }
    });
  }
  ~stub() { stop(); }
  void stop() {
    if (!stopped) {
      stopped = true;
      http.stop();
      loop.join();
      done = true;
      ticker.join();
    }
  }
  static http_limits short_limits() {
    http_limits l;
    l.header_timeout = 1.0;
    l.request_timeout = 2.0;
    l.keep_alive_timeout = 1.0;
    l.write_timeout = 1.5;
    l.worker_threads = 2;
    l.max_connections_per_client = 100;
    return l;
  }
  // GET /health from `from`: the seconds it took, or a large number when it got no 200.
  double health(const char* from = "127.0.0.1") {
    const auto t0 = clock_type::now();
    raw c(port, from);
    c.send(get("/health", "Connection: close\r\n"));
    const std::string r = c.response(5);
    return status_of(r) == 200 ? since(t0) : 1e9;
  }

  http_server http;
  int port = 0;
  std::thread loop, ticker;
  std::atomic<bool> done{false};
  bool stopped = false;
  std::mutex m;
  std::vector<std::shared_ptr<ticking_stream>> streams;
  std::atomic<int> cancels{0};
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

TEST_CASE("http: heads are read strictly, each refusal with its status") {
  const head_limits l;
  auto parse = [&](const std::string& h, request_head& out) {
    return parse_head(h, l, out);
  };
  request_head ok;
  REQUIRE(
      !parse("POST /v1/completions?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 12\r\n"
             "Content-Type: application/json\r\nConnection: keep-alive\r\n\r\n",
             ok));
  CHECK(ok.request.method == "POST");
  CHECK(ok.request.path == "/v1/completions");
  CHECK(ok.request.query == "x=1");
  CHECK(ok.content_length == 12);
  CHECK(ok.keep_alive);
  CHECK(*ok.request.header("content-type") == "application/json");
  request_head lf;  // bare LF line ends, and empty lines before the request line
  REQUIRE(!parse("\r\nGET /health HTTP/1.0\nX: y\n\n", lf));
  CHECK(!lf.keep_alive);  // HTTP/1.0: one answer per connection
  CHECK(lf.request.minor == 0);
  request_head closing;
  REQUIRE(!parse("GET / HTTP/1.1\r\nHost: a\r\nConnection: Close\r\n\r\n", closing));
  CHECK(!closing.keep_alive);

  const std::vector<std::pair<std::string, int>> bad = {
      {"GET /\r\n\r\n", 400},
      {"GET  / HTTP/1.1\r\nHost: a\r\n\r\n", 400},
      {"GET http://x/ HTTP/1.1\r\nHost: a\r\n\r\n", 400},
      {"G(T / HTTP/1.1\r\nHost: a\r\n\r\n", 400},
      {"GET / HTTP/2.0\r\nHost: a\r\n\r\n", 505},
      {"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505},  // HTTP/2's preface
      {"GET / HTTP/1.1\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nHost : a\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nHost: a\r\nX: a\x01b\r\n\r\n", 400},
      {"GET / HTTP/1.1\r\nHost: a\r\nX: a\rb\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n", 411},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n", 501},
      {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
       400},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1e3\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999999999999999\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n", 400},
      {"POST / HTTP/1.1\r\nHost: a\r\nExpect: magic\r\n\r\n", 417},
  };
  for (const auto& [head, status] : bad) {
    CAPTURE(head);
    request_head r;
    const auto e = parse(head, r);
    REQUIRE(e);
    CHECK(e->status == status);
    CHECK(!e->message.empty());
  }
  std::string many = "GET / HTTP/1.1\r\nHost: a\r\n";
  for (int i = 0; i < 64; ++i) {
    many += "X-" + std::to_string(i) + ": 1\r\n";
  }
  request_head r;
  CHECK(parse(many + "\r\n", r)->status == 431);  // 65 fields
  CHECK(parse_head("GET / HTTP/1.1\r\nHost: a\r\nX: " + std::string(20000, 'a') + "\r\n\r\n", l, r)
            ->status == 431);
  // Where heads end.
  CHECK(head_end("GET / HTTP/1.1\r\nHost: a\r\n\r\nBODY", 0) == 27);
  CHECK(head_end("GET / HTTP/1.1\nHost: a\n\nBODY", 0) == 24);
  CHECK(head_end("GET / HTTP/1.1\r\nHost: a\r\n", 0) == std::string::npos);
}

TEST_CASE("http: clients dribbling their heads do not starve /health and are timed out") {
  // Row 1 of the hostile-client table: 32-40 connections sending headers one byte a second made
  // every /health time out for as long as they stayed, and 3 of them held off SIGTERM.
  stub s;
  std::atomic<bool> go{true};
  std::vector<std::unique_ptr<raw>> slow;
  for (int i = 0; i < 40; ++i) {
    slow.push_back(std::make_unique<raw>(s.port, "127.0.0.2"));
  }
  std::thread dribble([&] {
    const std::string head = "POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";
    for (std::size_t k = 0; go && k < head.size() + 200; ++k) {
      for (auto& c : slow) {
        c->send(std::string(1, k < head.size() ? head[k] : 'a'));
      }
      std::this_thread::sleep_for(100ms);
    }
  });
  std::vector<double> t;
  for (int i = 0; i < 15; ++i) {
    t.push_back(s.health());
    std::this_thread::sleep_for(20ms);
  }
  MESSAGE("/health beside 40 dribbling clients: median " << median(t) << " s, most "
                                                         << *std::max_element(t.begin(), t.end()));
  CHECK(median(t) < 0.1);
  CHECK(*std::max_element(t.begin(), t.end()) < 1.0);
  // The header timeout (1 s here) ends each of them with 408, whatever it keeps sending.
  const auto t0 = clock_type::now();
  int timed_out = 0;
  for (auto& c : slow) {
    bool closed = false;
    const std::string got = c->until_closed(4.0, &closed);
    timed_out += closed && status_of(got) == 408;
  }
  go = false;
  dribble.join();
  CHECK(timed_out == 40);
  CHECK(since(t0) < 5.0);
  CHECK(s.http.counters().timeouts >= 40);
  // Three more, then the server stops: it does not wait for them.
  std::vector<std::unique_ptr<raw>> three;
  for (int i = 0; i < 3; ++i) {
    three.push_back(std::make_unique<raw>(s.port, "127.0.0.2"));
    three.back()->send("GET /health HTTP/1.1\r\nHo");
  }
  const auto t1 = clock_type::now();
  s.stop();
  CHECK(since(t1) < 1.0);
}

TEST_CASE("http: a flood of header fields gets 431 and the connection closes, bounded") {
  // Row 4: 1M header fields (50 MiB) grew the server's memory by 180 MiB, never released.
  stub s;
  raw c(s.port, "127.0.0.3");
  std::atomic<std::size_t> sent{0};
  std::thread flood([&] {
    std::string block = "POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\n";
    std::string fields;
    for (int i = 0; i < 1000; ++i) {
      fields += "X-Field-" + std::to_string(i) + ": value\r\n";
    }
    c.send(block);
    while (sent < (std::size_t{50} << 20) && c.send(fields)) {
      sent += fields.size();
    }
  });
  bool closed = false;
  const std::string got = c.until_closed(10.0, &closed);
  flood.join();
  CHECK(status_of(got) == 431);
  CHECK(closed);
  MESSAGE("the flood sent " << sent << " bytes before the server closed the connection");
  CHECK(sent < (std::size_t{50} << 20));  // closed long before the 50 MiB were sent
  CHECK(s.health() < 1.0);
}

TEST_CASE("http: pipelined requests are answered in order on one connection") {
  // Row 6: only the first was answered; the connection then hung for 5 s.
  stub s;
  raw c(s.port);
  c.send(get("/health") + post("/echo", "first") + get("/health") + post("/echo", "second"));
  const std::string a = c.response(), b = c.response(), d = c.response(), e = c.response();
  CHECK(status_of(a) == 200);
  CHECK(body_of(b) == "first");
  CHECK(status_of(d) == 200);
  CHECK(body_of(e) == "second");
  CHECK(e.find("Connection: keep-alive") != std::string::npos);
  // A stream among them: its chunks, then the next answer.
  c.send(get("/stream/3") + post("/echo", "after"));
  const std::string st = c.response(), f = c.response();
  CHECK(st.find("Transfer-Encoding: chunked") != std::string::npos);
  CHECK(st.find("data: 2") != std::string::npos);
  CHECK(body_of(f) == "after");
  // Connection: close ends it after the answer.
  c.send(post("/echo", "last", "Connection: close\r\n"));
  bool closed = false;
  const std::string g = c.until_closed(3.0, &closed);
  CHECK(body_of(g) == "last");
  CHECK(closed);
  // Idle keep-alive connections close after their timeout (1 s here).
  raw idle(s.port);
  idle.send(get("/health"));
  CHECK(status_of(idle.response()) == 200);
  const auto t0 = clock_type::now();
  idle.until_closed(4.0, &closed);
  CHECK(closed);
  CHECK(since(t0) < 3.0);
}

TEST_CASE("http: an HTTP/1.0 stream is plain bytes until the connection closes") {
  // Row 10: chunked encoding and keep-alive went to HTTP/1.0 clients, which cannot read them.
  stub s;
  raw c(s.port);
  c.send("GET /stream/4 HTTP/1.0\r\n\r\n");
  bool closed = false;
  const std::string got = c.until_closed(5.0, &closed);
  CHECK(closed);
  CHECK(status_of(got) == 200);
  CHECK(got.find("Transfer-Encoding") == std::string::npos);
  CHECK(got.find("Connection: close") != std::string::npos);
  CHECK(body_of(got) == "data: 0\n\ndata: 1\n\ndata: 2\n\ndata: 3\n\n");
  raw d(s.port);  // HTTP/1.0 whole answers close too
  d.send("POST /echo HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi");
  const std::string w = d.until_closed(3.0, &closed);
  CHECK(closed);
  CHECK(body_of(w) == "hi");
}

TEST_CASE("http: 40 streams and 40 idle keep-alive clients hold no thread; /health answers") {
  // Row 11: each open stream held one of 32 HTTP threads: /health took 35 s, a connection was
  // reset. Here the handlers have 2 worker threads in all.
  stub s;
  std::vector<std::unique_ptr<raw>> idle, streams;
  for (int i = 0; i < 40; ++i) {
    idle.push_back(std::make_unique<raw>(s.port, "127.0.0.4"));
    idle.back()->send(get("/health"));
    CHECK(status_of(idle.back()->response()) == 200);
  }
  for (int i = 0; i < 40; ++i) {
    streams.push_back(std::make_unique<raw>(s.port, "127.0.0.5"));
    streams.back()->send(get("/stream/40"));  // 40 ticks of 20 ms: under a second each
  }
  std::vector<double> t;
  for (int i = 0; i < 10; ++i) {
    t.push_back(s.health());
  }
  MESSAGE("/health beside 40 streams and 40 idle clients: median " << median(t) << " s");
  CHECK(median(t) < 0.1);
  CHECK(*std::max_element(t.begin(), t.end()) < 1.0);
  int complete = 0;
  for (auto& c : streams) {
    const std::string r = c->response(10);
    complete +=
        r.find("data: 39\n\n") != std::string::npos && r.find("\r\n0\r\n\r\n") != std::string::npos;
  }
  CHECK(complete == 40);
  CHECK(s.cancels == 0);
}

TEST_CASE("http: connection limits per client and in all; the limits of bodies") {
  http_limits l = stub::short_limits();
  l.max_connections_per_client = 8;
  l.max_connections = 20;
  l.max_body_bytes = 1000;
  stub s(l);
  std::vector<std::unique_ptr<raw>> mine;
  for (int i = 0; i < 8; ++i) {
    mine.push_back(std::make_unique<raw>(s.port, "127.0.0.6"));
    mine.back()->send(get("/health"));
    CHECK(status_of(mine.back()->response()) == 200);
  }
  raw ninth(s.port, "127.0.0.6");  // accepted by the kernel, refused by the server
  bool closed = false;
  const std::string r9 = ninth.until_closed(3.0, &closed);
  CHECK(status_of(r9) == 503);
  CHECK(r9.find("per client") != std::string::npos);
  CHECK(closed);
  CHECK(s.health("127.0.0.7") < 1.0);  // another client is served
  std::vector<std::unique_ptr<raw>> others;
  for (int i = 0; i < 12; ++i) {
    others.push_back(std::make_unique<raw>(s.port, ("127.0.1." + std::to_string(i + 1)).c_str()));
    others.back()->send(get("/health"));
    CHECK(status_of(others.back()->response()) == 200);
  }
  raw over(s.port, "127.0.2.1");  // 21 connections: over the limit in all
  const std::string r21 = over.until_closed(3.0, &closed);
  CHECK(status_of(r21) == 503);
  CHECK(s.http.counters().connections_refused == 2);
  mine.clear();
  others.clear();
  std::this_thread::sleep_for(200ms);
  CHECK(s.health("127.0.0.6") < 1.0);  // the client's connections closed: it may connect again

  // A body over the limit: 413 from its Content-Length, before a byte of it is read.
  raw big(s.port);
  big.send("POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 5000\r\n\r\n");
  CHECK(status_of(big.response(3)) == 413);
  // Expect: 100-continue: the interim answer, then the body, then the answer.
  raw cont(s.port);
  cont.send("POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n");
  std::string interim;
  for (int i = 0; i < 40 && interim.find("\r\n\r\n") == std::string::npos; ++i) {
    cont.read_some(interim, 0.05);
  }
  CHECK(interim.rfind("HTTP/1.1 100 Continue\r\n\r\n", 0) == 0);
  cont.buffer = interim.substr(25);
  cont.send("hello");
  CHECK(body_of(cont.response()) == "hello");
  // A body that stops coming: 408 after the request timeout (2 s here).
  raw stalled(s.port);
  stalled.send("POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\nonly this");
  const auto t0 = clock_type::now();
  const std::string r408 = stalled.until_closed(5.0, &closed);
  CHECK(status_of(r408) == 408);
  CHECK(since(t0) < 4.0);
  // Unknown paths and methods.
  raw c(s.port);
  c.send(get("/nothing"));
  CHECK(status_of(c.response()) == 404);
  raw m(s.port);
  m.send("DELETE /health HTTP/1.1\r\nHost: a\r\n\r\n");
  const std::string r405 = m.response();
  CHECK(status_of(r405) == 405);
  raw h(s.port);
  h.send("HEAD /health HTTP/1.1\r\nHost: a\r\n\r\n");
  std::string head_only;
  h.read_some(head_only, 2.0);
  CHECK(status_of(head_only) == 200);
  CHECK(body_of(head_only).empty());
}

TEST_CASE("http: a client that leaves cancels its request at once; one that never reads too") {
  stub s;
  {
    raw c(s.port);
    c.send(get("/hang"));
    std::this_thread::sleep_for(200ms);
    CHECK(s.cancels == 0);
  }  // gone
  const auto t0 = clock_type::now();
  while (s.cancels == 0 && since(t0) < 2.0) {
    std::this_thread::sleep_for(10ms);
  }
  CHECK(s.cancels == 1);
  CHECK(since(t0) < 0.5);
  // Mid-stream.
  {
    raw c(s.port);
    c.send(get("/stream/1000"));
    std::string got;
    while (got.find("data: 2") == std::string::npos && c.read_some(got, 0.5) && got.size() < 1000) {
    }
  }
  const auto t1 = clock_type::now();
  while (s.cancels == 1 && since(t1) < 2.0) {
    std::this_thread::sleep_for(10ms);
  }
  CHECK(s.cancels == 2);
  // A client that reads nothing of a large stream: closed after the write timeout (1.5 s).
  raw deaf(s.port);
  int small = 4096;
  setsockopt(deaf.fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  deaf.send(get("/big"));
  const auto t2 = clock_type::now();
  while (s.cancels == 2 && since(t2) < 6.0) {
    std::this_thread::sleep_for(20ms);
  }
  CHECK(s.cancels == 3);
  CHECK(since(t2) < 5.0);
  CHECK(s.health() < 1.0);
}

TEST_CASE("http: stop_accepting lets answers under way finish, then drain and stop") {
  stub s;
  raw idle(s.port);
  idle.send(get("/health"));
  CHECK(status_of(idle.response()) == 200);
  raw streaming(s.port);
  streaming.send(get("/stream/25"));  // half a second
  std::this_thread::sleep_for(100ms);
  s.http.stop_accepting();
  std::this_thread::sleep_for(100ms);
  bool closed = false;
  idle.until_closed(1.0, &closed);
  CHECK(closed);  // a connection with no request closes
  // No new connections.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(s.port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  CHECK(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0);
  ::close(fd);
  const std::string r = streaming.until_closed(5.0, &closed);
  CHECK(r.find("data: 24") != std::string::npos);
  CHECK(closed);  // its stream ended: the connection closes
  CHECK(s.http.drain(2.0));
  s.stop();
}
