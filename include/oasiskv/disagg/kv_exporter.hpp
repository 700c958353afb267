// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `kv_exporter`: the prefill side. Holds finished requests' KV in a registered host
//! arena and serves the decode nodes that read it: a token-checked control channel on TCP hands
//! out layouts, block tables, generations and summaries; UCX gets read the blocks.
#pragma once

#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "oasiskv/allocator/free_list_allocator.hpp"
#include "oasiskv/disagg/protocol.hpp"
#include "oasiskv/disagg/socket.hpp"
#include "oasiskv/disagg/ucx_common.hpp"
#include "oasiskv/disagg/wire_summary.hpp"
#include "oasiskv/tier/host_tier.hpp"

namespace oasiskv::disagg {

using token_type = std::array<std::byte, token_bytes>;

struct exporter_options {
  std::string address = "127.0.0.1";  //!< control channel; loopback unless told otherwise
  std::uint16_t port = 0;             //!< 0: any free port (see `kv_exporter::port()`)
  token_type token{};  //!< the shared secret a decode node proves in the handshake (never sent)
  std::chrono::milliseconds lease{30000};  //!< a lease lapses unless extended by heartbeats
  std::uint32_t max_connections = 64;
  //! A connection must present a valid `hello` within this long of connecting, and a frame once
  //! begun must arrive whole within it; a reply not taken by the peer within it closes the
  //! connection. No peer ever holds the loop: every connection is served without blocking.
  std::chrono::milliseconds io_timeout{1000};
  //! An authenticated connection that sends nothing for this long is closed (decode nodes
  //! heartbeat every lease / 3). 0: twice the lease.
  std::chrono::milliseconds idle_timeout{0};
  //! Summary bytes per `summary_chunk` frame after an `opened`; 0: `limits::max_summary_chunk`.
  std::uint32_t summary_chunk_bytes = 0;
  //! How long the progress thread keeps polling UCX after its last event before it sleeps on
  //! the worker's event descriptor: longer answers a burst of gets sooner, shorter leaves the
  //! prefill node's cores to prefill.
  std::chrono::microseconds busy_poll{2000};
  //! Create the UCX context with `UCP_FEATURE_WAKEUP` and sleep on the worker's event
  //! descriptor when idle. UCX leaves out transports that cannot wake a worker (e.g. SRD): set
  //! false on such fabrics, and the idle thread naps 500 us at a time instead.
  bool wakeup = true;
};

struct exporter_stats {
  //! `refused`: connections turned away at accept (`max_connections`) or closed before the
  //! handshake completed (no or a bad proof, a frame too large, silence past `io_timeout`).
  std::uint64_t opens = 0, releases = 0, leases_expired = 0, refused = 0, bad_messages = 0;
  //! Authenticated connections closed for holding the exporter: silence past the idle timeout, a
  //! frame begun and not finished, or a reply not taken, within `io_timeout`.
  std::uint64_t timed_out = 0;
  //! Leases released because the decode node no longer named them in a heartbeat (an open it
  //! gave up on), and leases a reconnected decode node took back from its lost session.
  std::uint64_t abandoned = 0, resumed = 0;
  std::uint64_t freed_requests = 0;
  //! Sleeps of the progress thread when idle (on the worker's event descriptor, or naps without
  //! `exporter_options::wakeup`), and how many of them UCX ended (a get or message arrived)
  //! rather than the stop-check timeout.
  std::uint64_t progress_sleeps = 0, progress_wakeups = 0;
};

//! @brief The exporter of one prefill process. Thread-safe: prefill calls `allocate`, `publish`
//! and `drop` from any thread while the control and progress threads serve decode nodes.
class kv_exporter {
 public:
  //! Throws `errc::invalid_argument` naming the option for a lease, timeout or connection limit
  //! of 0, and for the all-zero token (the default, which any peer could present).
  kv_exporter(const kv_layout& layout, std::uint32_t num_slots, exporter_options options)
      : options_(validated(std::move(options))),
        arena_(layout, num_slots),
        slots_(num_slots),
        gen_table_(num_slots),
        generations_(gen_table_.data),
        context_(options_.wakeup),
        worker_(context_),
        arena_reg_(context_, arena_.slot_data(0), arena_.bytes()),
        gen_reg_(context_, generations_, std::size_t{num_slots} * 8),
        worker_address_(worker_.address()) {
    listen_ = listen_tcp(options_.address, options_.port, port_);
    if (options_.wakeup) {
      event_fd_ = worker_.event_fd();
    }
    progress_ = std::thread([this] { progress_loop(); });
    control_ = std::thread([this] { control_loop(); });
  }
  kv_exporter(const kv_exporter&) = delete;
  kv_exporter& operator=(const kv_exporter&) = delete;
  ~kv_exporter() {
    stop_.store(true);
    control_.join();
    progress_.join();
  }

