// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `ucx_remote_tier`: the decode side's view of one exporter's KV arena. Its slots are
//! the exporter's slots; `ucx_engine` reads them with UCX gets.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "oasiskv/concepts/tier_backend.hpp"
#include "oasiskv/disagg/protocol.hpp"
#include "oasiskv/disagg/socket.hpp"
#include "oasiskv/disagg/ucx_engine.hpp"

namespace oasiskv::disagg {

struct remote_tier_options {
  std::string address = "127.0.0.1";
  std::uint16_t port = 0;
  std::array<std::byte, token_bytes> token{};
  std::string client = "decode";
  std::chrono::milliseconds io_timeout{2000};
  bool heartbeat = true;  //!< a thread extends this session's leases every lease / 3
};

//! @brief The decode side of the handshake on a connected control socket (see protocol.hpp):
//! proves `token` without sending it, checks the exporter's proof and the `hello_ack`'s MAC, and
//! returns the validated session. A peer that cannot prove the token gets nothing but a nonce;
//! an exporter that cannot gets `errc::invalid_argument` here, before anything it sent is used.
inline hello_ack_msg client_handshake(int fd, const std::array<std::byte, token_bytes>& token,
                                      const std::string& client, std::uint64_t resume_session,
                                      steady::time_point deadline, const std::string& peer) {
  hello_msg h;
  detail::random_bytes(h.nonce);
  h.client = client;
  h.resume_session = resume_session;
  auto expect = [&](std::uint64_t id, msg_type type) {
    received_frame f = recv_frame(fd, deadline, peer);
    if (const auto* e = std::get_if<error_msg>(&f.body)) {
      throw error(errc::io_error, "exporter " + peer + " refused the handshake: " + e->text);
    }
    if (f.header.type != type || f.header.request_id != id) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "exporter ", peer,
                             " broke the handshake with message type ",
                             static_cast<int>(f.header.type), " for request ", f.header.request_id);
    }
    return std::move(f.body);
  };
  send_all(fd, encode(h, 1), deadline, peer);
  const auto ch = std::get<challenge_msg>(expect(1, msg_type::challenge));
  if (!detail::digests_equal(ch.proof, exporter_proof(token, h.nonce, ch.nonce))) [[unlikely]] {
    oasiskv::detail::raise(errc::invalid_argument, "the peer at ", peer,
                           " could not prove the exporter's token: not the exporter");
  }
  send_all(fd, encode(auth_msg{decode_proof(token, h.nonce, ch.nonce)}, 2), deadline, peer);
  auto ack = std::get<hello_ack_msg>(expect(2, msg_type::hello_ack));
  if (!detail::digests_equal(ack.mac, hello_ack_mac(token, h.nonce, ch.nonce, ack))) [[unlikely]] {
    oasiskv::detail::raise(errc::invalid_argument, "exporter ", peer,
                           ": the hello_ack's MAC does not match (altered on the way?)");
  }
  return ack;
}

//! @brief Models `batched_block_io_tier` (reads only: decode-side appends go to a local tier)
//! and `remote_block_source`. A slot may be read only while a request opened through this tier
//! holds it: its expected generation is then known and re-checked after every read.
class ucx_remote_tier {
 public:
  static constexpr memory_kind memory = memory_kind::remote;
  //! The exporter's memory is read-only here: a `composite_tier` over this tier keeps a cache
  //! from allocating or writing its slots (they are only adopted).
  static constexpr bool read_only = true;

