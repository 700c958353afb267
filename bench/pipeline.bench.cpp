// SPDX-License-Identifier: Apache-2.0
// The OasisKV decode loop end to end: sequences of 32k tokens whose capacity tier is a file read
// with O_DIRECT (writing behind: each token's partial block is copied, not waited for), a fast
// tier holding a budget of blocks, and per layer append -> attend -> lookahead, as an engine's
// speculative decoder drives it. One row per scheduler:
//   lookahead     the next step's blocks predicted from its (drafted) query and prefetched
//   on_demand     the same selection, fetched when attention asks for it
//   all_resident  every block staged in the fast tier (the upper bound: no transfer at all)
// plus dense attention over the whole context in the same binary (and timed again after each
// row's loop: `predict_share` is the row's predictor time over that dense step),
// and `paired` rows that interleave the three schedulers' steps in one loop: their ratios
// (`lookahead_x`, `on_demand_x`) hold still on a noisy machine where separate rows drift.
// With UCX (oasiskv::ucx), the same three rows again with the capacity tier in another process:
// a prefill node's `kv_exporter` (forked at start-up) whose 32k-token request is adopted into the
// cache and read with UCX gets (`ucx_lookahead`, `ucx_on_demand`, `ucx_all_resident`: the last
// is full admission, every block copied before the first step; `ucx_paired`; and
// `ucx_lookahead_qminmax`, the lookahead row with the int8 min/max summary). UCX_TLS picks the
// transport (default here: sm; the other loopback settings of docs/disagg.md are defaulted too).
// Queries drift from step to step and keys cluster by block, so selections change gradually,
// as real attention does; `fetched_per_step` reports how much each step had to move, and
// `context_k` the sequence's mean length (the UCX and paired rows keep their caches from call to
// call, so their sequences grow with every repetition, and the predictor's time with them).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "oasiskv/oasiskv.hpp"

#if OASISKV_BENCH_UCX
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "oasiskv/disagg/kv_exporter.hpp"
#include "oasiskv/disagg/remote_cache.hpp"
#endif

namespace {

using namespace oasiskv;

constexpr std::uint32_t context = 32768;
constexpr std::uint32_t budget_tokens = 2048;
// Decoded tokens a sequence has room for beyond the prompt (tiers and keys are sized for it).
constexpr std::uint32_t decode_room = 24576;
constexpr std::uint32_t max_length = context + decode_room;
const kv_layout layout{4, 9, 3, 64, 16, dtype::f16};  // SmolLM2's attention, 4 layers
// Fast-tier slots: three budgets per layer (the selection, what is being fetched for the next
// step, and room for eviction to choose from), or every block of a full sequence.
const std::uint32_t budget_slots = layout.num_layers * 3 * layout.blocks_for(budget_tokens);
const std::uint32_t every_slot = layout.num_layers * layout.blocks_for(max_length);

// The predictor of every row but the int8 summary's: Quest's f16 bounds, softmax-mass aggregation.
using default_predictor = lookahead_predictor<minmax_summary<>>;

template <class Scheduler, class Predictor = default_predictor>
struct bundle {
  using allocator = free_list_allocator;
  using fast_tier = host_tier;
  using slow_tier = file_tier;
  using transfer = cpu_copy_engine;
  using predictor = Predictor;
  using scheduler = Scheduler;
  using kernel = cpu::sparse_decode;
};

// Keys of block b are a block centre plus noise: blocks differ in relevance the way real
// attention's do, so a slowly drifting query changes the selection gradually.
struct kv_source {
  std::uint64_t state = 0x9e3779b97f4a7c15ull;
  std::vector<float> centres;  // [blocks][kv_heads][head_dim]

  // Uniform in [-1.7, 1.7) (unit variance) from xorshift64*: the prefill draws hundreds of
  // millions of values, and std::normal_distribution would make setup dominate the run.
  float noise() {
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    const auto bits = static_cast<std::uint32_t>((state * 0x2545f4914f6cdd1dull) >> 40);
    return (static_cast<float>(bits) / 16777216.0f - 0.5f) * 3.4641f;
  }

