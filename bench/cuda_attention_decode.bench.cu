// SPDX-License-Identifier: Apache-2.0
// GPU benchmarks of the CUDA path, each a ratio to a ceiling measured in the same binary:
//   decode:    cuda::sparse_decode's effective bandwidth over the selected K/V bytes (budget 2048
//              of a 32k context, 32 q / 8 kv heads, head dim 128, bf16) / the device-to-device
//              copy bandwidth (bytes read + written)                       target >= 0.80
//   copy:      cuda::copy_engine, scattered 16-token blocks host -> device / one large pinned
//              cudaMemcpyAsync                                              target >= 0.80
//   selection: cuda::topk_selector (scoring + top-k) / dense attention at 32k     target <= 0.10
//   facade:    one decode step of tiered_kv_cache over cuda::device_tier (fast) and
//              cuda::pinned_host_tier (capacity), budget 2048 of a 32k context: the lookahead
//              prefetcher with fast memory for twice the budget (prefetch overlapped with the
//              attention of earlier layers) / the all_resident scheduler with fast memory for
//              the whole context (every block staged as it fills)          target <= 1.05
//   step:      cuda::device_decode_step (staging copy, GPU selection, residency, gather of the
//              misses, decode) replayed from a CUDA graph, 32 sequences at 32k, budget 2048:
//              steady (the selection unchanged: the grown last blocks copied) and cold (every
//              selected block copied from pinned host memory) / sparse_decode alone over the
//              same number of blocks                                       (no target: a figure)
// A plain harness timed with CUDA events (median of repeats after warm-up), printing JSON: the
// GPU machines have no Google Benchmark, and events time the device, not the host.
// Usage: cuda_attention_decode_bench [output.json]. Exits 77 without a device.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "oasiskv/allocator/free_list_allocator.hpp"
#include "oasiskv/cuda/cuda.cuh"
// The predictor's host scoring loops carry `#pragma GCC unroll`, unknown to nvcc's front end.
#pragma nv_diag_suppress 1675
#include "oasiskv/kv_cache.hpp"
#include "oasiskv/predictor/lookahead_predictor.hpp"
#pragma nv_diag_default 1675
#if defined(OASISKV_BENCH_FLASHINFER)
#include "oasiskv/attention/cuda/flashinfer_decode.cuh"
#endif

namespace {

namespace oc = oasiskv::cuda;
using oasiskv::block_ref;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
#define BENCH_CHECK(x) check((x), #x)

template <class T>
T* device_alloc(std::size_t n) {
  void* p = nullptr;
  BENCH_CHECK(cudaMalloc(&p, std::max<std::size_t>(1, n) * sizeof(T)));
  return static_cast<T*>(p);
}
template <class T>
T* device_copy(const std::vector<T>& v) {
  T* p = device_alloc<T>(v.size());
  BENCH_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

// Fills device memory with random bits (never zeros: they can run faster than real data).
__global__ void fill_random_kernel(std::uint32_t* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    std::uint32_t x = static_cast<std::uint32_t>(i) * 0x9e3779b9u ^ seed;
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    // Keep bf16/f16 pairs finite and small: clear the top exponent bits of each half.
    p[i] = x & 0xbfffbfffu & 0xfbfffbffu;
  }
}
void fill_random(void* p, std::size_t bytes, std::uint32_t seed) {
  fill_random_kernel<<<1024, 256>>>(static_cast<std::uint32_t*>(p), bytes / 4, seed);
  BENCH_CHECK(cudaGetLastError());
  BENCH_CHECK(cudaDeviceSynchronize());
}

// Median milliseconds of `reps` runs of `f` on `stream`, after `warmup` runs.
double median_ms(cudaStream_t stream, const std::function<void()>& f, int warmup = 3,
                 int reps = 20) {
  cudaEvent_t a = nullptr, b = nullptr;
  BENCH_CHECK(cudaEventCreate(&a));
  BENCH_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) {
    f();
  }
  BENCH_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    BENCH_CHECK(cudaEventRecord(a, stream));
    f();
    BENCH_CHECK(cudaEventRecord(b, stream));
    BENCH_CHECK(cudaEventSynchronize(b));
    float t = 0.0f;
    BENCH_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  BENCH_CHECK(cudaEventDestroy(a));
  BENCH_CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

std::string json;
void record(const std::string& name, const std::string& fields) {
  const std::string line = "  {\"name\": \"" + name + "\", " + fields + "}";
  std::printf("%s\n", line.c_str());
  json += (json.empty() ? "" : ",\n") + line;
}
std::string num(const char* key, double v) {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "\"%s\": %.6g", key, v);
  return buf;
}