  //! The control channel: each call waits `io_timeout` for its reply; replies to calls that
  //! timed out are recognised by their request id and dropped. A channel in doubt (a reply cut
  //! short, a frame out of order) is closed and reopened at the next call, resuming the session
  //! so its leases are kept; an open whose reply never came is released by the next heartbeat,
  //! which names only the requests this tier holds.
  ucx_remote_tier(ucx_engine& engine, remote_tier_options options)
      : engine_(&engine), options_(std::move(options)) {
    name_ = options_.address + ":" + std::to_string(options_.port);
    if (options_.io_timeout.count() <= 0) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument,
                             "remote_tier_options.io_timeout (ms) = ", options_.io_timeout.count(),
                             " must be positive");
    }
    fd_ = connect_tcp(options_.address, options_.port, options_.io_timeout);
    session_ = client_handshake(fd_.get(), options_.token, options_.client, 0,
                                steady::now() + options_.io_timeout, name_);
    next_request_ = 2;
    expected_.assign(session_.num_slots, 0);
    peer_ = engine.connect(name_, session_.worker_address, session_.arena.rkey,
                           session_.generations.rkey);
    if (options_.heartbeat) {
      heartbeat_thread_ = std::thread([this] { heartbeat_loop(); });
    }
  }
  ucx_remote_tier(const ucx_remote_tier&) = delete;
  ucx_remote_tier& operator=(const ucx_remote_tier&) = delete;
  ~ucx_remote_tier() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    stop_cv_.notify_all();
    if (heartbeat_thread_.joinable()) {
      heartbeat_thread_.join();
    }
    engine_->disconnect(peer_);  // its endpoint and rkeys go once no batch reads from it
  }

  const kv_layout& layout() const noexcept { return session_.layout; }
  std::uint32_t num_slots() const noexcept { return session_.num_slots; }
  std::size_t slot_bytes() const noexcept { return static_cast<std::size_t>(session_.slot_bytes); }
  const std::string& name() const noexcept { return name_; }
  const hello_ack_msg& session() const noexcept { return session_; }
  ucx_engine& engine() const noexcept { return *engine_; }

  //! @brief Leases request `seq` and returns its validated block table (and summaries).
  opened_msg open(std::uint64_t seq, bool summaries = true) {
    std::lock_guard lock(call_mutex_);
    const auto deadline = steady::now() + options_.io_timeout;
    opened_msg o = std::get<opened_msg>(
        call(open_msg{seq, static_cast<std::uint8_t>(summaries ? 1 : 0)}, msg_type::opened));
    validate_opened(o, session_, seq, summaries);
    // The summaries follow in chunks with the same request id, in order.
    const std::uint64_t total = std::uint64_t{o.summary_bytes} * o.blocks.size();
    o.summaries.reserve(total);
    while (o.summaries.size() < total) {
      received_frame f = receive(deadline);
      const auto* c = std::get_if<summary_chunk_msg>(&f.body);
      if (c == nullptr || f.header.request_id != next_request_ || c->seq != seq ||
          c->offset != o.summaries.size() || c->bytes.empty() ||
          c->bytes.size() > total - o.summaries.size()) [[unlikely]] {
        broken_ = true;
        oasiskv::detail::raise(errc::invalid_argument, "exporter ", name_,
                               " sent a bad summary chunk for request ", seq, " at byte ",
                               o.summaries.size(), " of ", total);
      }
      o.summaries.insert(o.summaries.end(), c->bytes.begin(), c->bytes.end());
    }
    std::lock_guard g(mutex_);
    for (const block_entry& b : o.blocks) {
      expected_[b.slot] = b.generation;
    }
    opened_[seq] = o.blocks;
    return o;
  }

  //! @brief Ends the lease of `seq`: the exporter frees its blocks.
  void release(std::uint64_t seq) {
    std::lock_guard lock(call_mutex_);
    {
      std::lock_guard g(mutex_);
      auto it = opened_.find(seq);
      if (it == opened_.end()) [[unlikely]] {
        oasiskv::detail::raise(errc::unknown_sequence, "ucx_remote_tier ", name_,
                               ": release of request ", seq, " which was not opened here");
      }
      for (const block_entry& b : it->second) {
        expected_[b.slot] = 0;
      }
      opened_.erase(it);
    }
    call(release_msg{seq}, msg_type::released);
  }

  //! @brief Extends every lease of this session; returns how many the exporter holds.
  //! @brief Extends the leases of the requests this tier holds (the exporter releases any other
  //! of the session); returns how many it extended.
  std::uint32_t heartbeat() {
    std::lock_guard lock(call_mutex_);
    heartbeat_msg h;
    {
      std::lock_guard g(mutex_);
      for (const auto& [seq, blocks] : opened_) {
        h.seqs.push_back(seq);
      }
    }
    return std::get<heartbeat_ack_msg>(call(h, msg_type::heartbeat_ack)).leases;
  }
  //! @brief After the engine force-closed this exporter's endpoint (a missed deadline, a UCX
  //! error, `ucx_engine::close_peer`), opens a new endpoint to the same exporter, and the
  //! control channel if it is in doubt, so batches can go on. The requests opened here keep
  //! their leases and expected generations: a block the exporter freed meanwhile still fails on
  //! its generation. A no-op while the endpoint is healthy. Throws what `connect` throws where
  //! the exporter cannot be reached; call it only while no batch of this tier is in flight.
  void reconnect() {
    std::lock_guard lock(call_mutex_);
    if (broken_) {
      reopen_channel();
    }
    if (engine_->peer_failure(peer_).empty()) {
      return;
    }
    ucx_peer* fresh = engine_->connect(name_, session_.worker_address, session_.arena.rkey,
                                       session_.generations.rkey);
    engine_->disconnect(std::exchange(peer_, fresh));
    ++reconnects_;
  }
  //! @brief Times the control channel or the endpoint was reopened.
  std::uint64_t reconnects() const noexcept { return reconnects_; }

  // -- remote_block_source ----------------------------------------------------------------------
  ucx_peer* peer() const noexcept { return peer_; }
  std::uint64_t remote_address(slot_id s) const {
    check_slot(s);
    return session_.arena.base + std::uint64_t{s} * session_.slot_bytes;
  }
  std::uint64_t generation_address(slot_id s) const {
    check_slot(s);
    return session_.generations.base + std::uint64_t{s} * 8;
  }
  std::uint64_t expected_generation(slot_id s) const {
    check_slot(s);
    std::lock_guard g(mutex_);
    return expected_[s];
  }

  // -- batched_block_io_tier ----------------------------------------------------------------------
  void read_block(slot_id s, std::byte* out) const {
    const block_read r{s, out};
    read_blocks(std::span(&r, 1));
  }
  void read_blocks(std::span<const block_read> reads) const {
    engine_->wait(engine_->submit_reads(*this, reads));
  }
  [[noreturn]] void write_block(slot_id, const std::byte*) { refuse_write(); }
  [[noreturn]] void write_blocks(std::span<const block_write>) { refuse_write(); }

 private:
  [[noreturn]] void refuse_write() const {
    oasiskv::detail::raise(errc::unsupported, "ucx_remote_tier ", name_,
                           ": the prefill node's KV is read-only here; decode-side appends go "
                           "to a local tier (docs/disagg.md)");
  }
  void check_slot(slot_id s) const {
    if (s >= session_.num_slots) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_slot, "ucx_remote_tier ", name_, ": slot ", s,
                             " is outside the exporter's ", session_.num_slots, " slots");
    }
  }

  // One frame of the channel; a failure leaves the channel in doubt.
  received_frame receive(steady::time_point deadline) {
    try {
      return recv_frame(fd_.get(), deadline, name_);
    } catch (...) {
      broken_ = true;
      throw;
    }
  }

  // Reopens a channel in doubt: a new connection and handshake that resumes the session, so the
  // exporter moves this tier's leases to the new one. The UCX endpoint is kept.
  void reopen_channel() {
    fd_.reset();
    fd_ = connect_tcp(options_.address, options_.port, options_.io_timeout);
    hello_ack_msg ack =
        client_handshake(fd_.get(), options_.token, options_.client, session_.session,
                         steady::now() + options_.io_timeout, name_);
    if (!(ack.layout == session_.layout) || ack.num_slots != session_.num_slots ||
        ack.slot_bytes != session_.slot_bytes || ack.arena != session_.arena ||
        ack.generations != session_.generations || ack.worker_address != session_.worker_address)
        [[unlikely]] {
      oasiskv::detail::raise(errc::transfer_failed, "exporter ", name_,
                             " came back as another process (its arena changed): its requests ",
                             "are gone");
    }
    session_.session = ack.session;
    next_request_ = 2;
    broken_ = false;
    ++reconnects_;
  }

  // One request-reply exchange; an `error` reply is rethrown with the exporter's code. Frames
  // answering earlier requests (calls that timed out) are dropped.
  message call(const message& m, msg_type expected) {
    if (broken_) {
      reopen_channel();
    }
    const std::uint64_t id = ++next_request_;
    const auto deadline = steady::now() + options_.io_timeout;
    try {
      send_all(fd_.get(), encode(m, id), deadline, name_);
    } catch (...) {
      broken_ = true;
      throw;
    }
    for (;;) {
      received_frame f = receive(deadline);
      if (f.header.request_id < id) {
        continue;  // a late reply to a call that gave up (its lease, if any, goes at heartbeat)
      }
      if (f.header.request_id > id) [[unlikely]] {
        broken_ = true;
        oasiskv::detail::raise(errc::invalid_argument, "exporter ", name_, " answered request ",
                               f.header.request_id, " before request ", id, " was answered");
      }
      if (const auto* e = std::get_if<error_msg>(&f.body)) {
        const bool known = e->code >= 1 && e->code <= static_cast<std::uint32_t>(errc::io_error);
        throw error(known ? static_cast<errc>(e->code) : errc::transfer_failed,
                    "exporter " + name_ + " refused: " + e->text);
      }
      if (f.header.type != expected) [[unlikely]] {
        broken_ = true;
        oasiskv::detail::raise(errc::invalid_argument, "exporter ", name_, " answered request ", id,
                               " with message type ", static_cast<int>(f.header.type));
      }
      return std::move(f.body);
    }
  }

  void heartbeat_loop() {
    const auto period =
        std::chrono::milliseconds(std::max<std::uint32_t>(session_.lease_ms / 3, 1));
    std::unique_lock lock(mutex_);
    while (!stop_cv_.wait_for(lock, period, [&] { return stopping_; })) {
      lock.unlock();
      try {
        heartbeat();
      } catch (const error&) {
        // A lost control channel shows up as failed batches (deadline) or a refused open.
      }
      lock.lock();
    }
  }

  ucx_engine* engine_;
  remote_tier_options options_;
  std::string name_;
  fd_handle fd_;
  hello_ack_msg session_;
  ucx_peer* peer_ = nullptr;
  std::uint64_t next_request_ = 0;
  bool broken_ = false;  // the channel is in doubt: reopen it at the next call
  std::uint64_t reconnects_ = 0;
  std::mutex call_mutex_;  // one exchange at a time on the control socket
  mutable std::mutex mutex_;
  std::vector<std::uint64_t> expected_;  // [num_slots]; 0: not readable
  std::map<std::uint64_t, std::vector<block_entry>> opened_;
  std::condition_variable stop_cv_;
  bool stopping_ = false;
  std::thread heartbeat_thread_;
};

}  // namespace oasiskv::disagg