  kv_source() {
    centres.resize(std::size_t{layout.blocks_for(max_length)} * layout.num_kv_heads *
                   layout.head_dim);
    for (float& c : centres) {
      c = 1.5f * noise();
    }
  }
  // Rows for tokens [first, first + n): [n][kv_heads][head_dim] f16.
  void rows(std::uint32_t first, std::uint32_t n, std::vector<f16>& k, std::vector<f16>& v) {
    const std::size_t width = std::size_t{layout.num_kv_heads} * layout.head_dim;
    k.resize(n * width);
    v.resize(n * width);
    for (std::uint32_t t = 0; t < n; ++t) {
      const float* c = centres.data() + ((first + t) / layout.tokens_per_block) * width;
      for (std::size_t i = 0; i < width; ++i) {
        k[t * width + i] = f16::from_float(c[i] + 0.5f * noise());
        v[t * width + i] = f16::from_float(noise());
      }
    }
  }
};

struct query_walk {
  std::mt19937 rng{11};
  std::normal_distribution<float> noise{0.0f, 1.0f};
  std::vector<float> q = std::vector<float>(layout.num_q_heads * layout.head_dim);
  explicit query_walk() {
    for (float& x : q) {
      x = noise(rng);
    }
  }
  // A small random step: the next token's query is close to this one's.
  void step(float drift) {
    for (float& x : q) {
      x = (x + drift * noise(rng)) / std::sqrt(1.0f + drift * drift);
    }
  }
};

template <class Bundle>
std::unique_ptr<tiered_kv_cache<Bundle>> make_cache(std::uint32_t fast_slots, kv_source& src,
                                                    sequence_id& seq) {
  const std::uint32_t capacity = layout.num_layers * layout.blocks_for(max_length);
  auto cache = std::make_unique<tiered_kv_cache<Bundle>>(
      file_tier(layout, capacity, {.path = "/tmp", .write_behind = true}),
      host_tier(layout, fast_slots, {.prefault = true}),
      cache_options{.budget_tokens = budget_tokens, .sink_blocks = 1, .recent_blocks = 2});
  seq = cache->add_sequence();
  std::vector<f16> k, v;
  for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
    for (std::uint32_t t = 0; t < context; t += 4096) {
      src.rows(t, 4096, k, v);
      cache->append(seq, l, k.data(), v.data(), 4096);
    }
  }
  return cache;
}

// Dense attention of one step, timed now (median of 5, ms): below, with `dense_step`.
double dense_step_ms();