// A batch of sequences whose tables list `blocks_per_seq` blocks of `context_blocks`, staged in
// a pool of exactly those slots in a shuffled order (scattered reads, as a staging pool holds).
struct decode_setup {
  oasiskv::kv_layout l;
  std::uint32_t num_seqs, blocks_per_seq, q_len;
  std::byte* pool = nullptr;
  float *q = nullptr, *out = nullptr, *lse = nullptr;
  block_ref* refs = nullptr;
  std::uint32_t *offsets = nullptr, *lens = nullptr;
  std::vector<block_ref> host_refs;  // the tables, also on the host
  std::vector<std::uint32_t> host_offsets, host_lens;
  oasiskv::decode_params p;

  decode_setup(const oasiskv::kv_layout& layout, std::uint32_t seqs, std::uint32_t context_blocks,
               std::uint32_t per_seq, std::uint32_t qlen, std::mt19937& rng)
      : l(layout), num_seqs(seqs), blocks_per_seq(per_seq), q_len(qlen) {
    const std::uint32_t slots = seqs * per_seq;
    pool = device_alloc<std::byte>(std::size_t{slots} * l.block_bytes());
    fill_random(pool, std::size_t{slots} * l.block_bytes(), 17);
    std::vector<std::uint32_t> perm(slots);
    std::iota(perm.begin(), perm.end(), 0u);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<block_ref> h;
    std::vector<std::uint32_t> off{0}, len;
    for (std::uint32_t s = 0; s < seqs; ++s) {
      std::vector<std::uint32_t> idx(context_blocks);
      std::iota(idx.begin(), idx.end(), 0u);
      std::shuffle(idx.begin(), idx.end() - 1, rng);
      std::vector<std::uint32_t> chosen(idx.end() - per_seq, idx.end());
      std::sort(chosen.begin(), chosen.end());
      for (std::uint32_t b : chosen) {
        h.push_back({perm[h.size()], b});
      }
      off.push_back(static_cast<std::uint32_t>(h.size()));
      len.push_back(context_blocks * l.tokens_per_block);
    }
    refs = device_copy(h);
    offsets = device_copy(off);
    lens = device_copy(len);
    host_refs = h;
    host_offsets = off;
    host_lens = len;
    const std::size_t qn = std::size_t{seqs} * qlen * l.num_q_heads * l.head_dim;
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> hq(qn);
    for (float& x : hq) {
      x = u(rng);
    }
    q = device_copy(hq);
    out = device_alloc<float>(qn);
    lse = device_alloc<float>(qn / l.head_dim);
    p.q = q;
    p.pool = {pool, l.block_bytes(), slots, l};
    p.table = {refs, offsets, seqs, 1};
    p.seq_lens = lens;
    p.out = out;
    p.lse = lse;
    p.num_seqs = seqs;
    p.q_len = qlen;
    p.scale = 1.0f / std::sqrt(static_cast<float>(l.head_dim));
  }
  ~decode_setup() {
    for (void* x : {static_cast<void*>(pool), static_cast<void*>(q), static_cast<void*>(out),
                    static_cast<void*>(lse), static_cast<void*>(refs), static_cast<void*>(offsets),
                    static_cast<void*>(lens)}) {
      (void)cudaFree(x);
    }
  }
  double selected_bytes() const {
    return double(num_seqs) * blocks_per_seq * static_cast<double>(l.block_bytes());
  }
};

