// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `ucx_engine`: reads blocks of a remote (exporter) tier into a local host tier with UCX
//! gets, many in flight, progressed by its own thread; every batch has a deadline.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "oasiskv/concepts/tier_backend.hpp"
#include "oasiskv/concepts/transfer_engine.hpp"
#include "oasiskv/disagg/ucx_common.hpp"
#include "oasiskv/disagg/ucx_peer.hpp"
#include "oasiskv/transfer/detail/sorted_set.hpp"

namespace oasiskv::disagg {

struct ucx_engine_options {
  //! A batch that waits this long on a silent exporter (gets of it in flight, and none of that
  //! exporter's gets completing; time waiting for room in the window, or behind other batches'
  //! gets, does not count, and a large batch that keeps moving never misses it) fails, and its
  //! exporter's
  //! endpoint is force-closed: UCX does not detect a stopped (SIGSTOP) or blackholed peer by
  //! itself (docs/disagg.md).
  std::chrono::milliseconds deadline{1000};
  std::uint32_t max_in_flight = 128;  //!< gets outstanding at once, across exporters
  //! How long the progress thread keeps polling after its last batch finished before it naps
  //! (1 ms at a time, woken by the next submit). A decode loop submits every layer, so while
  //! it runs the thread never naps and a submit costs no wake-up: waking a napping thread is a
  //! futex call and, on a VM, an inter-processor interrupt (about 8% of a decode thread's time
  //! on a 2-vCPU VM, docs/disagg.md). 0 naps as soon as nothing is in flight.
  std::chrono::microseconds busy_poll{2000};
};

//! @brief Models `transfer_engine<ucx_engine, ucx_remote_tier, host_tier>`. Thread-safe.
//!
//! Two locks. The UCX worker, its endpoints and the batches being posted belong to the progress
//! thread, under `ucx_mutex_`. What callers touch (batches submitted but not yet taken up,
//! unfinished ids, failures, statistics, each exporter's state) is under `mutex_`, which nobody
//! holds across a UCX call: a `submit`, `test` or `wait` never waits for the progress thread to
//! finish a round of `ucp_worker_progress` (which copies the blocks on shared-memory transports).
//! Lock order: `ucx_mutex_`, then `mutex_`.
class ucx_engine {
 public:
  struct ticket {
    std::uint64_t id = 0;
    friend constexpr bool operator==(const ticket&, const ticket&) = default;
  };
  struct statistics {
    std::uint64_t batches = 0, gets = 0, bytes = 0, failed_batches = 0;
    std::uint64_t generation_mismatches = 0, forced_closes = 0;
    std::uint64_t disconnects = 0;  //!< endpoints closed because their tier was destroyed
    std::uint64_t peers = 0;        //!< endpoints the engine holds now
    std::uint64_t idle_naps = 0;    //!< naps of the progress thread with nothing to do
  };

  explicit ucx_engine(ucx_engine_options options = {})
      : options_(options), worker_(context_), thread_([this] { run(); }) {}
  ucx_engine(const ucx_engine&) = delete;
  ucx_engine& operator=(const ucx_engine&) = delete;
  ~ucx_engine() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    work_cv_.notify_all();
    thread_.join();
    std::lock_guard ucx(ucx_mutex_);
    for (auto& p : peers_) {  // quiesce: force-close whatever is left, bounded
      if (p->st == ucx_peer::state::ready) {
        start_close(*p, "engine destroyed");
      }
    }
    const auto until = steady_clock::now() + std::chrono::seconds(5);
    while (std::any_of(peers_.begin(), peers_.end(),
                       [](const auto& p) { return p->st == ucx_peer::state::closing; }) &&
           steady_clock::now() < until) {
      ucp_worker_progress(worker_.get());
      poll_closes();
    }
  }

  const ucx_engine_options& options() const noexcept { return options_; }

