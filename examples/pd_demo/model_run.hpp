// SPDX-License-Identifier: Apache-2.0
// The demo on a real model (the mini-decoder's): the prefill server prefills a prompt and exports
// every layer's K,V; the decode client adopts the request into a `tiered_kv_cache` whose
// capacity tier is the exporter's memory (disagg/remote_cache.hpp), `full` (all_resident) or
// `selective` (lookahead_prefetcher, the lookahead predictor fed by each step's own queries),
// and decodes greedily with the mini-decoder's transformer. The parent compares the tokens with
// a local dense run of the mini-decoder over the same prompt.
#pragma once

#include <sys/prctl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <mini_decoder/decode/decoder.hpp>
#include <mini_decoder/decode/sampler.hpp>
#include <mini_decoder/io/error.hpp>
#include <mini_decoder/model/model.hpp>
#include <mini_decoder/model/transformer.hpp>

#include "oasiskv/disagg/kv_exporter.hpp"
#include "oasiskv/disagg/remote_cache.hpp"
#include "oasiskv/oasiskv.hpp"
#include "oasiskv/predictor/lookahead_predictor.hpp"
#include "oasiskv/summary/minmax_summary.hpp"
#include "synthetic.hpp"

namespace pd_demo::real {

using clock_type = std::chrono::steady_clock;

inline double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    mini_decoder::fail("cannot open --prompt-file '", path, "'");
  }
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

//! What every process derives the same way from the command line.
struct setup {
  std::string model_path, prompt_file;
  std::uint32_t prompt_tokens = 0;  // 0: as many as fit (at most 1024)
  std::uint32_t steps = 64;
};

//! The prompt: `prompt_file`'s text, or for a llama2.c model the reference story beside it (the
//! model's own text), else this repository's docs/disagg.md. Truncated to fit the context.
inline std::vector<int> prompt_tokens(const mini_decoder::model& m, const setup& s) {
  std::string path = s.prompt_file;
  if (path.empty()) {
    const auto slash = m.path.find_last_of('/');
    const std::string dir = slash == std::string::npos ? "." : m.path.substr(0, slash);
    path = m.config.architecture == "llama2.c" ? dir + "/reference-greedy-n256.txt"
                                               : std::string("docs/disagg.md");
  }
  std::vector<int> t = m.tok->encode(read_text(path), true);
  const std::uint32_t ctx = m.config.context_length;
  if (ctx <= s.steps + 2) {
    mini_decoder::fail("--steps = ", s.steps, " leaves no room in the context of ", ctx);
  }
  const std::uint32_t room = ctx - s.steps - 1;
  const std::uint32_t want = s.prompt_tokens != 0 ? s.prompt_tokens : std::min(room, 1024u);
  if (want > room) {
    mini_decoder::fail("--prompt-tokens = ", want, " + --steps = ", s.steps,
                       " exceed the context of ", ctx);
  }
  if (t.size() > want) {
    t.resize(want);
  }
  return t;
}

inline oasiskv::kv_layout layout_of(const mini_decoder::model& m) {
  const auto& c = m.config;
  return {c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, 16, oasiskv::dtype::f16};
}