// One cache's decode loop: per step, one token through every layer (append -> attend ->
// lookahead), with its own query walk (the same for every cache: the same drift gives the same
// queries) and the statistics of the steps it ran.
template <class Cache>
class decode_loop {
 public:
  decode_loop(Cache* cache, sequence_id seq, kv_source& src, float drift)
      : cache_(cache), seq_(seq), src_(&src), drift_(drift), out_(walk_.q.size()) {
    // Warm up: one step predicts, later steps find their blocks staged.
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      cache_->lookahead(seq_, l, {walk_.q.data(), nullptr, 1});
    }
    before_ = cache_->stats();
    start_length_ = cache_->length(seq_);
  }

  // Runs `n` steps whose statistics are not counted: the measured steps then find the tiers'
  // connections, queues and caches as they are in a running decoder.
  void warm_up(std::uint32_t n) {
    for (std::uint32_t i = 0; i < n && !full(); ++i) {
      step();
    }
    before_ = cache_->stats();
    start_length_ = cache_->length(seq_);
    lookahead_seconds_ = 0.0;
    steps_ = 0;
  }

  // Waits for the background work the steps started (the last lookahead's prefetch, the file
  // tier's writes behind): called once the clock has stopped, so that none of it runs into the
  // next measurement.
  void drain() { cache_->drain(); }

  // Whether the sequence has reached the tokens its tiers (and the source's keys) have room for.
  bool full() const { return cache_->length(seq_) >= max_length; }

  void step() {
    const std::uint32_t pos = cache_->length(seq_);
    src_->rows(pos, 1, k_, v_);
    const std::vector<float> q_now = walk_.q;
    walk_.step(drift_);  // the next token's query: what the drafts predict it to be
    const sequence_id seqs[1] = {seq_};
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      cache_->append(seq_, l, k_.data(), v_.data(), 1);
      cache_->attend(seqs, l, q_now.data(), 1, out_.data());
      const auto t0 = std::chrono::steady_clock::now();
      cache_->lookahead(seq_, l, {walk_.q.data(), nullptr, 1});
      lookahead_seconds_ +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    benchmark::DoNotOptimize(out_.data());
    ++steps_;
  }
  double steps() const { return static_cast<double>(std::max<std::uint64_t>(steps_, 1)); }

  // Of the blocks its steps attended, the share that was staged in time.
  double hit_rate() const {
    const cache_stats after = cache_->stats();
    const std::uint64_t hits = after.step.hits - before_.step.hits;
    const std::uint64_t misses = after.step.misses - before_.step.misses;
    return static_cast<double>(hits) / std::max(1.0, static_cast<double>(hits + misses));
  }
  double stall_ms_per_step() const {
    return (cache_->stats().step.stall_seconds - before_.step.stall_seconds) / steps() * 1e3;
  }

  void report(benchmark::State& state, std::uint32_t fast_slots) const {
    const cache_stats after = cache_->stats();
    const double n = steps();
    const std::uint64_t fetched = (after.bytes_prefetched - before_.bytes_prefetched) +
                                  (after.step.bytes_fetched - before_.step.bytes_fetched);
    state.counters["hit_rate"] = hit_rate();
    state.counters["fetched_per_step_KiB"] = static_cast<double>(fetched) / n / 1024.0;
    // The same as a share of the blocks a step attends (every layer's budget): comparable with
    // the selection churn tools/accuracy measures on a real model (docs/accuracy.md), of which
    // it is a lower bound (a block selected again soon after may still be resident).
    state.counters["fetched_share"] =
        static_cast<double>(fetched) / n /
        (static_cast<double>(layout.num_layers) * layout.blocks_for(budget_tokens) *
         static_cast<double>(layout.block_bytes()));
    state.counters["stall_ms_per_step"] = stall_ms_per_step();
    state.counters["lookahead_ms_per_step"] = lookahead_seconds_ / n * 1e3;
    // The part of it the predictor target counts: scoring every block and the top-k.
    const double predict_ms = (after.predict_seconds - before_.predict_seconds) / n * 1e3;
    state.counters["predict_ms_per_step"] = predict_ms;
    // Over a dense step timed right after this row's loop (`dense_step`): the predictor's share.
    const double dense_ms = dense_step_ms();
    state.counters["dense_ms"] = dense_ms;
    state.counters["predict_share"] = predict_ms / dense_ms;
    state.counters["fast_MiB"] = static_cast<double>(fast_slots) * layout.block_bytes() / (1 << 20);
    state.counters["context_k"] = mean_context_k();
  }

  // The sequence's mean length over the steps run, in thousands of tokens: the predictor scores
  // every block, so its time grows with it (a cache kept from call to call starts longer).
  double mean_context_k() const {
    return (static_cast<double>(start_length_) + (steps() - 1.0) / 2.0) / 1024.0;
  }

 private:
  Cache* cache_;
  sequence_id seq_;
  kv_source* src_;
  float drift_;
  query_walk walk_;
  std::vector<float> out_;
  std::vector<f16> k_, v_;
  cache_stats before_{};
  std::uint32_t start_length_ = 0;
  double lookahead_seconds_ = 0.0;
  std::uint64_t steps_ = 0;
};

// Steps each loop runs before it is measured, so that a row times a decoder in its steady
// state. Over UCX's tcp transport the first call of a new paired cache measured `lookahead_x`
// 1.32-1.62 where its later calls measured 1.00-1.09; after 32 such steps, its first call
// measures like the others.
constexpr std::uint32_t warm_up_steps = 32;

void skip_full(benchmark::State& state) {
  static const std::string why = "the sequence reached the " + std::to_string(max_length) +
                                 " tokens its tiers hold: run fewer or shorter repetitions";
  state.SkipWithError(why.c_str());
}