  //! @brief Creates the endpoint to an exporter's worker and unpacks its rkeys.
  ucx_peer* connect(std::string name, std::span<const std::byte> worker_address,
                    std::span<const std::byte> arena_rkey, std::span<const std::byte> gen_rkey) {
    auto p = std::make_unique<ucx_peer>();
    p->name = std::move(name);
    std::lock_guard ucx(ucx_mutex_);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(worker_address.data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t s) {
      auto* peer = static_cast<ucx_peer*>(arg);
      peer->pending_error = std::string("UCX reported a failure: ") + ucs_status_string(s);
    };
    ep.err_handler.arg = p.get();
    detail::ucx_check(ucp_ep_create(worker_.get(), &ep, &p->ep), "ucp_ep_create");
    if (ucs_status_t s = ucp_ep_rkey_unpack(p->ep, arena_rkey.data(), &p->arena_rkey);
        s != UCS_OK) {
      start_close(*p, "bad rkey");
      peers_.push_back(std::move(p));
      detail::ucx_check(s, "ucp_ep_rkey_unpack (arena)");
    }
    if (ucs_status_t s = ucp_ep_rkey_unpack(p->ep, gen_rkey.data(), &p->gen_rkey); s != UCS_OK) {
      start_close(*p, "bad rkey");
      peers_.push_back(std::move(p));
      detail::ucx_check(s, "ucp_ep_rkey_unpack (generations)");
    }
    // Finish the wireup now (a flush needs it): an endpoint whose wireup is still pending when
    // its peer dies trips an assertion in UCX 1.13's tcp pending purge.
    ucp_request_param_t fp{};
    void* f = ucp_ep_flush_nbx(p->ep, &fp);
    const auto until = steady_clock::now() + std::chrono::seconds(2);
    while (f != nullptr && !UCS_PTR_IS_ERR(f) && ucp_request_check_status(f) == UCS_INPROGRESS &&
           steady_clock::now() < until) {
      ucp_worker_progress(worker_.get());
    }
    const bool ok = f == nullptr || (!UCS_PTR_IS_ERR(f) && ucp_request_check_status(f) == UCS_OK);
    if (f != nullptr && !UCS_PTR_IS_ERR(f)) {
      if (ucp_request_check_status(f) == UCS_INPROGRESS) {
        start_close(*p, "wireup timed out");  // completes the flush request (canceled)
        while (ucp_request_check_status(f) == UCS_INPROGRESS) {
          ucp_worker_progress(worker_.get());
        }
      }
      ucp_request_free(f);
    }
    ucx_peer* raw = p.get();
    peers_.push_back(std::move(p));
    {
      std::lock_guard lock(mutex_);
      stats_.peers = peers_.size();
    }
    if (!ok) [[unlikely]] {
      start_close(*raw, "wireup failed");
      oasiskv::detail::raise(errc::transfer_failed, "ucx_engine: cannot reach exporter ", raw->name,
                             " (UCX wireup did not complete within 2 s)");
    }
    return raw;
  }

  //! @brief Why `p` is no longer usable, or empty while it is.
  //! @brief The tier that connected `p` is gone: once no submitted batch reads from it, its
  //! endpoint is closed, its rkeys destroyed and the engine forgets it. `p` must not be used
  //! after this call.
  void disconnect(ucx_peer* p) {
    if (p == nullptr) {
      return;
    }
    p->released.store(true, std::memory_order_release);
    work_cv_.notify_one();
  }

  //! @brief Force-closes `p`'s endpoint as a missed deadline does: its batches in flight fail
  //! with `errc::transfer_failed` naming `why`, later submits to it are refused. An engine
  //! drops an exporter it no longer trusts this way; `ucx_remote_tier::reconnect` opens a new
  //! endpoint to it.
  void close_peer(ucx_peer* p, std::string why) {
    {
      std::lock_guard lock(mutex_);
      if (p->st != ucx_peer::state::ready) {
        return;
      }
      p->pending_close = std::move(why);
    }
    p->close_requested.store(true, std::memory_order_release);
    work_cv_.notify_one();
  }

  std::string peer_failure(const ucx_peer* p) const {
    std::lock_guard lock(mutex_);
    return p->st == ucx_peer::state::ready ? std::string{} : p->failure;
  }