  std::uint16_t port() const noexcept { return port_; }
  const kv_layout& layout() const noexcept { return arena_.layout(); }
  std::size_t free_slots() const {
    std::lock_guard lock(mutex_);
    return slots_.available();
  }
  exporter_stats stats() const {
    std::lock_guard lock(mutex_);
    exporter_stats s = stats_;
    s.progress_sleeps = sleeps_.load(std::memory_order_relaxed);
    s.progress_wakeups = wakeups_.load(std::memory_order_relaxed);
    return s;
  }
  bool holds(std::uint64_t seq) const {
    std::lock_guard lock(mutex_);
    return requests_.contains(seq);
  }

  //! @brief Reserves the slots of request `seq` of `tokens` tokens: `[num_layers][blocks]`.
  //! The prefill writes its KV there (`slot_data`), then calls `publish`.
  std::vector<slot_id> allocate(std::uint64_t seq, std::uint32_t tokens) {
    const kv_layout& l = layout();
    std::lock_guard lock(mutex_);
    if (tokens == 0 || requests_.contains(seq)) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "kv_exporter::allocate: request ", seq,
                             tokens == 0 ? " has no tokens" : " already exists");
    }
    const std::size_t n = std::size_t{l.num_layers} * l.blocks_for(tokens);
    if (n > slots_.available()) [[unlikely]] {
      oasiskv::detail::raise(errc::capacity_exceeded, "kv_exporter::allocate: request ", seq,
                             " needs ", n, " slots, ", slots_.available(), " free");
    }
    request r;
    r.tokens = tokens;
    for (std::size_t i = 0; i < n; ++i) {
      r.slots.push_back(*slots_.allocate());
    }
    auto out = r.slots;
    requests_.emplace(seq, std::move(r));
    return out;
  }

  std::byte* slot_data(slot_id s) { return arena_.slot_data(s); }

  //! @brief Makes request `seq` visible to decode nodes; computes its block summaries.
  //! The summaries are computed without holding the exporter's lock, so decode nodes are served
  //! meanwhile (a large request takes seconds). Publishing a request again, or one dropped
  //! meanwhile, throws `errc::unknown_sequence` / `errc::invalid_argument`.
  void publish(std::uint64_t seq) {
    const kv_layout& l = layout();
    std::vector<slot_id> slots;
    std::uint32_t tokens = 0;
    {
      std::lock_guard lock(mutex_);
      request& r = find(seq, "publish");
      if (r.published || r.publishing) [[unlikely]] {
        oasiskv::detail::raise(errc::invalid_argument, "kv_exporter::publish: request ", seq,
                               " is already published");
      }
      r.publishing = true;
      slots = r.slots;
      tokens = r.tokens;
    }
    const std::uint32_t blocks = l.blocks_for(tokens);
    std::vector<std::byte> summaries(slots.size() * summary_bytes(l));
    for (std::size_t i = 0; i < slots.size(); ++i) {
      const std::uint32_t b = static_cast<std::uint32_t>(i % blocks);
      const std::uint32_t filled =
          b + 1 < blocks ? l.tokens_per_block : tokens - b * l.tokens_per_block;
      summarize_block(l, arena_.slot_data(slots[i]), filled,
                      summaries.data() + i * summary_bytes(l));
    }
    std::lock_guard lock(mutex_);
    auto it = requests_.find(seq);
    if (it == requests_.end() || it->second.slots != slots) [[unlikely]] {
      oasiskv::detail::raise(errc::unknown_sequence, "kv_exporter::publish: request ", seq,
                             " was dropped while its summaries were computed");
    }
    it->second.summaries = std::move(summaries);
    it->second.publishing = false;
    it->second.published = true;
  }

  //! @brief Frees request `seq` now, leased or not (its blocks' generations change, so a
  //! decode node still reading them finds out).
  void drop(std::uint64_t seq) {
    std::lock_guard lock(mutex_);
    find(seq, "drop");
    free_request(seq);
  }

 private:
  struct request {
    std::uint32_t tokens = 0;
    std::vector<slot_id> slots;
    std::vector<std::byte> summaries;
    bool published = false;
    bool publishing = false;  // summaries being computed, outside the lock
    std::uint64_t owner = 0;  // session holding the lease; 0: none
    steady::time_point expiry{};
  };
  // One control connection, served without blocking: bytes are read as they arrive into the
  // frame being received, and a reply waits in `out` until the socket takes it.
  struct connection {
    fd_handle fd;
    std::uint64_t session = 0;  // 0 until a valid hello
    std::string peer;
    steady::time_point accepted{};
    steady::time_point last_frame{};   // the last whole frame received
    steady::time_point frame_begun{};  // the first byte of the frame being received
    std::array<std::byte, header_bytes> head{};
    std::size_t head_got = 0;
    std::optional<frame_header> header;  // once the header is whole
    std::vector<std::byte> payload;      // grows as the payload arrives
    std::vector<std::byte> out;          // reply bytes not yet sent
    std::size_t out_sent = 0;
    steady::time_point out_since{};
    bool closing = false;  // close once `out` is sent (a refusal, a protocol violation)
    // The handshake.
    bool challenged = false;
    nonce_type hello_nonce{}, challenge_nonce{};
    std::string client;
    std::uint64_t resume = 0;
  };
  // Payload bytes a frame may carry before its connection has presented a valid hello: a hello
  // is a token and a name.
  static constexpr std::uint32_t pre_auth_payload = 4096;
  // Reply bytes a connection may leave untaken before the exporter stops reading its requests.
  static constexpr std::size_t max_pending_reply = 1u << 20;

  // The generation table gets its own pages: it is registered, and on tcp/sm a registration
  // exposes whatever memory it names.
  struct generation_table {
    explicit generation_table(std::uint32_t n) : bytes(std::size_t{n} * 8) {
      void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) [[unlikely]] {
        oasiskv::detail::raise(errc::out_of_memory, "kv_exporter: generation table of ", n,
                               " slots");
      }
      data = static_cast<std::uint64_t*>(p);
      std::fill(data, data + n, std::uint64_t{1});
    }
    generation_table(const generation_table&) = delete;
    generation_table& operator=(const generation_table&) = delete;
    ~generation_table() { ::munmap(data, bytes); }
    std::size_t bytes;
    std::uint64_t* data = nullptr;
  };

  static exporter_options validated(exporter_options o) {
    auto bad = [](const char* what, auto value, const char* rule = " must be positive") {
      oasiskv::detail::raise(errc::invalid_argument, "exporter_options.", what, " = ", value, rule);
    };
    if (o.lease.count() <= 0) {
      bad("lease (ms)", o.lease.count());
    }
    if (o.io_timeout.count() <= 0) {
      bad("io_timeout (ms)", o.io_timeout.count());
    }
    if (o.idle_timeout.count() < 0) {
      bad("idle_timeout (ms)", o.idle_timeout.count(),
          " must not be negative (0: twice the lease)");
    }
    if (o.max_connections == 0) {
      bad("max_connections", o.max_connections);
    }
    if (o.summary_chunk_bytes > limits::max_summary_chunk) [[unlikely]] {
      bad("summary_chunk_bytes", o.summary_chunk_bytes, " must be at most 16 MiB (0: 16 MiB)");
    }
    if (std::all_of(o.token.begin(), o.token.end(), [](std::byte b) { return b == std::byte{0}; }))
        [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument,
                             "exporter_options.token is all zero: set a secret token that decode "
                             "nodes present in hello");
    }
    return o;
  }

  request& find(std::uint64_t seq, const char* what) {
    auto it = requests_.find(seq);
    if (it == requests_.end()) [[unlikely]] {
      oasiskv::detail::raise(errc::unknown_sequence, "kv_exporter::", what, ": request ", seq,
                             " is not held");
    }
    return it->second;
  }

  // Lock held. The generation moves before the slot can be reused, so a reader that checks it
  // after its get sees the change whenever the bytes it read may have been overwritten.
  void free_request(std::uint64_t seq) {
    request& r = requests_.at(seq);
    for (slot_id s : r.slots) {
      std::atomic_ref<std::uint64_t>(generations_[s]).fetch_add(1, std::memory_order_release);
      slots_.deallocate(s);
    }
    requests_.erase(seq);
    ++stats_.freed_requests;
  }

  void progress_loop() {
    // Over tcp and shared memory a get is served in software by this worker, so it must be
    // progressed whenever a get arrives. It polls while there is traffic and for `busy_poll`
    // after it, then sleeps on the worker's event descriptor until UCX signals the next one
    // (armed first, which UCX refuses while events are pending). The poll's timeout only
    // bounds how late the destructor's stop is seen. Idle, the thread costs nothing; the
    // first get after an idle spell pays one wake-up. Without the wake-up feature it naps.
    auto last_active = steady::now();
    while (!stop_.load(std::memory_order_relaxed)) {
      unsigned progressed = 0;
      {
        const detail::ignore_reads_for_tsan ignore;  // UCX's copies serving remote gets
        progressed = ucp_worker_progress(worker_.get());
      }
      if (progressed != 0) {
        last_active = steady::now();
        continue;
      }
      if (steady::now() - last_active < options_.busy_poll) {
        std::this_thread::yield();
        continue;
      }
      if (event_fd_ < 0) {
        sleeps_.fetch_add(1, std::memory_order_relaxed);
        std::this_thread::sleep_for(std::chrono::microseconds(500));
        continue;
      }
      const ucs_status_t armed = ucp_worker_arm(worker_.get());
      if (armed == UCS_ERR_BUSY) {
        continue;  // events arrived since the progress: serve them first
      }
      if (armed != UCS_OK) [[unlikely]] {
        std::this_thread::sleep_for(std::chrono::microseconds(50));  // cannot sleep on it: poll
        continue;
      }
      pollfd p{event_fd_, POLLIN, 0};
      sleeps_.fetch_add(1, std::memory_order_relaxed);
      if (::poll(&p, 1, 20) > 0) {
        wakeups_.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }

  void control_loop() {
    std::vector<connection> conns;
    conns_ = &conns;
    std::vector<pollfd> fds;
    while (!stop_.load()) {
      // Nothing a peer sends or fails to take may end this thread: a connection whose service
      // throws anything is closed, and the loop goes on.
      try {
        fds.clear();
        fds.push_back({listen_.get(), POLLIN, 0});
        for (const connection& c : conns) {
          // A peer that does not take its replies is not read from either (its requests back
          // up in its own socket), so the replies it leaves here stay bounded.
          const bool backlog = c.out.size() - c.out_sent > max_pending_reply;
          const short events = static_cast<short>(c.out.size() > c.out_sent ? POLLOUT : 0) |
                               static_cast<short>(c.closing || backlog ? 0 : POLLIN);
          fds.push_back({c.fd.get(), events, 0});
        }
        ::poll(fds.data(), fds.size(), 20);
        if (fds[0].revents & POLLIN) {
          accept_one(conns);
        }
        for (std::size_t i = 1; i < fds.size(); ++i) {
          connection& c = conns[i - 1];
          try {
            if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) {
              receive(c);
            }
            if (c.fd && c.out.size() > c.out_sent) {
              flush_out(c);
            }
          } catch (const std::exception&) {
            c.fd.reset();  // e.g. std::bad_alloc for a frame this process cannot hold
          }
        }
        expire_connections(conns);
        for (const connection& c : conns) {
          if (!c.fd && c.session != 0) {
            live_sessions_.erase(c.session);  // its leases stay until they lapse or it resumes
          } else if (!c.fd) {
            std::lock_guard lock(mutex_);
            ++stats_.refused;  // closed before the handshake completed, for whatever reason
          }
        }
        std::erase_if(conns, [](const connection& c) { return !c.fd; });
        reap_leases();
      } catch (const std::exception&) {
        std::lock_guard lock(mutex_);
        ++stats_.bad_messages;
      }
    }
  }

  void accept_one(std::vector<connection>& conns) {
    fd_handle fd(::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!fd || conns.size() >= options_.max_connections) {
      std::lock_guard lock(mutex_);
      ++stats_.refused;
      return;
    }
    connection c;
    c.peer = "decode peer fd " + std::to_string(fd.get());
    c.fd = std::move(fd);
    c.accepted = c.last_frame = steady::now();
    conns.push_back(std::move(c));
  }

  std::chrono::milliseconds idle_timeout() const noexcept {
    return options_.idle_timeout.count() > 0 ? options_.idle_timeout : 2 * options_.lease;
  }

  // Closes connections that hold the exporter without making progress: no valid hello within
  // `io_timeout`, a frame begun and not finished within it, a reply the peer does not take
  // within it, or (authenticated) silence beyond the idle timeout.
  void expire_connections(std::vector<connection>& conns) {
    const auto now = steady::now();
    for (connection& c : conns) {
      if (!c.fd) {
        continue;
      }
      const bool no_hello = c.session == 0 && now - c.accepted > options_.io_timeout;
      const bool slow_frame =
          (c.head_got > 0 || c.header) && now - c.frame_begun > options_.io_timeout;
      const bool stuck_reply = c.out.size() > c.out_sent && now - c.out_since > options_.io_timeout;
      const bool idle = c.session != 0 && now - c.last_frame > idle_timeout();
      if (no_hello || slow_frame || stuck_reply || idle) {
        if (c.session != 0) {
          std::lock_guard lock(mutex_);
          ++stats_.timed_out;  // (unauthenticated ones count as refused when they close)
        }
        c.fd.reset();
      }
    }
  }

  // Reads what the socket has; serves each frame that becomes whole.
  void receive(connection& c) {
    std::array<std::byte, 64 * 1024> buf;
    for (;;) {
      const ssize_t n = ::recv(c.fd.get(), buf.data(), buf.size(), 0);
      if (n == 0) {
        c.fd.reset();  // closed by the peer
        return;
      }
      if (n < 0) {
        if (errno == EINTR) {
          continue;
        }
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
          c.fd.reset();
        }
        return;
      }
      std::span<const std::byte> in(buf.data(), static_cast<std::size_t>(n));
      while (!in.empty() && c.fd && !c.closing) {
        in = consume(c, in);
      }
      if (c.closing || !c.fd || c.out.size() - c.out_sent > max_pending_reply) {
        return;  // (a backlog of replies: read on once the peer takes them)
      }
    }
  }

  // Takes bytes of the frame being received; serves it when whole. Returns the bytes left.
  std::span<const std::byte> consume(connection& c, std::span<const std::byte> in) {
    if (c.head_got == 0 && !c.header) {
      c.frame_begun = steady::now();
    }
    if (!c.header) {
      const std::size_t k = std::min(in.size(), header_bytes - c.head_got);
      std::memcpy(c.head.data() + c.head_got, in.data(), k);
      c.head_got += k;
      in = in.subspan(k);
      if (c.head_got < header_bytes) {
        return in;
      }
      try {
        c.header = decode_header(c.head);
      } catch (const error& e) {
        refuse(c, e, 0, false);
        return {};
      }
      if (c.session == 0 && c.header->payload_bytes > pre_auth_payload) {
        refuse(c,
               error(errc::invalid_argument, "oasiskv: kv_exporter: refused: a frame of " +
                                                 std::to_string(c.header->payload_bytes) +
                                                 " payload bytes before hello"),
               c.header->request_id, true);
        return {};
      }
      c.payload.clear();
      c.payload.reserve(std::min<std::size_t>(c.header->payload_bytes, 1u << 20));
    }
    const std::size_t want = c.header->payload_bytes - c.payload.size();
    const std::size_t k = std::min(in.size(), want);
    c.payload.insert(c.payload.end(), in.begin(), in.begin() + static_cast<std::ptrdiff_t>(k));
    in = in.subspan(k);
    if (c.payload.size() < c.header->payload_bytes) {
      return in;
    }
    const frame_header h = *c.header;
    c.header.reset();
    c.head_got = 0;
    c.last_frame = steady::now();
    received_frame f;
    f.header = h;
    try {
      f.body = parse_payload(h.type, c.payload);
    } catch (const error& e) {
      refuse(c, e, h.request_id, false);
      return {};
    }
    serve(c, f);
    return in;
  }

  // Answers a frame it could not take with an error and closes the connection after it.
  void refuse(connection& c, const error& e, std::uint64_t id, bool unauthenticated) {
    std::lock_guard lock(mutex_);
    if (!unauthenticated && c.session != 0) {
      ++stats_.bad_messages;  // (unauthenticated ones count as refused when they close)
    }
    queue_reply(c, error_msg{static_cast<std::uint32_t>(e.code()), e.what()}, id);
    c.closing = true;
  }

  // Serves one whole frame: the state is read and changed under the lock, the reply is encoded
  // and sent after it (a slow reader never holds the lock).
  void serve(connection& c, const received_frame& f) {
    std::vector<message> replies;
    try {
      if (!dispatch(c, f, replies)) {
        c.closing = true;
      }
    } catch (const error& e) {
      replies.assign(1, error_msg{static_cast<std::uint32_t>(e.code()), e.what()});
      if (e.code() == errc::invalid_argument) {
        c.closing = true;  // a protocol violation ends the session
      }
    }
    for (const message& m : replies) {
      queue_reply(c, m, f.header.request_id);
    }
  }

  std::size_t summary_chunk_bytes() const noexcept {
    return options_.summary_chunk_bytes == 0 ? limits::max_summary_chunk
                                             : options_.summary_chunk_bytes;
  }

  // The handshake (see protocol.hpp): hello -> challenge, auth -> hello_ack. False refuses.
  bool handshake(connection& c, const received_frame& f, std::vector<message>& out) {
    auto refuse_with = [&](const char* why) {
      out.push_back(error_msg{static_cast<std::uint32_t>(errc::invalid_argument),
                              std::string("oasiskv: kv_exporter: refused: ") + why});
      return false;
    };
    if (!c.challenged) {
      const auto* h = std::get_if<hello_msg>(&f.body);
      if (h == nullptr) {
        return refuse_with("the handshake starts with hello");
      }
      c.hello_nonce = h->nonce;
      c.client = h->client;
      c.resume = h->resume_session;
      detail::random_bytes(c.challenge_nonce);
      c.challenged = true;
      out.push_back(challenge_msg{
          c.challenge_nonce, exporter_proof(options_.token, c.hello_nonce, c.challenge_nonce)});
      return true;
    }
    const auto* a = std::get_if<auth_msg>(&f.body);
    if (a == nullptr) {
      return refuse_with("the handshake continues with auth");
    }
    if (!detail::digests_equal(a->proof,
                               decode_proof(options_.token, c.hello_nonce, c.challenge_nonce))) {
      return refuse_with("no valid proof of the token in auth");
    }
    do {
      std::array<std::byte, 8> b;
      detail::random_bytes(b);
      std::memcpy(&c.session, b.data(), 8);
    } while (c.session == 0 || live_sessions_.contains(c.session));
    live_sessions_.insert(c.session);
    c.peer = c.client + " (session " + std::to_string(c.session) + ")";
    if (c.resume != 0 && c.resume != c.session) {
      // A decode node back after giving up its connection keeps its leases. Its old connection
      // may not look closed here yet: the resume says it is abandoned, so close it now.
      if (live_sessions_.contains(c.resume)) {
        for (connection& old : *conns_) {
          if (old.session == c.resume && old.fd) {
            old.fd.reset();
          }
        }
        live_sessions_.erase(c.resume);
      }
      std::lock_guard lock(mutex_);
      for (auto& [seq, r] : requests_) {
        if (r.owner == c.resume) {
          r.owner = c.session;
          ++stats_.resumed;
        }
      }
    }
    hello_ack_msg ack;
    ack.session = c.session;
    ack.lease_ms = static_cast<std::uint32_t>(options_.lease.count());
    ack.layout = layout();
    ack.num_slots = arena_.num_slots();
    ack.slot_bytes = arena_.slot_bytes();
    ack.arena = {arena_reg_.base(), arena_reg_.length(), arena_reg_.rkey()};
    ack.generations = {gen_reg_.base(), gen_reg_.length(), gen_reg_.rkey()};
    ack.worker_address = worker_address_;
    ack.mac = hello_ack_mac(options_.token, c.hello_nonce, c.challenge_nonce, ack);
    out.push_back(std::move(ack));
    return true;
  }

  void queue_reply(connection& c, const message& m, std::uint64_t id) {
    std::vector<std::byte> bytes;
    try {
      bytes = encode(m, id);
    } catch (const error& e) {
      // A reply this protocol cannot carry: say so rather than leave the peer waiting.
      bytes = encode(error_msg{static_cast<std::uint32_t>(e.code()), e.what()}, id);
    }
    if (c.out_sent == c.out.size()) {
      c.out.clear();
      c.out_sent = 0;
      c.out_since = steady::now();
    }
    c.out.insert(c.out.end(), bytes.begin(), bytes.end());
  }

  void flush_out(connection& c) {
    while (c.out_sent < c.out.size()) {
      const ssize_t n =
          ::send(c.fd.get(), c.out.data() + c.out_sent, c.out.size() - c.out_sent, MSG_NOSIGNAL);
      if (n > 0) {
        c.out_sent += static_cast<std::size_t>(n);
        c.out_since = steady::now();
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        return;  // the rest when the socket takes it
      }
      c.fd.reset();
      return;
    }
    if (c.closing) {
      c.fd.reset();
    }
  }

  // Computes the replies to `f` into `out`; false closes the connection after them.
  bool dispatch(connection& c, const received_frame& f, std::vector<message>& out) {
    if (c.session == 0) {
      return handshake(c, f, out);
    }
    if (std::holds_alternative<hello_msg>(f.body) || std::holds_alternative<auth_msg>(f.body))
        [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "kv_exporter: a second handshake from ",
                             c.peer);
    }
    if (const auto* o = std::get_if<open_msg>(&f.body)) {
      opened_msg m = open_request(c, *o);
      std::vector<std::byte> summaries = std::move(m.summaries);
      m.summaries.clear();
      out.push_back(std::move(m));
      // The summaries follow in chunks, so no frame limit bounds the prompt's length.
      for (std::size_t at = 0; at < summaries.size(); at += summary_chunk_bytes()) {
        const std::size_t n = std::min<std::size_t>(summary_chunk_bytes(), summaries.size() - at);
        summary_chunk_msg chunk;
        chunk.seq = o->seq;
        chunk.offset = at;
        chunk.bytes.assign(summaries.begin() + static_cast<std::ptrdiff_t>(at),
                           summaries.begin() + static_cast<std::ptrdiff_t>(at + n));
        out.push_back(std::move(chunk));
      }
    } else if (const auto* hb = std::get_if<heartbeat_msg>(&f.body)) {
      // Extends the leases the decode node names; releases the others of its session (opens
      // whose replies it gave up on).
      const std::set<std::uint64_t> held(hb->seqs.begin(), hb->seqs.end());
      std::lock_guard lock(mutex_);
      std::uint32_t extended = 0;
      std::vector<std::uint64_t> abandoned;
      for (auto& [seq, r] : requests_) {
        if (r.owner == c.session) {
          if (held.contains(seq)) {
            r.expiry = steady::now() + options_.lease;
            ++extended;
          } else {
            abandoned.push_back(seq);
          }
        }
      }
      for (const std::uint64_t seq : abandoned) {
        free_request(seq);
        ++stats_.abandoned;
      }
      out.push_back(heartbeat_ack_msg{static_cast<std::uint32_t>(options_.lease.count()), extended,
                                      static_cast<std::uint32_t>(abandoned.size())});
    } else if (const auto* r = std::get_if<release_msg>(&f.body)) {
      std::lock_guard lock(mutex_);
      auto it = requests_.find(r->seq);
      if (it == requests_.end() || it->second.owner != c.session) [[unlikely]] {
        oasiskv::detail::raise(errc::unknown_sequence, "kv_exporter: release of request ", r->seq,
                               " which this session does not hold");
      }
      free_request(r->seq);
      ++stats_.releases;
      out.push_back(released_msg{r->seq});
    } else {
      oasiskv::detail::raise(errc::invalid_argument, "kv_exporter: unexpected message type ",
                             static_cast<std::uint16_t>(f.header.type), " from ", c.peer);
    }
    return true;
  }

  opened_msg open_request(const connection& c, const open_msg& o) {
    const kv_layout& l = layout();
    std::lock_guard lock(mutex_);
    auto it = requests_.find(o.seq);
    if (it == requests_.end() || !it->second.published) [[unlikely]] {
      oasiskv::detail::raise(errc::unknown_sequence, "kv_exporter: request ", o.seq,
                             " is not published");
    }
    request& r = it->second;
    if (r.owner != 0 && r.owner != c.session) [[unlikely]] {
      oasiskv::detail::raise(errc::slot_in_flight, "kv_exporter: request ", o.seq,
                             " is leased by session ", r.owner);
    }
    r.owner = c.session;
    r.expiry = steady::now() + options_.lease;
    ++stats_.opens;
    opened_msg m;
    m.seq = o.seq;
    m.tokens = r.tokens;
    m.num_layers = l.num_layers;
    m.blocks_per_layer = l.blocks_for(r.tokens);
    for (slot_id s : r.slots) {
      m.blocks.push_back(
          {s, std::atomic_ref<std::uint64_t>(generations_[s]).load(std::memory_order_acquire)});
    }
    if (o.want_summaries != 0) {
      m.summary_bytes = static_cast<std::uint32_t>(summary_bytes(l));
      m.summaries = r.summaries;
    }
    return m;
  }

  void reap_leases() {
    std::lock_guard lock(mutex_);
    const auto now = steady::now();
    std::vector<std::uint64_t> expired;
    for (const auto& [seq, r] : requests_) {
      if (r.owner != 0 && r.expiry < now) {
        expired.push_back(seq);
      }
    }
    for (std::uint64_t seq : expired) {
      free_request(seq);
      ++stats_.leases_expired;
    }
  }

  exporter_options options_;
  host_tier arena_;
  free_list_allocator slots_;
  generation_table gen_table_;  // outlives gen_reg_ (declared before it)
  std::uint64_t* generations_;  // [num_slots] = gen_table_.data
  ucx_context context_;
  ucx_worker worker_;
  ucx_registration arena_reg_;
  ucx_registration gen_reg_;
  std::vector<std::byte> worker_address_;
  int event_fd_ = -1;  // the worker's; owned by UCX
  fd_handle listen_;
  std::uint16_t port_ = 0;
  mutable std::mutex mutex_;
  std::map<std::uint64_t, request> requests_;
  exporter_stats stats_{};
  std::set<std::uint64_t> live_sessions_;     // sessions with a connection (control thread only)
  std::vector<connection>* conns_ = nullptr;  // the control thread's connections
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> sleeps_{0}, wakeups_{0};  // the progress thread's
  std::thread progress_;
  std::thread control_;
};

}  // namespace oasiskv::disagg