// The measured loop, over any cache holding the 32k-token sequence `seq` written by `src`.
template <class Cache>
void run_decode_steps(benchmark::State& state, Cache* cache, sequence_id seq, kv_source& src,
                      std::uint32_t fast_slots) {
  decode_loop<Cache> loop(cache, seq, src, static_cast<float>(state.range(0)) / 100.0f);
  loop.warm_up(warm_up_steps);
  for (auto _ : state) {
    if (loop.full()) [[unlikely]] {
      skip_full(state);
      break;
    }
    loop.step();
  }
  loop.drain();
  loop.report(state, fast_slots);
}

template <class Scheduler, class Predictor = default_predictor>
void bm_decode_step(benchmark::State& state, std::uint32_t fast_slots) {
  kv_source src;
  sequence_id seq{};
  auto cache = make_cache<bundle<Scheduler, Predictor>>(fast_slots, src, seq);
  run_decode_steps(state, cache.get(), seq, src, fast_slots);
}

void bm_lookahead(benchmark::State& s) {
  bm_decode_step<lookahead_prefetcher<lru_eviction>>(s, budget_slots);
}
void bm_on_demand(benchmark::State& s) {
  bm_decode_step<on_demand_fetcher<lru_eviction>>(s, budget_slots);
}
void bm_all_resident(benchmark::State& s) {
  bm_decode_step<all_resident>(s, every_slot);
}
// The same with the int8 min/max summary (half the f16 summary's bytes): the predictor's share.
void bm_all_resident_qminmax(benchmark::State& s) {
  bm_decode_step<all_resident, lookahead_predictor<quantized_minmax_summary>>(s, every_slot);
}