//! The prefill server: prefills once, exports `copies` copies of the request (seq 0: full,
//! 1..: selective per budget; a lease is one decode client's), prints "port P first T tokens N"
//! and serves until the parent kills it.
inline int run_prefill(const setup& s, std::uint32_t copies) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  using namespace oasiskv::disagg;
  const auto m = mini_decoder::load_model(s.model_path);
  const auto& c = m->config;
  const std::vector<int> prompt = prompt_tokens(*m, s);
  const auto n = static_cast<std::uint32_t>(prompt.size());
  const oasiskv::kv_layout l = layout_of(*m);
  const std::size_t kvd = std::size_t{c.num_kv_heads} * c.head_dim;
  std::vector<std::vector<float>> k(c.num_layers), v(c.num_layers);
  std::vector<float> logits(c.vocab_size);
  mini_decoder::transformer tf(*m);
  const auto t0 = clock_type::now();
  tf.prefill(
      prompt.data(), n,
      [&](std::uint32_t layer, const float* kk, const float* vv, std::uint32_t count) {
        k[layer].assign(kk, kk + count * kvd);
        v[layer].assign(vv, vv + count * kvd);
      },
      logits.data());
  const double prefill_s = seconds_since(t0);
  const int first = mini_decoder::argmax(logits.data(), c.vocab_size);

  exporter_options o;
  o.token.fill(std::byte{0x5a});
  o.lease = std::chrono::milliseconds(10000);
  kv_exporter ex(l, std::uint32_t{l.num_layers} * l.blocks_for(n) * copies, o);
  const std::size_t row = l.row_bytes();
  for (std::uint64_t seq = 0; seq < copies; ++seq) {
    const auto slots = ex.allocate(seq, n);  // [layers][blocks], layer-major
    const std::uint32_t blocks = l.blocks_for(n);
    for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
      for (std::uint32_t b = 0; b < blocks; ++b) {
        std::byte* blk = ex.slot_data(slots[std::size_t{layer} * blocks + b]);
        std::memset(blk, 0, l.block_bytes());
        for (std::uint32_t t = 0; t < l.tokens_per_block && b * l.tokens_per_block + t < n; ++t) {
          const std::size_t tok = std::size_t{b} * l.tokens_per_block + t;
          for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
            auto* kd = reinterpret_cast<oasiskv::f16*>(blk + l.key_offset(h) + t * row);
            auto* vd = reinterpret_cast<oasiskv::f16*>(blk + l.value_offset(h) + t * row);
            const std::size_t at = tok * kvd + std::size_t{h} * c.head_dim;
            for (std::uint32_t x = 0; x < c.head_dim; ++x) {  // exact: already f16-rounded
              kd[x] = oasiskv::f16::from_float(k[layer][at + x]);
              vd[x] = oasiskv::f16::from_float(v[layer][at + x]);
            }
          }
        }
      }
    }
    ex.publish(seq);  // computes the block summaries shipped with the `opened` reply
  }
  std::printf("port %u first %d tokens %u prefill_s %.3f\n", ex.port(), first, n, prefill_s);
  std::fflush(stdout);
  std::this_thread::sleep_for(std::chrono::seconds(900));  // the parent kills it when done
  return 0;
}

//! Dense attention through the facade: every block, always.
struct select_all_predictor {
  using summary_type = oasiskv::no_summary;
  static constexpr oasiskv::prediction_timing timing = oasiskv::prediction_timing::lookahead;
  void select(const oasiskv::prediction_input<oasiskv::no_summary>& in,
              const oasiskv::selection_params&, oasiskv::selection& out) {
    const std::uint32_t nb = in.layout.blocks_for(in.seq_len);
    out.tables = 1;
    out.blocks.resize(nb);
    std::iota(out.blocks.begin(), out.blocks.end(), 0u);
    out.offsets = {0, nb};
  }
};

template <class Predictor, class Scheduler>
struct remote_bundle {
  using allocator = oasiskv::free_list_allocator;
  using fast_tier = oasiskv::host_tier;
  using slow_tier = oasiskv::disagg::remote_capacity_tier<>;
  using transfer = oasiskv::disagg::remote_transfer;
  using predictor = Predictor;
  using scheduler = Scheduler;
  using kernel = oasiskv::cpu::sparse_decode;
};
using full_bundle = remote_bundle<select_all_predictor, oasiskv::all_resident>;
using selective_bundle = remote_bundle<oasiskv::lookahead_predictor<oasiskv::minmax_summary<>>,
                                       oasiskv::lookahead_prefetcher<>>;

struct decode_args {
  std::uint16_t port = 0;
  std::uint64_t seq = 0;
  std::uint32_t budget = 0;  // 0: full admission
  int first = 0;             // the prefill's first token
  std::uint32_t prompt = 0;  // the prompt's tokens (sizes the cache)
};

