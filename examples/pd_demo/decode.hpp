// SPDX-License-Identifier: Apache-2.0
// The decode client of the demo: admits one request (full or selective) from the exporter,
// decodes synthetic tokens through block-sparse attention, and reports one "result" line.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "oasiskv/attention/cpu_sparse_decode.hpp"
#include "oasiskv/disagg/remote_sequence.hpp"
#include "synthetic.hpp"

namespace pd_demo {

using clock_type = std::chrono::steady_clock;

inline double ms_since(clock_type::time_point t) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - t).count();
}

inline oasiskv::disagg::remote_tier_options client(std::uint16_t port) {
  oasiskv::disagg::remote_tier_options o;
  o.port = port;
  o.token.fill(std::byte{0x5a});  // the demo's shared token (a real deployment provisions one)
  o.client = "pd_demo-decode";
  return o;
}

inline int run_decode(std::uint16_t port, std::uint64_t seq, bool selective, std::uint32_t budget,
                      std::uint32_t steps) {
  using namespace oasiskv::disagg;
  ucx_engine engine({std::chrono::milliseconds(5000), 128});
  ucx_remote_tier tier(engine, client(port));
  const long baseline_kib = rss_kib("VmRSS:");
  admission_options ao;
  ao.mode = selective ? admission_mode::selective : admission_mode::full;
  ao.budget_tokens = budget;
  ao.max_new_tokens = steps + 16;
  auto t0 = clock_type::now();
  remote_sequence rs(tier, seq, ao);
  const double admit_ms = ms_since(t0);
  const auto& l = rs.layout();
  const std::size_t qn = std::size_t{l.num_q_heads} * l.head_dim;
  std::vector<float> q(qn), out(qn), lse(l.num_q_heads);
  std::vector<oasiskv::f16> k(std::size_t{l.num_kv_heads} * l.head_dim), v(k.size());
  std::vector<std::vector<std::uint32_t>> sel(l.num_layers);
  std::vector<oasiskv::block_ref> refs;
  rng r{seq + 99};
  oasiskv::cpu::sparse_decode kernel;
  double checksum = 0;
  t0 = clock_type::now();
  for (std::uint32_t step = 0; step < steps; ++step) {
    // Lookahead: every layer's selection is known before the step; their fetches overlap the
    // attention of the layers before them.
    for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
      // Consecutive steps' queries are close (as real decode queries are): a fixed direction
      // per layer plus noise, so selections overlap from step to step.
      rng base{seq * 131 + layer + 7};
      for (std::size_t i = 0; i < qn; ++i) {
        q[i] = base.uniform() + 0.1f * r.uniform();
      }
      rs.select(layer, q.data(), sel[layer]);
      rs.prefetch(layer, sel[layer]);
    }
    for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
      for (std::size_t i = 0; i < k.size(); ++i) {
        k[i] = oasiskv::f16::from_float(r.uniform());
        v[i] = oasiskv::f16::from_float(r.uniform());
      }
      rs.append(layer, k.data(), v.data());
      refs.clear();
      rs.stage(layer, sel[layer], refs);
      const std::uint32_t offsets[2] = {0, static_cast<std::uint32_t>(refs.size())};
      const std::uint32_t len = rs.length(layer);
      oasiskv::decode_params p;
      p.q = q.data();
      p.pool = rs.pool();
      p.table = {refs.data(), offsets, 1, 1};
      p.seq_lens = &len;
      p.out = out.data();
      p.lse = lse.data();
      p.num_seqs = 1;
      p.q_len = 1;
      p.scale = 1.0f / std::sqrt(static_cast<float>(l.head_dim));
      kernel.decode(p);
      checksum += out[0];
    }
  }
  const double decode_ms = ms_since(t0);
  const auto& s = rs.stats();
  std::printf(
      "result mode=%s ctx=%u budget=%u admitted=%llu fetched=%llu host_kv=%llu hwm_delta_kib=%ld "
      "admit_ms=%.1f decode_ms=%.1f tok_s=%.2f checksum=%.3f\n",
      selective ? "selective" : "full", rs.prompt_tokens(), budget,
      static_cast<unsigned long long>(s.admitted_bytes),
      static_cast<unsigned long long>(s.fetched_bytes),
      static_cast<unsigned long long>(s.host_bytes), rss_kib("VmHWM:") - baseline_kib, admit_ms,
      decode_ms, steps * 1000.0 / decode_ms, checksum);
  std::fflush(stdout);
  return 0;
}