// The three schedulers' steps interleaved in one loop, each step timed: a slow spell of the
// machine (on this VM the two vCPUs at times take turns) falls on all three alike, so their
// ratios hold where the separate rows' times drift apart (identical rows differ by up to 20%).
// The order rotates every iteration, so none always runs after another. The rows' time is
// that of three steps; the counters carry the comparison:
//   lookahead_x, on_demand_x    step time over all-resident's, summed over the same iterations
//   *_ms                        each scheduler's mean step time
template <class LA, class OD, class AR>
void run_paired(benchmark::State& state, LA& la, OD& od, AR& ar) {
  la.warm_up(warm_up_steps);
  od.warm_up(warm_up_steps);
  ar.warm_up(warm_up_steps);
  double t[3] = {};
  auto timed = [](auto& loop, double& sum) {
    const auto t0 = std::chrono::steady_clock::now();
    loop.step();
    sum += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::uint64_t i = 0;
  for (auto _ : state) {
    if (la.full() || od.full() || ar.full()) [[unlikely]] {
      skip_full(state);
      break;
    }
    switch (i++ % 3) {
      case 0:
        timed(la, t[0]);
        timed(od, t[1]);
        timed(ar, t[2]);
        break;
      case 1:
        timed(od, t[1]);
        timed(ar, t[2]);
        timed(la, t[0]);
        break;
      default:
        timed(ar, t[2]);
        timed(la, t[0]);
        timed(od, t[1]);
        break;
    }
  }
  la.drain();
  od.drain();
  ar.drain();
  const double n = static_cast<double>(std::max<std::uint64_t>(i, 1));
  state.counters["lookahead_x"] = t[0] / t[2];
  state.counters["on_demand_x"] = t[1] / t[2];
  state.counters["lookahead_ms"] = t[0] / n * 1e3;
  state.counters["on_demand_ms"] = t[1] / n * 1e3;
  state.counters["all_resident_ms"] = t[2] / n * 1e3;
  state.counters["lookahead_hit_rate"] = la.hit_rate();
  state.counters["on_demand_stall_ms"] = od.stall_ms_per_step();
  state.counters["context_k"] = ar.mean_context_k();
}

// The file tier's three caches, built once and shared by every call (each call decodes on:
// Google Benchmark calls a function once per repetition and argument).
struct file_caches {
  kv_source src[3];
  sequence_id seq[3]{};
  std::unique_ptr<tiered_kv_cache<bundle<lookahead_prefetcher<lru_eviction>>>> la =
      make_cache<bundle<lookahead_prefetcher<lru_eviction>>>(budget_slots, src[0], seq[0]);
  std::unique_ptr<tiered_kv_cache<bundle<on_demand_fetcher<lru_eviction>>>> od =
      make_cache<bundle<on_demand_fetcher<lru_eviction>>>(budget_slots, src[1], seq[1]);
  std::unique_ptr<tiered_kv_cache<bundle<all_resident>>> ar =
      make_cache<bundle<all_resident>>(every_slot, src[2], seq[2]);
};

void bm_paired(benchmark::State& state) {
  static auto* c = new file_caches;
  const float drift = static_cast<float>(state.range(0)) / 100.0f;
  decode_loop la(c->la.get(), c->seq[0], c->src[0], drift);
  decode_loop od(c->od.get(), c->seq[1], c->src[1], drift);
  decode_loop ar(c->ar.get(), c->seq[2], c->src[2], drift);
  run_paired(state, la, od, ar);
}

#if OASISKV_BENCH_UCX
// The prefill node: a child process, forked before the benchmark library or any cache starts a
// thread, that writes the 32k-token prompt of every layer (the same `kv_source` as the file
// rows) into a `kv_exporter`'s arena, publishes it as requests 1-7 (one per cache: three for
// the schedulers' rows, three for the paired row, one for the int8 summary's row; a released
// request is freed, so each cache keeps its own for the whole run) and serves until the
// benchmark exits (it dies with its parent).
constexpr std::uint32_t remote_requests = 7;

disagg::token_type bench_token() {
  disagg::token_type t{};
  const char text[] = "oasiskv-pipeline-bench-token";
  std::memcpy(t.data(), text, std::min(sizeof(text), t.size()));
  return t;
}

void export_prompt(disagg::kv_exporter& e, std::uint64_t request) {
  const std::vector<slot_id> slots = e.allocate(request, context);
  const std::uint32_t blocks = layout.blocks_for(context);
  const std::size_t row = layout.row_bytes();
  const std::size_t width = std::size_t{layout.num_kv_heads} * layout.head_dim;
  const std::uint32_t tpb = layout.tokens_per_block;
  kv_source src;
  std::vector<f16> k, v;
  for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
    src.rows(0, context, k, v);
    for (std::uint32_t t = 0; t < context; ++t) {
      std::byte* block = e.slot_data(slots[std::size_t{l} * blocks + t / tpb]);
      for (std::uint32_t h = 0; h < layout.num_kv_heads; ++h) {
        const std::size_t from = t * width + std::size_t{h} * layout.head_dim;
        std::memcpy(block + layout.key_offset(h) + (t % tpb) * row, k.data() + from, row);
        std::memcpy(block + layout.value_offset(h) + (t % tpb) * row, v.data() + from, row);
      }
    }
  }
  e.publish(request);
}

struct exporter_process {
  pid_t pid = -1;
  std::uint16_t port = 0;

  void start() {
    int fds[2];
    if (::pipe(fds) != 0) {
      throw std::runtime_error("pipeline_bench: pipe failed");
    }
    pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::close(fds[0]);
      try {
        disagg::exporter_options o;
        o.token = bench_token();
        o.lease = std::chrono::hours(1);
        disagg::kv_exporter e(
            layout, remote_requests * layout.num_layers * layout.blocks_for(context) + 8, o);
        for (std::uint64_t r = 1; r <= remote_requests; ++r) {
          export_prompt(e, r);
        }
        const std::uint16_t p = e.port();
        if (::write(fds[1], &p, sizeof p) != static_cast<ssize_t>(sizeof p)) {
          ::_exit(1);
        }
        for (;;) {
          ::pause();
        }
      } catch (const std::exception& ex) {
        std::fprintf(stderr, "pipeline_bench exporter: %s\n", ex.what());
        ::_exit(1);
      }
    }
    ::close(fds[1]);
    const bool ok = ::read(fds[0], &port, sizeof port) == static_cast<ssize_t>(sizeof port);
    ::close(fds[0]);
    if (!ok) {
      throw std::runtime_error("pipeline_bench: the exporter process did not start");
    }
  }
  ~exporter_process() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
};
exporter_process exporter;