template <class Bundle>
int decode_with(const mini_decoder::model& m, const setup& s, const decode_args& a) {
  using namespace oasiskv::disagg;
  const auto& c = m.config;
  const oasiskv::kv_layout l = layout_of(m);
  mini_decoder::transformer tf(m);
  std::vector<float> logits(c.vocab_size);
  {  // touch every weight page once, so the high-water mark below measures the KV only
    const mini_decoder::attention_fn none = [&](std::uint32_t, std::uint32_t n, const float*,
                                                const float*, const float*, float* out) {
      std::fill(out, out + std::size_t{n} * c.num_heads * c.head_dim, 0.0f);
    };
    tf.step(&a.first, 1, 0, c.num_layers, none, logits.data());
  }
  ucx_engine engine({std::chrono::milliseconds(5000), 128});
  remote_tier_options to;
  to.port = a.port;
  to.token.fill(std::byte{0x5a});  // the demo's shared token (a real deployment provisions one)
  to.client = "pd_demo-decode";
  auto remote = std::make_unique<ucx_remote_tier>(engine, to);
  const long baseline_kib = rss_kib("VmRSS:");

  const std::uint32_t ctx = a.prompt + s.steps + 1;
  const std::uint32_t ctx_blocks = l.blocks_for(ctx);
  const std::uint32_t tail = l.num_layers * (l.blocks_for(16 + s.steps) + 1);
  oasiskv::cache_options o;
  o.max_tokens_per_sequence = ctx;
  std::uint32_t fast = l.num_layers * (ctx_blocks + 1);
  if (a.budget == 0) {
    o.budget_tokens = ctx_blocks * l.tokens_per_block;
  } else {
    o.budget_tokens = a.budget;
    // Double-buffered per layer (the selection attended and the one prefetched), as the
    // mini-decoder sizes its staging pool.
    fast = std::min(fast, l.num_layers * (2 * std::min(l.blocks_for(a.budget), ctx_blocks) + 4));
  }
  oasiskv::tiered_kv_cache<Bundle> cache(
      remote_capacity_tier<>(std::move(remote), std::make_unique<oasiskv::host_tier>(l, tail)),
      oasiskv::host_tier(l, fast), o, {}, oasiskv::cpu::sparse_decode(1));

  auto t0 = clock_type::now();
  adopted_request<oasiskv::tiered_kv_cache<Bundle>> req(cache, a.seq);
  const double admit_ms = seconds_since(t0) * 1000;
  const oasiskv::sequence_id seq = req.sequence();
  const std::uint32_t P = req.prompt_tokens();
  const std::uint64_t summary_bytes =
      oasiskv::tiered_kv_cache<Bundle>::loads_summaries
          ? std::uint64_t{l.num_layers} * l.blocks_for(P) * oasiskv::disagg::summary_bytes(l)
          : 0;

  // Greedy decode, as the mini-decoder's loop without drafts: each layer appends the token's
  // K,V, attends, and hands its query to `lookahead` (the next step's prediction).
  const std::size_t kvd = std::size_t{c.num_kv_heads} * c.head_dim;
  std::vector<std::uint16_t> k16(kvd), v16(kvd);
  std::vector<float> lse(c.num_heads);
  const mini_decoder::attention_fn attend = [&](std::uint32_t layer, std::uint32_t, const float* q,
                                                const float* k, const float* v, float* out) {
    for (std::size_t i = 0; i < kvd; ++i) {
      k16[i] = oasiskv::f16::from_float(k[i]).bits;
      v16[i] = oasiskv::f16::from_float(v[i]).bits;
    }
    cache.append(seq, layer, k16.data(), v16.data(), 1);
    cache.attend(std::span<const oasiskv::sequence_id>(&seq, 1), layer, q, 1, out, lse.data());
    cache.lookahead(seq, layer, oasiskv::query_view{q, nullptr, 1});
  };
  std::vector<int> out;
  int x = a.first;
  if (!m.tok->is_end(x)) {
    out.push_back(x);
  }
  std::uint32_t p = P;
  t0 = clock_type::now();
  while (!out.empty() && out.size() < s.steps && p + 1 < ctx) {
    tf.step(&x, 1, p, c.num_layers, attend, logits.data());
    ++p;
    x = mini_decoder::argmax(logits.data(), c.vocab_size);
    if (m.tok->is_end(x)) {
      break;
    }
    out.push_back(x);
  }
  const double decode_s = seconds_since(t0);
  const auto st = cache.stats();
  const std::uint64_t remote_bytes = engine.stats().bytes + summary_bytes;
  // The staging pool and the local tail, plus the facade's summary store (entries for the
  // adopted and appended blocks only: `minmax_summary` grows with them).
  const std::uint64_t host_kv =
      (std::uint64_t{fast} + tail) * l.block_bytes() + cache.summary_bytes();
  std::string toks;
  for (int t : out) {
    toks += (toks.empty() ? "" : ",") + std::to_string(t);
  }
  std::printf(
      "result mode=%s ctx=%u budget=%u admitted=%llu fetched=%llu host_kv=%llu "
      "hwm_delta_kib=%ld admit_ms=%.1f decode_ms=%.1f tok_s=%.2f hit_rate=%.3f tokens=%s\n",
      a.budget == 0 ? "full" : "selective", P, a.budget,
      static_cast<unsigned long long>(req.admitted_bytes()),
      static_cast<unsigned long long>(remote_bytes - std::min(remote_bytes, req.admitted_bytes())),
      static_cast<unsigned long long>(host_kv), rss_kib("VmHWM:") - baseline_kib, admit_ms,
      decode_s * 1000, out.size() > 1 ? (out.size() - 1) / decode_s : 0.0, st.hit_rate(),
      toks.c_str());
  std::fflush(stdout);
  return 0;
}

inline int run_decode(const setup& s, const decode_args& a) {
  const auto m = mini_decoder::load_model(s.model_path);
  return a.budget == 0 ? decode_with<full_bundle>(*m, s, a)
                       : decode_with<selective_bundle>(*m, s, a);
}

}  // namespace pd_demo::real