double d2d_copy_bandwidth(cudaStream_t s) {
  const std::size_t bytes = std::size_t{2} << 30;
  std::byte* a = device_alloc<std::byte>(bytes);
  std::byte* b = device_alloc<std::byte>(bytes);
  fill_random(a, bytes, 3);
  const double ms = median_ms(
      s, [&] { BENCH_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s)); }, 2, 10);
  BENCH_CHECK(cudaFree(a));
  BENCH_CHECK(cudaFree(b));
  const double bw = 2.0 * static_cast<double>(bytes) / (ms * 1e-3);  // read + written
  record("d2d_copy", num("bytes", static_cast<double>(bytes)) + ", " + num("ms", ms) + ", " +
                         num("GBps_read_plus_write", bw / 1e9));
  return bw;
}

// The facade on the GPU policies (the library's default predictor, scoring on the host), with
// the lookahead prefetcher or the all-resident scheduler (every block staged as it fills).
template <class Scheduler>
struct gpu_policies {
  using allocator = oasiskv::free_list_allocator;
  using fast_tier = oc::device_tier;
  using slow_tier = oc::pinned_host_tier;
  using transfer = oc::copy_engine;
  using predictor = oasiskv::lookahead_predictor<>;
  using scheduler = Scheduler;
  using kernel = oc::sparse_decode;
};
using lookahead_scheduler = oasiskv::lookahead_prefetcher<oasiskv::lru_eviction>;
static_assert(oasiskv::check_policy_bundle<gpu_policies<lookahead_scheduler>>);
static_assert(oasiskv::check_policy_bundle<gpu_policies<oasiskv::all_resident>>);

struct step_figures {
  double ms = 0.0;              // median wall time of one whole step (all layers, all sequences)
  double predict_ms = 0.0;      // of which in the predictor, per step (mean)
  double hit_rate = 0.0;        // blocks attention found staged / blocks it needed
  double misses = 0.0;          // per step
  double prefetched_mib = 0.0;  // per step
  double stall_ms = 0.0;        // per step, waiting for transfers at attention
};