template <class Scheduler, class Predictor = default_predictor>
struct remote_bundle {
  using allocator = free_list_allocator;
  using fast_tier = host_tier;
  using slow_tier = disagg::remote_capacity_tier<>;
  using transfer = disagg::remote_transfer;
  using predictor = Predictor;
  using scheduler = Scheduler;
  using kernel = cpu::sparse_decode;
};

// The decode node's one engine: every cache's gets go through its progress thread, as in an
// engine that serves all its sequences with one.
disagg::ucx_engine& ucx() {
  static auto* e = new disagg::ucx_engine({std::chrono::milliseconds(10000), 128});
  return *e;
}

// A cache adopting its own request once: Google Benchmark calls a benchmark function several
// times, and the sequence goes on from call to call (new tokens go to the local tail, with the
// same room as the file rows). Kept for the process's lifetime on purpose.
template <class Scheduler, class Predictor = default_predictor>
struct remote_cache {
  using cache_type = tiered_kv_cache<remote_bundle<Scheduler, Predictor>>;
  std::unique_ptr<cache_type> cache;
  std::optional<disagg::adopted_request<cache_type>> request;
  kv_source src;

  remote_cache(std::uint64_t id, std::uint32_t fast_slots) {
    disagg::remote_tier_options o;
    o.port = exporter.port;
    o.token = bench_token();
    cache = std::make_unique<cache_type>(
        disagg::remote_capacity_tier<>(
            std::make_unique<disagg::ucx_remote_tier>(ucx(), o),
            std::make_unique<host_tier>(layout,
                                        layout.num_layers * layout.blocks_for(decode_room))),
        host_tier(layout, fast_slots, {.prefault = true}),
        cache_options{.budget_tokens = budget_tokens, .sink_blocks = 1, .recent_blocks = 2});
    request.emplace(*cache, id);
  }
};

template <class Remote>
void bm_remote_step(benchmark::State& state, Remote& r, std::uint32_t fast_slots) {
  state.counters["admitted_MiB"] = static_cast<double>(r.request->admitted_bytes()) / (1 << 20);
  run_decode_steps(state, r.cache.get(), r.request->sequence(), r.src, fast_slots);
}

void bm_ucx_lookahead(benchmark::State& s) {
  static auto* r = new remote_cache<lookahead_prefetcher<lru_eviction>>(1, budget_slots);
  bm_remote_step(s, *r, budget_slots);
}
void bm_ucx_on_demand(benchmark::State& s) {
  static auto* r = new remote_cache<on_demand_fetcher<lru_eviction>>(2, budget_slots);
  bm_remote_step(s, *r, budget_slots);
}
void bm_ucx_all_resident(benchmark::State& s) {
  static auto* r = new remote_cache<all_resident>(3, every_slot);
  bm_remote_step(s, *r, every_slot);
}
// The lookahead row with the int8 min/max summary, which quantizes the shipped f16 bounds on
// load: admission stays selective, and the predictor's share is the int8 bounds'.
void bm_ucx_lookahead_qminmax(benchmark::State& s) {
  static auto* r = new remote_cache<lookahead_prefetcher<lru_eviction>,
                                    lookahead_predictor<quantized_minmax_summary>>(7, budget_slots);
  bm_remote_step(s, *r, budget_slots);
}

// The paired row's own caches (requests 4-6): they decode in lockstep, so the three sequences
// always have the same length (the rows above leave theirs at different lengths).
struct remote_caches {
  remote_cache<lookahead_prefetcher<lru_eviction>> la{4, budget_slots};
  remote_cache<on_demand_fetcher<lru_eviction>> od{5, budget_slots};
  remote_cache<all_resident> ar{6, every_slot};
};