//! Remote get bandwidth: the engine (batches of 256 blocks, 128 gets in flight, generation
//! re-check included) against a raw ucp_get_nbx loop (same window, no checks) on its own worker.
inline int run_bandwidth(std::uint16_t port, std::uint64_t seq, double seconds) {
  using namespace oasiskv::disagg;
  ucx_engine engine({std::chrono::milliseconds(5000), 128});
  ucx_remote_tier tier(engine, client(port));
  const opened_msg o = tier.open(seq, false);
  const std::size_t bb = tier.layout().block_bytes();
  oasiskv::host_tier local(tier.layout(), 256);
  std::vector<oasiskv::block_copy> copies(256);
  std::size_t next = 0, moved = 0;
  auto t0 = clock_type::now();
  while (ms_since(t0) < seconds * 1000) {
    for (std::uint32_t i = 0; i < 256; ++i, ++next) {
      copies[i] = {o.blocks[next % o.blocks.size()].slot, i};
    }
    engine.wait(engine.submit(tier, local, copies));
    moved += 256 * bb;
  }
  const double engine_gbs = moved / (ms_since(t0) * 1e6);

  // Raw: a second context and worker, the same exporter and rkey.
  ucx_context ctx;
  ucx_worker worker(ctx);
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;  // as the engine's endpoints: the same lanes
  ep.address = reinterpret_cast<const ucp_address_t*>(tier.session().worker_address.data());
  ucp_ep_h h = nullptr;
  detail::ucx_check(ucp_ep_create(worker.get(), &ep, &h), "ucp_ep_create");
  ucp_rkey_h rkey = nullptr;
  detail::ucx_check(ucp_ep_rkey_unpack(h, tier.session().arena.rkey.data(), &rkey), "unpack");
  {  // wire the endpoint up before timing, as the engine does
    ucp_request_param_t fp{};
    void* f = ucp_ep_flush_nbx(h, &fp);
    while (f != nullptr && !UCS_PTR_IS_ERR(f) && ucp_request_check_status(f) == UCS_INPROGRESS) {
      ucp_worker_progress(worker.get());
    }
    if (f != nullptr && !UCS_PTR_IS_ERR(f)) {
      ucp_request_free(f);
    }
  }
  static std::size_t in_flight;
  in_flight = 0;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK;
  p.cb.send = [](void* req, ucs_status_t, void*) {
    --in_flight;
    ucp_request_free(req);
  };
  moved = 0;
  next = 0;
  t0 = clock_type::now();
  while (ms_since(t0) < seconds * 1000) {
    while (in_flight < 128) {
      const oasiskv::slot_id s = o.blocks[next % o.blocks.size()].slot;
      void* r = ucp_get_nbx(h, local.slot_data(static_cast<oasiskv::slot_id>(next % 256)), bb,
                            tier.remote_address(s), rkey, &p);
      ++next;
      moved += bb;
      if (r != nullptr && !UCS_PTR_IS_ERR(r)) {
        ++in_flight;
      }
    }
    ucp_worker_progress(worker.get());
  }
  while (in_flight > 0) {
    ucp_worker_progress(worker.get());
  }
  const double raw_gbs = moved / (ms_since(t0) * 1e6);
  ucp_rkey_destroy(rkey);
  ucp_request_param_t cp{};
  cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  cp.flags = UCP_EP_CLOSE_FLAG_FORCE;
  void* cr = ucp_ep_close_nbx(h, &cp);
  while (cr != nullptr && !UCS_PTR_IS_ERR(cr) && ucp_request_check_status(cr) == UCS_INPROGRESS) {
    ucp_worker_progress(worker.get());
  }
  if (cr != nullptr && !UCS_PTR_IS_ERR(cr)) {
    ucp_request_free(cr);
  }
  std::printf("bandwidth block_bytes=%zu engine_gbs=%.3f raw_gbs=%.3f\n", bb, engine_gbs, raw_gbs);
  std::fflush(stdout);
  return 0;
}

}  // namespace pd_demo