// One engine decode step as the facade serves it, timed on the host (the facade's calls are
// synchronous): every layer appends the new token of every sequence (written through where its
// block is staged), the lookahead of every layer predicts and starts its prefetch, then every
// layer attends (device queries and outputs). Queries are a fixed direction per (sequence,
// layer) plus noise, so consecutive steps select mostly the same blocks, as decoding does; the
// lookahead reads the step's queries with a little more noise (an imperfect draft).
template <class Scheduler>
step_figures facade_steps(std::uint32_t fast_slots, std::uint32_t seqs, std::uint32_t context,
                          std::uint32_t layers, std::uint32_t budget, int warmup, int reps) {
  const oasiskv::kv_layout l{layers, 32, 8, 128, 16, oasiskv::dtype::bf16};
  const std::uint32_t blocks = context / l.tokens_per_block + 1;  // +1: the decoded tokens
  oasiskv::tiered_kv_cache<gpu_policies<Scheduler>> c(
      oc::pinned_host_tier(l, std::size_t{seqs} * layers * blocks), oc::device_tier(l, fast_slots),
      {.budget_tokens = budget});
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  // Keys and values: windows of a pool of random rows (distinct per block, cheap to make).
  const std::size_t row = std::size_t{l.num_kv_heads} * l.head_dim;
  const std::uint32_t pool_tokens = 8192, chunk = 512;
  std::vector<oasiskv::bf16> kv(std::size_t{pool_tokens + chunk} * row);
  for (auto& x : kv) {
    x = oasiskv::bf16::from_float(u(rng));
  }
  std::vector<oasiskv::sequence_id> ids;
  for (std::uint32_t s = 0; s < seqs; ++s) {
    ids.push_back(c.add_sequence());
    for (std::uint32_t layer = 0; layer < layers; ++layer) {
      for (std::uint32_t t = 0; t < context; t += chunk) {
        const std::size_t at = (std::size_t{s} * 7919 + layer * 104729 + t) % pool_tokens * row;
        c.append(ids.back(), layer, kv.data() + at, kv.data() + pool_tokens * row - at,
                 std::min(chunk, context - t));
      }
    }
  }
  const std::size_t qrow = std::size_t{l.num_q_heads} * l.head_dim;
  std::vector<float> base(std::size_t{layers} * seqs * qrow);
  for (float& x : base) {
    x = 2.0f * u(rng);
  }
  const int steps = warmup + reps;
  // Per step and layer: the attended queries (uploaded before timing) and the drafts.
  std::vector<float> q(static_cast<std::size_t>(steps) * base.size()), draft(q.size());
  for (std::size_t i = 0; i < q.size(); ++i) {
    q[i] = base[i % base.size()] + 0.5f * u(rng);
    draft[i] = q[i] + 0.2f * u(rng);
  }
  float* dq = device_copy(q);
  float* dout = device_alloc<float>(std::size_t{seqs} * qrow);
  float* dlse = device_alloc<float>(std::size_t{seqs} * l.num_q_heads);
  std::vector<double> ms;
  oasiskv::cache_stats before{};
  for (int step = 0; step < steps; ++step) {
    if (step == warmup) {
      before = c.stats();
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (std::uint32_t layer = 0; layer < layers; ++layer) {
      // Each sequence's new token, batched: the write-through is waited for once per layer.
      const std::size_t at = (std::size_t{layer} * 17 + step) % pool_tokens;
      c.append(ids, layer, kv.data() + at * row,
               kv.data() + (at + pool_tokens / 2) % pool_tokens * row, 1);
    }
    const std::size_t per_step = base.size();
    for (std::uint32_t layer = 0; layer < layers; ++layer) {
      c.lookahead(ids, layer, draft.data() + step * per_step + std::size_t{layer} * seqs * qrow, 1);
    }
    for (std::uint32_t layer = 0; layer < layers; ++layer) {
      const std::size_t at = step * per_step + std::size_t{layer} * seqs * qrow;
      c.attend(ids, layer, dq + at, 1, dout, dlse);
    }
    BENCH_CHECK(cudaDeviceSynchronize());
    const double t =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (step >= warmup) {
      ms.push_back(t);
    }
  }
  const oasiskv::cache_stats after = c.stats();
  BENCH_CHECK(cudaFree(dq));
  BENCH_CHECK(cudaFree(dout));
  BENCH_CHECK(cudaFree(dlse));
  std::sort(ms.begin(), ms.end());
  step_figures f;
  f.ms = ms[ms.size() / 2];
  f.predict_ms = (after.predict_seconds - before.predict_seconds) * 1e3 / reps;
  const double hits = static_cast<double>(after.step.hits - before.step.hits);
  const double misses = static_cast<double>(after.step.misses - before.step.misses);
  f.hit_rate = hits + misses == 0 ? 1.0 : hits / (hits + misses);
  f.misses = misses / reps;
  f.prefetched_mib =
      static_cast<double>(after.bytes_prefetched - before.bytes_prefetched) / reps / (1 << 20);
  f.stall_ms = (after.step.stall_seconds - before.step.stall_seconds) * 1e3 / reps;
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  cudaDeviceProp prop{};
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("[\n");
  record("device", std::string("\"gpu\": \"") + prop.name + "\", " +
                       num("sms", prop.multiProcessorCount) + ", " +
                       num("l2_bytes", prop.l2CacheSize));
  cudaStream_t s = nullptr;
  BENCH_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::mt19937 rng(1);
  const double copy_bw = d2d_copy_bandwidth(s);

  // 1. Sparse decode: budget 2048 tokens (128 blocks) of a 32k context (2048 blocks).
  const oasiskv::kv_layout l{1, 32, 8, 128, 16, oasiskv::dtype::bf16};
  double decode_ratio = 0.0;
  for (const std::uint32_t q_len : {1u, 4u}) {
    for (const std::uint32_t seqs : {1u, 32u, 64u}) {
      decode_setup d(l, seqs, 2048, 128, q_len, rng);
      oc::sparse_decode_options o;
      o.stream = s;
      o.asynchronous = true;
      o.check_pointers = false;  // the hot path: pointers were checked once
      oc::sparse_decode k(o);
      k.decode(d.p);  // allocates the workspace outside the timed region
      const double ms = median_ms(s, [&] { k.decode(d.p); });
      k.check_device_status();
      const double bw = d.selected_bytes() / (ms * 1e-3);
      const double ratio = bw / copy_bw;
      if (q_len == 1 && seqs == 32) {  // the batch the issue's target names
        decode_ratio = ratio;
      }
      record("sparse_decode", num("num_seqs", seqs) + ", " + num("q_len", q_len) + ", " +
                                  num("splits", k.splits_for(seqs, q_len, l)) + ", " +
                                  num("selected_bytes", d.selected_bytes()) + ", " + num("ms", ms) +
                                  ", " + num("GBps", bw / 1e9) + ", " +
                                  num("ratio_to_d2d_copy", ratio));
    }
  }

#if defined(OASISKV_BENCH_FLASHINFER)
  // 1b. The own kernel beside FlashInfer's paged decode on the same selection.
  for (const std::uint32_t seqs : {1u, 32u}) {
    decode_setup d(l, seqs, 2048, 128, 1, rng);
    oasiskv::decode_params host = d.p;  // the same tables, on the host
    host.table.refs = d.host_refs.data();
    host.table.offsets = d.host_offsets.data();
    host.seq_lens = d.host_lens.data();
    oc::sparse_decode_options o;
    o.stream = s;
    o.asynchronous = true;
    o.check_pointers = false;
    oc::sparse_decode own(o);
    oc::flashinfer_decode_options fo;
    fo.stream = s;
    fo.asynchronous = true;
    fo.check_pointers = false;
    oc::flashinfer_decode fi(fo);
    own.decode(d.p);
    fi.prepare(host);
    const double own_ms = median_ms(s, [&] { own.decode(d.p); });
    own.check_device_status();
    const double fi_ms = median_ms(s, [&] { fi.launch_prepared(d.p); });
    const double own_call_ms = median_ms(s, [&] { own.decode_host_tables(host); });
    const double fi_call_ms = median_ms(s, [&] { fi.decode_host_tables(host); });
    BENCH_CHECK(cudaStreamSynchronize(s));
    record("sparse_decode_vs_flashinfer",
           num("num_seqs", seqs) + ", " + num("budget_tokens", 2048) + ", " +
               num("context", 32768) + ", " + num("selected_bytes", d.selected_bytes()) + ", " +
               num("own_ms", own_ms) + ", " + num("flashinfer_ms", fi_ms) + ", " +
               num("own_over_flashinfer", own_ms / fi_ms) + ", " + num("own_call_ms", own_call_ms) +
               ", " + num("flashinfer_call_ms", fi_call_ms) + ", " +
               num("own_over_flashinfer_call", own_call_ms / fi_call_ms));
  }
#endif

  // 2. Scoring + top-k vs dense attention at 32k.
  double select_ratio = 0.0;
  {
    const std::uint32_t seqs = 16, blocks = 2048;
    decode_setup dense(l, seqs, blocks, blocks, 1, rng);
    oc::sparse_decode_options o;
    o.stream = s;
    o.asynchronous = true;
    o.check_pointers = false;
    oc::sparse_decode k(o);
    k.decode(dense.p);
    const double dense_ms = median_ms(s, [&] { k.decode(dense.p); });
    oc::device_minmax_summary sum(l, seqs * blocks);
    fill_random(const_cast<oasiskv::f16*>(sum.bounds()),
                std::size_t{l.num_kv_heads} * seqs * blocks * 2 * l.head_dim * 2, 5);
    BENCH_CHECK(
        cudaMemset(const_cast<std::uint16_t*>(sum.tokens()), 1, std::size_t{seqs} * blocks * 2));
    std::vector<std::uint32_t> ids(std::size_t{seqs} * blocks);
    std::iota(ids.begin(), ids.end(), 0u);
    std::uint32_t* dids = device_copy(ids);
    oasiskv::block_ref* refs = device_alloc<oasiskv::block_ref>(std::size_t{seqs} * 128);
    std::uint32_t* offsets = device_alloc<std::uint32_t>(seqs + 1);
    oc::topk_selector::options so;
    so.stream = s;
    so.check_pointers = false;
    oc::topk_selector sel(so);
    oc::topk_request r;
    r.queries = dense.q;
    r.num_tokens = 1;
    r.seq_lens = dense.lens;
    r.summary_ids = dids;
    r.staged_slots = dids;
    r.refs = refs;
    r.offsets = offsets;
    r.num_seqs = seqs;
    r.max_blocks = blocks;
    r.params = {128, 1, 1};
    sel.select(sum, r);
    const double select_ms = median_ms(s, [&] { sel.select(sum, r); });
    sel.check_status();
    select_ratio = select_ms / dense_ms;
    record("selection_vs_dense",
           num("num_seqs", seqs) + ", " + num("context", 32768) + ", " + num("dense_ms", dense_ms) +
               ", " + num("dense_GBps", dense.selected_bytes() / dense_ms / 1e6) + ", " +
               num("select_ms", select_ms) + ", " + num("ratio", select_ratio));
    BENCH_CHECK(cudaFree(dids));
    BENCH_CHECK(cudaFree(refs));
    BENCH_CHECK(cudaFree(offsets));
  }

  // 2c. The capturable step (device_decode_step) replayed, against its decode alone.
  {
    const std::uint32_t seqs = 32, blocks = 2048, budget = 128;
    decode_setup alone(l, seqs, blocks, budget, 1, rng);
    oc::sparse_decode_options o;
    o.stream = s;
    o.asynchronous = true;
    o.check_pointers = false;
    oc::sparse_decode k(o);
    k.decode(alone.p);
    const double decode_ms = median_ms(s, [&] { k.decode(alone.p); });
    // The whole context in pinned host memory, its summaries on the device.
    const std::size_t cap_slots = std::size_t{seqs} * blocks;
    void* cap = nullptr;
    BENCH_CHECK(cudaHostAlloc(&cap, cap_slots * l.block_bytes(), cudaHostAllocDefault));
    fill_random(cap, cap_slots * l.block_bytes(), 11);  // through UVA
    oc::device_minmax_summary sum(l, static_cast<std::uint32_t>(cap_slots));
    fill_random(const_cast<oasiskv::f16*>(sum.bounds()),
                std::size_t{l.num_kv_heads} * cap_slots * 2 * l.head_dim * 2, 13);
    std::vector<std::uint16_t> full(cap_slots, static_cast<std::uint16_t>(l.tokens_per_block));
    BENCH_CHECK(cudaMemcpy(const_cast<std::uint16_t*>(sum.tokens()), full.data(), cap_slots * 2,
                           cudaMemcpyHostToDevice));
    std::byte* fast = device_alloc<std::byte>(std::size_t{seqs} * budget * l.block_bytes());
    oc::device_decode_step_options so;
    so.max_seqs = seqs;
    so.max_blocks = blocks;
    so.selection = {budget, 1, 1};
    so.fast = {fast, l.block_bytes(), seqs * budget, l};
    so.capacity = {static_cast<std::byte*>(cap), l.block_bytes(),
                   static_cast<std::uint32_t>(cap_slots), l};
    oc::device_decode_step step(sum, so);
    for (std::uint32_t q = 0; q < seqs; ++q) {
      step.seq_lens()[q] = blocks * l.tokens_per_block;
      for (std::uint32_t i = 0; i < blocks; ++i) {
        step.summary_ids(q)[i] = q * blocks + i;
        step.capacity_slots(q)[i] = q * blocks + i;
      }
    }
    const std::size_t rows = std::size_t{seqs} * l.num_q_heads * l.head_dim;
    std::vector<float> hq(rows);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (float& x : hq) {
      x = u(rng);
    }
    float* dq = device_copy(hq);
    float* dout = device_alloc<float>(rows);
    oc::device_decode_step_io io;
    io.q = dq;
    io.lookahead = dq;
    io.out = dout;
    io.num_seqs = seqs;
    step.capture(io, s);
    step.replay(s);  // the first replay stages every selected block
    step.check_status(s);
    const double steady_ms = median_ms(s, [&] { step.replay(s); });
    const double cold_ms = median_ms(s, [&] {
      step.invalidate(s);
      step.replay(s);
    });
    step.check_status(s);
    const double selected = double(seqs) * budget * static_cast<double>(l.block_bytes());
    record("device_step", num("num_seqs", seqs) + ", " + num("context", 32768) + ", " +
                              num("budget_tokens", 2048) + ", " + num("decode_ms", decode_ms) +
                              ", " + num("steady_ms", steady_ms) + ", " +
                              num("steady_over_decode", steady_ms / decode_ms) + ", " +
                              num("cold_ms", cold_ms) + ", " +
                              num("cold_over_decode", cold_ms / decode_ms) + ", " +
                              num("cold_h2d_GBps", selected / (cold_ms * 1e-3) / 1e9));
    BENCH_CHECK(cudaFree(dq));
    BENCH_CHECK(cudaFree(dout));
    BENCH_CHECK(cudaFree(fast));
    BENCH_CHECK(cudaFreeHost(cap));
  }

  // 2b. The facade's step, lookahead prefetch overlapped, against the same step all-resident.
  double facade_ratio = 0.0;
  for (const std::uint32_t seqs : {1u, 8u}) {
    const std::uint32_t context = 32768, layers = 4, budget = 2048;
    const std::uint32_t blocks = context / 16 + 1;
    // Fast memory for twice each (sequence, layer)'s budget, against the whole context.
    const step_figures tiered = facade_steps<lookahead_scheduler>(
        seqs * layers * 2 * (budget / 16 + 8), seqs, context, layers, budget, 5, 20);
    const step_figures resident = facade_steps<oasiskv::all_resident>(
        seqs * layers * (blocks + 8), seqs, context, layers, budget, 5, 20);
    const double ratio = tiered.ms / resident.ms;
    if (seqs == 8) {
      facade_ratio = ratio;
    }
    auto fields = [](const char* who, const step_figures& f) {
      const std::string w(who);
      return num((w + "_ms").c_str(), f.ms) + ", " +
             num((w + "_predict_ms").c_str(), f.predict_ms) + ", " +
             num((w + "_hit_rate").c_str(), f.hit_rate) + ", " +
             num((w + "_misses_per_step").c_str(), f.misses) + ", " +
             num((w + "_prefetched_MiB_per_step").c_str(), f.prefetched_mib) + ", " +
             num((w + "_stall_ms").c_str(), f.stall_ms);
    };
    record("facade_step", num("num_seqs", seqs) + ", " + num("layers", layers) + ", " +
                              num("context", context) + ", " + num("budget_tokens", budget) + ", " +
                              fields("tiered", tiered) + ", " + fields("resident", resident) +
                              ", " + num("ratio", ratio));
  }

  // 3. Copy engine: 128 MiB of scattered blocks host -> device vs one pinned cudaMemcpyAsync.
  double copy_ratio = 0.0;
  {
    const std::size_t total = std::size_t{128} << 20;
    void* hbuf = nullptr;
    BENCH_CHECK(cudaHostAlloc(&hbuf, total, cudaHostAllocDefault));
    std::byte* dbuf = device_alloc<std::byte>(total);
    std::memset(hbuf, 0x5a, total);
    const double ref_ms = median_ms(
        s, [&] { BENCH_CHECK(cudaMemcpyAsync(dbuf, hbuf, total, cudaMemcpyHostToDevice, s)); }, 2,
        10);
    const double ref_bw = static_cast<double>(total) / (ref_ms * 1e-3);
    record("h2d_pinned_memcpy", num("bytes", static_cast<double>(total)) + ", " +
                                    num("ms", ref_ms) + ", " + num("GBps", ref_bw / 1e9));
    BENCH_CHECK(cudaFree(dbuf));
    BENCH_CHECK(cudaFreeHost(hbuf));
    const oasiskv::kv_layout small{1, 8, 2, 64, 16, oasiskv::dtype::f16};  // 8 KiB blocks
    for (const auto& layout : {l, small}) {
      const auto n = static_cast<std::uint32_t>(total / layout.block_bytes());
      oc::pinned_host_tier src(layout, 2 * n);
      oc::device_tier dst(layout, n);
      std::vector<std::uint32_t> from(2 * n);
      std::iota(from.begin(), from.end(), 0u);
      std::shuffle(from.begin(), from.end(), rng);
      std::vector<std::uint32_t> to(n);
      std::iota(to.begin(), to.end(), 0u);
      std::shuffle(to.begin(), to.end(), rng);
      std::vector<oasiskv::block_copy> copies(n);
      for (std::uint32_t i = 0; i < n; ++i) {
        copies[i] = {from[i], to[i]};
      }
      for (const auto path :
           {oc::copy_engine::copy_path::automatic, oc::copy_engine::copy_path::gather_kernel,
            oc::copy_engine::copy_path::batch_memcpy}) {
        oc::copy_engine::options eo;
        eo.path = path;
        oc::copy_engine e(eo);
        const double ms = median_ms(
            e.stream(), [&] { e.wait(e.submit(src, dst, copies)); }, 2, 10);
        const double bw = static_cast<double>(n) * layout.block_bytes() / (ms * 1e-3);
        const char* names[] = {"automatic", "gather_kernel", "batch_memcpy"};
        const double ratio = bw / ref_bw;
        if (&layout == &l && path == oc::copy_engine::copy_path::automatic) {
          copy_ratio = ratio;
        }
        record("copy_engine", std::string("\"path\": \"") + names[static_cast<int>(path)] + "\", " +
                                  num("block_bytes", layout.block_bytes()) + ", " +
                                  num("blocks", n) + ", " + num("ms", ms) + ", " +
                                  num("GBps", bw / 1e9) + ", " +
                                  num("ratio_to_pinned_memcpy", ratio));
      }
    }
  }

  record("summary", num("decode_ratio", decode_ratio) + ", \"decode_target\": \">= 0.80\", " +
                        num("copy_ratio", copy_ratio) + ", \"copy_target\": \">= 0.80\", " +
                        num("selection_ratio", select_ratio) +
                        ", \"selection_target\": \"<= 0.10\", " +
                        num("facade_ratio", facade_ratio) + ", \"facade_target\": \"<= 1.05\"");
  std::printf("]\n");
  if (argc > 1) {
    if (FILE* f = std::fopen(argv[1], "w")) {
      std::fprintf(f, "[\n%s\n]\n", json.c_str());
      std::fclose(f);
    }
  }
  BENCH_CHECK(cudaStreamDestroy(s));
  return 0;
}