void bm_ucx_paired(benchmark::State& state) {
  static auto* c = new remote_caches;
  const float drift = static_cast<float>(state.range(0)) / 100.0f;
  decode_loop la(c->la.cache.get(), c->la.request->sequence(), c->la.src, drift);
  decode_loop od(c->od.cache.get(), c->od.request->sequence(), c->od.src, drift);
  decode_loop ar(c->ar.cache.get(), c->ar.request->sequence(), c->ar.src, drift);
  run_paired(state, la, od, ar);
}
#endif

// Dense attention of one step over every block of every layer (4 layers over one host pool of a
// 32k-token sequence's blocks: the bytes read are what counts): the denominator of the
// predictor's share.
struct dense_step {
  host_tier pool{layout, layout.blocks_for(context), {.prefault = true}};
  std::vector<block_ref> refs;
  query_walk walk;
  std::vector<float> out = std::vector<float>(walk.q.size()),
                     lse = std::vector<float>(layout.num_q_heads);
  std::uint32_t offsets[2] = {0, layout.blocks_for(context)};
  std::uint32_t len = context;
  cpu::sparse_decode kernel;
  decode_params p;

  dense_step() {
    for (std::uint32_t b = 0; b < offsets[1]; ++b) {
      refs.push_back({b, b});
    }
    p = {walk.q.data(),
         pool.view(),
         {refs.data(), offsets, 1, 1},
         &len,
         out.data(),
         lse.data(),
         1,
         1,
         0.125f};
  }
  void run() {
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      kernel.decode(p);
    }
    benchmark::DoNotOptimize(out.data());
  }
  // Median of 5 steps, in ms: measured right after a row's timed loop, so that the predictor's
  // share is a ratio of two times taken under the same conditions.
  double median_ms() {
    run();  // warm caches and TLBs
    std::vector<double> ms;
    for (int i = 0; i < 5; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      run();
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::nth_element(ms.begin(), ms.begin() + 2, ms.end());
    return ms[2];
  }
};

dense_step& dense() {
  static auto* d = new dense_step;
  return *d;
}

double dense_step_ms() {
  return dense().median_ms();
}

void bm_dense_attention(benchmark::State& state) {
  dense_step& d = dense();
  for (auto _ : state) {
    d.run();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(
      state.iterations() * layout.num_layers * std::size_t{d.offsets[1]} * layout.block_bytes()));
}

}  // namespace

// Arg: query drift per step, in percent of the query's norm.
BENCHMARK(bm_lookahead)->Arg(5)->Arg(20)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(bm_on_demand)->Arg(5)->Arg(20)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(bm_all_resident)->Arg(5)->Arg(20)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(bm_all_resident_qminmax)->Arg(5)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(bm_dense_attention)->Unit(benchmark::kMillisecond)->UseRealTime();
// 400 iterations (1,200 steps) per call: the caches live on from call to call, and their
// sequences have room for 24k decoded tokens.
BENCHMARK(bm_paired)
    ->Arg(5)
    ->Arg(20)
    ->Iterations(400)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
#if OASISKV_BENCH_UCX
BENCHMARK(bm_ucx_lookahead)->Arg(5)->Arg(20)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(bm_ucx_on_demand)->Arg(5)->Arg(20)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(bm_ucx_all_resident)->Arg(5)->Arg(20)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(bm_ucx_lookahead_qminmax)->Arg(20)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(bm_ucx_paired)
    ->Arg(5)
    ->Arg(20)
    ->Iterations(400)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
#endif

int main(int argc, char** argv) {
#if OASISKV_BENCH_UCX
  // Loopback defaults (docs/disagg.md); the caller's environment wins.
  ::setenv("UCX_TLS", "sm", 0);
  ::setenv("UCX_NET_DEVICES", "lo", 0);
  ::setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 0);
  ::setenv("UCX_PROTO_ENABLE", "n", 0);
  ::setenv("UCX_KEEPALIVE_INTERVAL", "1s", 0);
  ::setenv("UCX_MM_ERROR_HANDLING", "y", 0);
  exporter.start();  // before any thread exists: fork copies only this one
#endif
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) {
    return 1;
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