  //! @brief Reads slots of `src` into slots of `dst`; validated whole before anything moves.
  template <remote_block_source Src, host_accessible_tier Dst>
  ticket submit(const Src& src, Dst& dst, std::span<const block_copy> copies,
                std::chrono::milliseconds deadline = {}) {
    if (!(src.layout() == dst.layout())) [[unlikely]] {
      oasiskv::detail::raise(errc::layout_mismatch, "ucx_engine::submit: layouts differ");
    }
    thread_local std::vector<slot_id> dsts, sorted;  // per-thread scratch: no allocation
    dsts.clear();
    for (std::size_t i = 0; i < copies.size(); ++i) {
      if (copies[i].dst >= dst.num_slots()) [[unlikely]] {
        oasiskv::detail::raise(errc::invalid_slot, "ucx_engine::submit: copy ", i, " writes slot ",
                               copies[i].dst, ", outside the destination's ", dst.num_slots(),
                               " slots");
      }
      dsts.push_back(copies[i].dst);
    }
    if (const std::size_t i = oasiskv::detail::first_repeat<slot_id>(dsts, sorted);
        i != dsts.size()) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_slot, "ucx_engine::submit: copy ", i, " writes slot ",
                             copies[i].dst, " twice");
    }
    auto b = make_batch(src, deadline, copies.size());
    for (std::size_t i = 0; i < copies.size(); ++i) {
      const block_copy c = copies[i];
      add_op(*b, src, c.src, dst.slot_data(c.dst), i);
      b->dst_slots.push_back({&dst, c.dst});
    }
    return enqueue(std::move(b));
  }

  //! @brief Reads slots of `src` into caller buffers of `block_bytes()` each (block I/O).
  template <remote_block_source Src>
  ticket submit_reads(const Src& src, std::span<const block_read> reads,
                      std::chrono::milliseconds deadline = {}) {
    auto b = make_batch(src, deadline, reads.size());
    for (std::size_t i = 0; i < reads.size(); ++i) {
      if (reads[i].out == nullptr) [[unlikely]] {
        oasiskv::detail::raise(errc::invalid_argument, "ucx_engine: read ", i, " has no buffer");
      }
      add_op(*b, src, reads[i].slot, reads[i].out, i);
    }
    return enqueue(std::move(b));
  }

  bool test(const ticket& t) const {
    std::lock_guard lock(mutex_);
    check_issued(t);
    return !unfinished_.contains(t.id);
  }

  //! @brief Blocks until batch `t` has finished; rethrows its failure (`errc::transfer_failed`,
  //! naming the exporter and the cause) once.
  void wait(const ticket& t) {
    std::unique_lock lock(mutex_);
    check_issued(t);
    done_cv_.wait(lock, [&] { return !unfinished_.contains(t.id); });
    if (auto it = failures_.find(t.id); it != failures_.end()) {
      std::string m = std::move(it->second);
      failures_.erase(it);
      throw error(errc::transfer_failed, m);
    }
  }

  statistics stats() const {
    std::lock_guard lock(mutex_);
    return stats_;
  }

 private:
  using steady_clock = std::chrono::steady_clock;
  struct op {
    std::uint64_t remote;
    std::byte* local;
    std::size_t bytes;
  };
  struct dst_key {
    const void* tier;
    slot_id slot;
    auto operator<=>(const dst_key&) const = default;
  };
  struct batch {
    std::uint64_t id = 0;
    ucx_peer* peer = nullptr;
    std::vector<op> ops;
    std::vector<std::uint64_t> gen_addr, gen_expected, gen_read;
    std::vector<slot_id> gen_slots;
    std::vector<dst_key> dst_slots;
    std::size_t next = 0;         // next op (data, then generation words) to post
    std::size_t outstanding = 0;  // posted, callback not yet run
    std::uint64_t gets = 0;       // data gets posted
    bool gen_phase = false;
    bool stale = false;  // a generation word did not match
    ucs_status_t status = UCS_OK;
    std::string failure;  // set once the batch is doomed
    // No progress by then fails the batch; pushed back at every get posted or completed. Never,
    // until its first get is posted.
    steady_clock::time_point deadline = steady_clock::time_point::max();
    std::chrono::milliseconds budget{};
    bool progressed = false;  // a get completed since the last round (set by the callback)
    steady_clock::time_point failed_at{};  // when the batch was found doomed
  };

  // A fresh batch, or a finished one reused with its vectors' capacity (finish() keeps a few):
  // in steady state a submit allocates nothing.
  template <class Src>
  std::unique_ptr<batch> make_batch(const Src& src, std::chrono::milliseconds deadline,
                                    std::size_t blocks) {
    std::unique_ptr<batch> b;
    {
      std::lock_guard lock(mutex_);
      if (!spare_.empty()) {
        b = std::move(spare_.back());
        spare_.pop_back();
      }
    }
    if (!b) {
      b = std::make_unique<batch>();
    }
    b->peer = src.peer();
    b->budget = deadline.count() > 0 ? deadline : options_.deadline;
    b->ops.reserve(blocks);
    b->gen_addr.reserve(blocks);
    b->gen_expected.reserve(blocks);
    b->gen_slots.reserve(blocks);
    b->dst_slots.reserve(blocks);
    return b;
  }

  static constexpr std::size_t max_spare_batches = 64;

  // `mutex_` held. Keeps a finished batch (no callback pending) for reuse, emptied.
  void recycle(std::unique_ptr<batch> b) {
    if (spare_.size() >= max_spare_batches) {
      return;
    }
    b->id = 0;
    b->peer = nullptr;
    b->ops.clear();
    b->gen_addr.clear();
    b->gen_expected.clear();
    b->gen_read.clear();
    b->gen_slots.clear();
    b->dst_slots.clear();
    b->next = 0;
    b->outstanding = 0;
    b->gets = 0;
    b->gen_phase = false;
    b->stale = false;
    b->status = UCS_OK;
    b->failure.clear();
    b->progressed = false;
    b->failed_at = {};
    spare_.push_back(std::move(b));
  }

  template <class Src>
  void add_op(batch& b, const Src& src, slot_id s, std::byte* out, std::size_t i) {
    if (s >= src.num_slots() || src.expected_generation(s) == 0) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_slot, "ucx_engine: read ", i, " of remote slot ", s,
                             " which no opened request of exporter ", src.peer()->name, " holds");
    }
    b.ops.push_back({src.remote_address(s), out, src.layout().block_bytes()});
    b.gen_addr.push_back(src.generation_address(s));
    b.gen_expected.push_back(src.expected_generation(s));
    b.gen_slots.push_back(s);
  }

  ticket enqueue(std::unique_ptr<batch> b) {
    std::unique_lock lock(mutex_);
    if (b->peer->st != ucx_peer::state::ready) [[unlikely]] {
      oasiskv::detail::raise(errc::transfer_failed, "ucx_engine: exporter ", b->peer->name,
                             " is unusable: ", b->peer->failure);
    }
    for (const dst_key& k : b->dst_slots) {
      if (quarantined_.contains(k)) [[unlikely]] {
        oasiskv::detail::raise(errc::slot_in_flight, "ucx_engine: destination slot ", k.slot,
                               " is written by an unfinished batch");
      }
    }
    for (const dst_key& k : b->dst_slots) {
      quarantined_.insert(k);
    }
    b->id = ++issued_;
    b->deadline = steady_clock::time_point::max();  // starts at its first get posted
    b->gen_read.assign(b->gen_addr.size(), 0);
    const ticket t{b->id};
    unfinished_.insert(b->id);
    pending_.push_back(std::move(b));
    submitted_.store(true, std::memory_order_release);
    lock.unlock();
    work_cv_.notify_one();
    return t;
  }

  void check_issued(const ticket& t) const {
    if (t.id == 0 || t.id > issued_) [[unlikely]] {
      oasiskv::detail::raise(errc::unknown_ticket, "ucx_engine: ticket ", t.id,
                             " was never issued");
    }
  }

  static void on_get(void* request, ucs_status_t status, void* user) {
    auto* b = static_cast<batch*>(user);
    --b->outstanding;
    b->progressed = true;
    if (status != UCS_OK && b->status == UCS_OK) {
      b->status = status;
    }
    ucp_request_free(request);
  }

  // `ucx_mutex_` held. Posts the batch's next gets, up to the engine's window.
  void post(batch& b, std::size_t& in_flight) {
    const std::size_t total = b.gen_phase ? b.gen_addr.size() : b.ops.size();
    if (b.next < total && in_flight < options_.max_in_flight) {
      b.deadline = steady_clock::now() + b.budget;  // progress: gets go out
    }
    while (b.next < total && in_flight < options_.max_in_flight) {
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      p.cb.send = &ucx_engine::on_get;
      p.user_data = &b;
      ucs_status_ptr_t r;
      if (b.gen_phase) {
        r = ucp_get_nbx(b.peer->ep, &b.gen_read[b.next], 8, b.gen_addr[b.next], b.peer->gen_rkey,
                        &p);
      } else {
        const op& o = b.ops[b.next];
        r = ucp_get_nbx(b.peer->ep, o.local, o.bytes, o.remote, b.peer->arena_rkey, &p);
        ++b.gets;
      }
      ++b.next;
      if (UCS_PTR_IS_ERR(r)) {
        b.status = UCS_PTR_STATUS(r);
        return;
      }
      if (r != nullptr) {
        ++b.outstanding;
        ++in_flight;
      }
    }
  }

  // `ucx_mutex_` held, `mutex_` not. Force-closes the endpoint: the only way to abort gets in UCX
  // 1.13. A peer's state is written under both locks, so callers read it under either.
  void start_close(ucx_peer& p, std::string why, bool failure = true) {
    if (p.st != ucx_peer::state::ready) {
      return;
    }
    {
      std::lock_guard lock(mutex_);
      p.failure = std::move(why);
      p.st = ucx_peer::state::closing;
      ++(failure ? stats_.forced_closes : stats_.disconnects);
    }
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    prm.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* r = ucp_ep_close_nbx(p.ep, &prm);
    if (r == nullptr || UCS_PTR_IS_ERR(r)) {
      finish_close(p);
    } else {
      p.close_request = r;
    }
  }
  void finish_close(ucx_peer& p) {
    if (p.arena_rkey != nullptr) {
      ucp_rkey_destroy(p.arena_rkey);
    }
    if (p.gen_rkey != nullptr) {
      ucp_rkey_destroy(p.gen_rkey);
    }
    p.arena_rkey = p.gen_rkey = nullptr;
    p.ep = nullptr;
    std::lock_guard lock(mutex_);
    p.st = ucx_peer::state::dead;
  }
  void poll_closes() {
    for (auto& p : peers_) {
      if (p->st == ucx_peer::state::closing &&
          ucp_request_check_status(p->close_request) != UCS_INPROGRESS) {
        ucp_request_free(p->close_request);
        p->close_request = nullptr;
        finish_close(*p);
      }
    }
    close_requested();
    retire_released();
  }

  // `ucx_mutex_` held. Carries out `close_peer` requests.
  void close_requested() {
    for (auto& p : peers_) {
      if (p->close_requested.exchange(false, std::memory_order_acq_rel)) {
        std::string why;
        {
          std::lock_guard lock(mutex_);
          why = std::move(p->pending_close);
        }
        start_close(*p, "closed by the engine's owner: " + why);
      }
    }
  }

  // `ucx_mutex_` held. Closes the endpoints of destroyed tiers that no batch reads from, and
  // forgets those whose close has completed.
  void retire_released() {
    bool any = false;
    for (const auto& p : peers_) {
      any = any || p->released.load(std::memory_order_acquire);
    }
    if (!any) {
      return;
    }
    for (auto& p : peers_) {
      if (!p->released.load(std::memory_order_acquire) || p->st != ucx_peer::state::ready) {
        continue;
      }
      bool used = std::any_of(running_.begin(), running_.end(),
                              [&](const auto& r) { return r.second->peer == p.get(); });
      if (!used) {
        std::lock_guard lock(mutex_);
        used = std::any_of(pending_.begin(), pending_.end(),
                           [&](const auto& b) { return b->peer == p.get(); });
      }
      if (!used) {
        start_close(*p, "its tier was destroyed", false);
      }
    }
    std::erase_if(peers_, [](const auto& p) {
      return p->released.load(std::memory_order_acquire) && p->st == ucx_peer::state::dead;
    });
    std::lock_guard lock(mutex_);
    stats_.peers = peers_.size();
  }

  // `ucx_mutex_` held, `mutex_` not. Advances every batch; returns whether any is waiting on the
  // network.
  bool step() {
    const auto now = steady_clock::now();
    // Time this thread was not running (descheduled on a loaded machine) is time it could not
    // see completions: it does not count against any batch.
    if (last_step_ != steady_clock::time_point{} &&
        now - last_step_ > std::chrono::milliseconds(5)) {
      const auto away = now - last_step_;
      for (auto& [id, bp] : running_) {
        if (bp->deadline != steady_clock::time_point::max()) {
          bp->deadline += away;
        }
      }
    }
    last_step_ = now;
    std::size_t in_flight = 0;
    for (auto& [id, b] : running_) {
      in_flight += b->outstanding;
    }
    for (auto& p : peers_) {
      if (!p->pending_error.empty() && p->st == ucx_peer::state::ready) {
        start_close(*p, std::exchange(p->pending_error, {}));
      }
    }
    std::vector<std::uint64_t> finished;
    // Exporters that answered a get of any batch this round: alive. A batch's gets queue behind
    // the other batches' gets on the same endpoint, so its own silence alone proves nothing.
    progressed_peers_.clear();
    for (const auto& [id, bp] : running_) {
      if (bp->progressed && std::find(progressed_peers_.begin(), progressed_peers_.end(),
                                      bp->peer) == progressed_peers_.end()) {
        progressed_peers_.push_back(bp->peer);
      }
    }
    for (auto& [id, bp] : running_) {
      batch& b = *bp;
      ucx_peer& p = *b.peer;
      const bool peer_answered = std::find(progressed_peers_.begin(), progressed_peers_.end(),
                                           &p) != progressed_peers_.end();
      if (b.failure.empty() && b.deadline != steady_clock::time_point::max() &&
          (peer_answered || b.outstanding == 0)) {
        // Its exporter answers (this batch's gets or others'), or none of its gets is in flight
        // (it waits for room in the window): the clock runs only while it waits on a silent
        // exporter.
        b.deadline = now + b.budget;
      }
      b.progressed = false;
      if (b.failure.empty()) {
        if (p.st != ucx_peer::state::ready) {
          b.failure = "exporter " + p.name + " failed: " + p.failure;
        } else if (now > b.deadline) {
          b.failure = "exporter " + p.name + ": batch of " + std::to_string(b.ops.size()) +
                      " blocks made no progress within its deadline of " +
                      std::to_string(b.budget.count()) + " ms; endpoint force-closed";
          start_close(p, "deadline of " + std::to_string(b.budget.count()) + " ms exceeded");
        } else if (b.status != UCS_OK && b.outstanding == 0) {
          b.failure = "exporter " + p.name + ": get failed: " + ucs_status_string(b.status);
          start_close(p, b.failure);
        }
      }
      if (!b.failure.empty()) {
        if (b.failed_at == steady_clock::time_point{}) {
          b.failed_at = now;
        }
        // Quarantine: the destination slots stay reserved until no get can still land.
        // A dead endpoint whose requests never report back is given up on after a grace period.
        const bool stuck =
            p.st == ucx_peer::state::dead && now > b.failed_at + std::chrono::seconds(2);
        if ((b.outstanding == 0 && p.st != ucx_peer::state::closing) || stuck) {
          finished.push_back(id);
        }
        continue;
      }
      post(b, in_flight);
      const std::size_t total = b.gen_phase ? b.gen_addr.size() : b.ops.size();
      if (b.next == total && b.outstanding == 0 && b.status == UCS_OK) {
        if (!b.gen_phase) {
          // Data landed; now read each block's generation again. Issued after the data, so a
          // slot freed (generation bumped) before its bytes could change is always seen.
          b.gen_phase = true;
          b.next = 0;
          post(b, in_flight);
        } else {
          check_generations(b);
          finished.push_back(id);
        }
      }
    }
    if (!finished.empty()) {
      finish(finished);
    }
    return in_flight > 0;
  }

  void check_generations(batch& b) {
    for (std::size_t i = 0; i < b.gen_read.size(); ++i) {
      if (b.gen_read[i] != b.gen_expected[i]) {
        b.stale = true;
        b.failure = "exporter " + b.peer->name + ": remote slot " + std::to_string(b.gen_slots[i]) +
                    " has generation " + std::to_string(b.gen_read[i]) + ", expected " +
                    std::to_string(b.gen_expected[i]) +
                    ": the exporter freed the block, its bytes are stale";
        return;
      }
    }
  }

  // `ucx_mutex_` held, `mutex_` not. Retires finished batches: their slots are free again and
  // their waiters wake.
  void finish(const std::vector<std::uint64_t>& ids) {
    {
      std::lock_guard lock(mutex_);
      for (std::uint64_t id : ids) {
        auto node = running_.extract(id);
        batch& b = *node.mapped();
        const std::uint64_t bytes = b.ops.empty() ? 0 : b.ops.size() * b.ops[0].bytes;
        for (const dst_key& k : b.dst_slots) {
          quarantined_.erase(k);
        }
        ++stats_.batches;
        stats_.gets += b.gets;
        stats_.generation_mismatches += b.stale ? 1 : 0;
        if (b.failure.empty()) {
          stats_.bytes += bytes;
        } else {
          ++stats_.failed_batches;
          failures_.emplace(id, "ucx_engine: batch " + std::to_string(id) + ": " + b.failure);
        }
        unfinished_.erase(id);
        if (b.outstanding != 0) {
          zombies_.push_back(std::move(node.mapped()));  // late callbacks still point at it
        } else {
          recycle(std::move(node.mapped()));
        }
      }
    }
    done_cv_.notify_all();
  }

  // Takes up the submitted batches; returns false once the engine is stopping. Takes `mutex_`
  // only when there are some: taken at every round, it would often be held by a submit, and the
  // thread would sleep on it and cost that submit a futex wake-up.
  bool take_pending() {
    if (!submitted_.exchange(false, std::memory_order_acquire)) {
      return !stop_.load(std::memory_order_relaxed);
    }
    std::lock_guard lock(mutex_);
    for (auto& b : pending_) {
      const std::uint64_t id = b->id;
      running_.emplace(id, std::move(b));
    }
    pending_.clear();
    return !stop_;
  }

  void run() {
    std::unique_lock ucx(ucx_mutex_);
    auto last_busy = steady_clock::now();
    while (take_pending()) {
      bool busy = step();
      for (int i = 0; i < 64 && ucp_worker_progress(worker_.get()) != 0; ++i) {
        busy = true;
      }
      poll_closes();
      busy = step() || busy;
      const bool closing = std::any_of(peers_.begin(), peers_.end(), [](const auto& p) {
        return p->st == ucx_peer::state::closing;
      });
      const bool working = busy || closing || !running_.empty();
      if (working) {
        last_busy = steady_clock::now();
      }
      ucx.unlock();  // lets `connect` in
      if (working || steady_clock::now() - last_busy < options_.busy_poll) {
        std::this_thread::yield();
      } else {
        // Idle: nap, but still progress often enough for UCX keepalive and error detection.
        std::unique_lock lock(mutex_);
        ++stats_.idle_naps;
        work_cv_.wait_for(lock, std::chrono::milliseconds(1),
                          [&] { return stop_ || !pending_.empty(); });
      }
      ucx.lock();
    }
  }

  ucx_engine_options options_;
  // Under `mutex_`:
  mutable std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::vector<std::unique_ptr<batch>> pending_;            // submitted, not yet taken up
  oasiskv::detail::sorted_set<std::uint64_t> unfinished_;  // ids of pending and running batches
  std::vector<std::unique_ptr<batch>> spare_;              // finished batches kept for reuse
  std::map<std::uint64_t, std::string> failures_;
  oasiskv::detail::sorted_set<dst_key> quarantined_;
  std::uint64_t issued_ = 0;
  statistics stats_{};
  std::atomic<bool> stop_ = false;       // written under `mutex_`
  std::atomic<bool> submitted_ = false;  // pending_ may be non-empty
  // Under `ucx_mutex_` (the progress thread's):
  std::mutex ucx_mutex_;
  std::vector<std::unique_ptr<ucx_peer>> peers_;
  std::vector<const ucx_peer*> progressed_peers_;  // step()'s scratch
  steady_clock::time_point last_step_{};           // step()'s previous run
  std::map<std::uint64_t, std::unique_ptr<batch>> running_;
  std::vector<std::unique_ptr<batch>> zombies_;
  // After every object a UCX callback can touch (peers, batches): destroying the worker purges
  // the requests still queued and runs their callbacks, which must find their batches alive.
  ucx_context context_;
  ucx_worker worker_;
  std::thread thread_;  // last: starts once every member it uses exists
};

}  // namespace oasiskv::disagg
