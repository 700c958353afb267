// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `kv_exporter`: the prefill side. Holds finished requests' KV in a registered host
//! arena and serves the decode nodes that read it: a token-checked control channel on TCP hands
//! out layouts, block tables, generations and summaries; UCX gets read the blocks.
#pragma once

#include <poll.h>
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
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
  std::string address = "127.0.0.1";       //!< control channel; loopback unless told otherwise
  std::uint16_t port = 0;                  //!< 0: any free port (see `kv_exporter::port()`)
  token_type token{};                      //!< a decode node must present it in `hello`
  std::chrono::milliseconds lease{30000};  //!< a lease lapses unless extended by heartbeats
  std::uint32_t max_connections = 64;
  std::chrono::milliseconds io_timeout{1000};  //!< a stalled peer cannot hold the loop longer
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
  std::uint64_t opens = 0, releases = 0, leases_expired = 0, refused = 0, bad_messages = 0;
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
  kv_exporter(const kv_layout& layout, std::uint32_t num_slots, exporter_options options)
      : options_(std::move(options)),
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
  void publish(std::uint64_t seq) {
    const kv_layout& l = layout();
    std::lock_guard lock(mutex_);
    request& r = find(seq, "publish");
    const std::uint32_t blocks = l.blocks_for(r.tokens);
    r.summaries.resize(r.slots.size() * summary_bytes(l));
    for (std::size_t i = 0; i < r.slots.size(); ++i) {
      const std::uint32_t b = static_cast<std::uint32_t>(i % blocks);
      const std::uint32_t filled =
          b + 1 < blocks ? l.tokens_per_block : r.tokens - b * l.tokens_per_block;
      summarize_block(l, arena_.slot_data(r.slots[i]), filled,
                      r.summaries.data() + i * summary_bytes(l));
    }
    r.published = true;
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
    std::uint64_t owner = 0;  // session holding the lease; 0: none
    steady::time_point expiry{};
  };
  struct connection {
    fd_handle fd;
    std::uint64_t session = 0;  // 0 until a valid hello
    std::string peer;
  };

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
      if (ucp_worker_progress(worker_.get()) != 0) {
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
    std::vector<pollfd> fds;
    while (!stop_.load()) {
      fds.clear();
      fds.push_back({listen_.get(), POLLIN, 0});
      for (const connection& c : conns) {
        fds.push_back({c.fd.get(), POLLIN, 0});
      }
      ::poll(fds.data(), fds.size(), 20);
      if (fds[0].revents & POLLIN) {
        accept_one(conns);
      }
      for (std::size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) {
          if (!serve_one(conns[i - 1])) {
            conns[i - 1].fd.reset();
          }
        }
      }
      std::erase_if(conns, [](const connection& c) { return !c.fd; });
      reap_leases();
    }
  }

  void accept_one(std::vector<connection>& conns) {
    fd_handle fd(::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!fd || conns.size() >= options_.max_connections) {
      std::lock_guard lock(mutex_);
      ++stats_.refused;
      return;
    }
    conns.push_back({std::move(fd), 0, "decode peer fd " + std::to_string(fd.get())});
  }

  // Serves one message; false closes the connection (peer gone, malformed, or refused).
  bool serve_one(connection& c) {
    const auto deadline = steady::now() + options_.io_timeout;
    received_frame f;
    try {
      f = recv_frame(c.fd.get(), deadline, c.peer);
    } catch (const error& e) {
      if (e.code() != errc::io_error) {  // a malformed frame, not a closed socket: answer it
        std::lock_guard lock(mutex_);
        ++stats_.bad_messages;
        reply(c, error_msg{static_cast<std::uint32_t>(e.code()), e.what()}, 0);
      }
      return false;
    }
    try {
      return dispatch(c, f);
    } catch (const error& e) {
      reply(c, error_msg{static_cast<std::uint32_t>(e.code()), e.what()}, f.header.request_id);
      return e.code() != errc::invalid_argument;  // a protocol violation ends the session
    }
  }

  void reply(connection& c, const message& m, std::uint64_t id) {
    try {
      send_all(c.fd.get(), encode(m, id), steady::now() + options_.io_timeout, c.peer);
    } catch (const error&) {
      // The peer is gone or stalled; the poll loop closes it.
    }
  }

  bool dispatch(connection& c, const received_frame& f) {
    const std::uint64_t id = f.header.request_id;
    if (c.session == 0) {
      const auto* h = std::get_if<hello_msg>(&f.body);
      if (h == nullptr || !token_matches(h->token)) {
        std::lock_guard lock(mutex_);
        ++stats_.refused;
        reply(c,
              error_msg{static_cast<std::uint32_t>(errc::invalid_argument),
                        "oasiskv: kv_exporter: refused: no valid token in hello"},
              id);
        return false;
      }
      c.session = next_session_.fetch_add(1);
      c.peer = h->client + " (session " + std::to_string(c.session) + ")";
      hello_ack_msg a;
      a.session = c.session;
      a.lease_ms = static_cast<std::uint32_t>(options_.lease.count());
      a.layout = layout();
      a.num_slots = arena_.num_slots();
      a.slot_bytes = arena_.slot_bytes();
      a.arena = {arena_reg_.base(), arena_reg_.length(), arena_reg_.rkey()};
      a.generations = {gen_reg_.base(), gen_reg_.length(), gen_reg_.rkey()};
      a.worker_address = worker_address_;
      reply(c, a, id);
      return true;
    }
    if (const auto* o = std::get_if<open_msg>(&f.body)) {
      reply(c, open_request(c, *o), id);
    } else if (std::holds_alternative<heartbeat_msg>(f.body)) {
      std::lock_guard lock(mutex_);
      std::uint32_t n = 0;
      for (auto& [seq, r] : requests_) {
        if (r.owner == c.session) {
          r.expiry = steady::now() + options_.lease;
          ++n;
        }
      }
      reply(c, heartbeat_ack_msg{static_cast<std::uint32_t>(options_.lease.count()), n}, id);
    } else if (const auto* r = std::get_if<release_msg>(&f.body)) {
      std::lock_guard lock(mutex_);
      auto it = requests_.find(r->seq);
      if (it == requests_.end() || it->second.owner != c.session) [[unlikely]] {
        oasiskv::detail::raise(errc::unknown_sequence, "kv_exporter: release of request ", r->seq,
                               " which this session does not hold");
      }
      free_request(r->seq);
      ++stats_.releases;
      reply(c, released_msg{r->seq}, id);
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

  bool token_matches(const token_type& t) const noexcept {
    unsigned char diff = 0;  // constant time: no early exit an attacker could time
    for (std::size_t i = 0; i < t.size(); ++i) {
      diff |= static_cast<unsigned char>(t[i] ^ options_.token[i]);
    }
    return diff == 0;
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
  std::atomic<std::uint64_t> next_session_{1};
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> sleeps_{0}, wakeups_{0};  // the progress thread's
  std::thread progress_;
  std::thread control_;
};

}  // namespace oasiskv::disagg
