// SPDX-License-Identifier: Apache-2.0
// GPU benchmarks of the CUDA path. Every figure is a ratio to a ceiling measured in the same run:
//   read_probe:     a read-only kernel streaming 2 GiB (16-byte loads, several grid shapes, the
//                   best taken): the device's read bandwidth, the ceiling of a decode, which reads
//   sparse_decode / dense_decode (and _pipelined: the cp.async variant on the same setup):
//                   cuda::sparse_decode over a budget of 2048 tokens of a 32k
//                   context (32 q / 8 kv heads, head dim 128, bf16), and over the whole context, at
//                   the same batches (1, 8, 32, 64 sequences): K/V bytes read per second / the
//                   read probe's. The KV of 8 and more sequences exceeds a 50 MB L2; every timed
//                   run starts with the L2 flushed (a read of twice its size), so batch 1 reads
//                   from memory too.                                targets >= 0.80 (32), 0.60 (1)
//   selection:      cuda::topk_selector (scoring + top-k) over f16 and int8 bounds at 32k, 1 and
//                   32 sequences / sparse_decode at the same batch and budget   target <= 0.30
//   device_step:    cuda::device_decode_step replayed from a CUDA graph, 32 sequences at 32k,
//                   budget 2048, int8 and f16 bounds: steady and cold / sparse_decode alone
//   facade_step:    tiered_kv_cache's whole decode step (lookahead prefetch, host predictor) over
//                   the same step all-resident, timed on the host (the facade's calls are
//                   synchronous), 1 and 8 sequences                             target <= 1.05
//   copy_engine:    scattered blocks host -> device / one large pinned cudaMemcpyAsync
//                                                                               target >= 0.80
//   sparse_decode_vs_flashinfer (with FlashInfer's headers): the own kernel's time over
//                   FlashInfer's on the same selection, batch 1 and 32         target <= 1.05
// Device work alone is timed: each timed run is held behind a gate kernel until everything it
// enqueues is on the stream (the host's checks and launches happen while the device waits, outside
// the timed interval), then events around the enqueued work time the device, median of the runs.
// A run that synchronises on the host cannot be gated; it is reported with "gated": false.
// Writes every row and each target's pass/fail (bench/cuda_bench_report.hpp) as JSON to the file
// named by the first argument (rewritten after every section, so a run cut short keeps what it
// measured), and prints the rows. Exits 77 without a device.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
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

#include "cuda_bench_report.hpp"
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
namespace ob = oasiskv::bench;
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
  BENCH_CHECK(cudaDeviceSynchronize());  // pageable copies may return before the DMA lands
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
template <class T>
__global__ void fill_value_kernel(T* p, std::size_t n, T v) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    p[i] = v;
  }
}
template <class T>
void fill_value(const T* p, std::size_t n, T v) {
  fill_value_kernel<<<1024, 256>>>(const_cast<T*>(p), n, v);
  BENCH_CHECK(cudaGetLastError());
  BENCH_CHECK(cudaDeviceSynchronize());
}

// Reads n 16-byte words, four loads in flight per thread, and keeps the result alive with a
// store that never happens: the read bandwidth and nothing else.
__global__ void read_probe_kernel(const uint4* p, std::size_t n, std::uint32_t* sink) {
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  std::uint32_t acc = 0;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = __ldcs(p + i), b = __ldcs(p + i + stride), c = __ldcs(p + i + 2 * stride),
                d = __ldcs(p + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^
           d.w;
  }
  for (; i < n; i += stride) {
    const uint4 a = __ldcs(p + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9e3779b9u) {
    sink[0] = acc;
  }
}

// Holds its stream until the host opens the gate (or `timeout_ns` pass: the host then waited
// on the stream inside the gated region, and the run is reported as not gated).
__global__ void gate_kernel(const volatile std::uint32_t* open, std::uint64_t timeout_ns,
                            std::uint32_t* expired) {
  std::uint64_t t0 = 0, t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  while (*open == 0) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 > timeout_ns) {
      *expired = 1;
      return;
    }
    __nanosleep(1000);
  }
}

struct timing {
  double ms = 0.0;    // median of the runs
  bool gated = true;  // every run was enqueued whole before the device started it
};

// Times device work on one stream. `run(enqueue)`: per repetition, a gate kernel holds the
// stream; the L2 is flushed (a read of twice its size); the start event, whatever `enqueue`
// enqueues (its host work happens here, while the device waits), the stop event; then the gate
// opens. The median of the stop - start intervals.
class device_clock {
 public:
  // `l2_bytes`: the L2's size (the flush reads twice as much); 0: no flush.
  device_clock(cudaStream_t s, std::size_t l2_bytes) : s_(s) {
    BENCH_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&words_), 16, cudaHostAllocMapped));
    BENCH_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&words_dev_), words_, 0));
    if (l2_bytes != 0) {  // 0: runs that never flush the L2
      flush_words_ = std::max<std::size_t>(2 * l2_bytes, std::size_t{64} << 20) / 16;
      flush_ = device_alloc<uint4>(flush_words_);
      fill_random(flush_, flush_words_ * 16, 99);
    }
    sink_ = device_alloc<std::uint32_t>(1);
    BENCH_CHECK(cudaEventCreate(&a_));
    BENCH_CHECK(cudaEventCreate(&b_));
  }
  ~device_clock() {
    (void)cudaEventDestroy(a_);
    (void)cudaEventDestroy(b_);
    (void)cudaFree(flush_);
    (void)cudaFree(sink_);
    (void)cudaFreeHost(words_);
  }
  device_clock(const device_clock&) = delete;
  device_clock& operator=(const device_clock&) = delete;

  timing run(const std::function<void()>& enqueue, int warmup = 3, int reps = 20,
             bool flush_l2 = true) {
    for (int i = 0; i < warmup; ++i) {
      enqueue();
    }
    BENCH_CHECK(cudaStreamSynchronize(s_));
    std::vector<double> ms;
    timing t;
    for (int i = 0; i < reps; ++i) {
      std::atomic_ref<std::uint32_t>(words_[0]).store(0);  // the gate: closed
      words_[1] = 0;                                       // expired
      gate_kernel<<<1, 1, 0, s_>>>(words_dev_, 2'000'000'000ull, words_dev_ + 1);
      BENCH_CHECK(cudaGetLastError());
      if (flush_l2 && flush_ != nullptr) {
        read_probe_kernel<<<256, 256, 0, s_>>>(flush_, flush_words_, sink_);
        BENCH_CHECK(cudaGetLastError());
      }
      BENCH_CHECK(cudaEventRecord(a_, s_));
      enqueue();
      BENCH_CHECK(cudaEventRecord(b_, s_));
      std::atomic_ref<std::uint32_t>(words_[0]).store(1);  // open
      BENCH_CHECK(cudaEventSynchronize(b_));
      t.gated = t.gated && std::atomic_ref<std::uint32_t>(words_[1]).load() == 0;
      float x = 0.0f;
      BENCH_CHECK(cudaEventElapsedTime(&x, a_, b_));
      ms.push_back(x);
    }
    std::sort(ms.begin(), ms.end());
    t.ms = ms[ms.size() / 2];
    return t;
  }

  // The read probe over `words` 16-byte words of `p` with `ctas` x `threads`, gated as above.
  timing probe(const uint4* p, std::size_t words, unsigned ctas, unsigned threads) {
    return run(
        [&] {
          read_probe_kernel<<<ctas, threads, 0, s_>>>(p, words, sink_);
          BENCH_CHECK(cudaGetLastError());
        },
        2, 10, false);
  }

 private:
  cudaStream_t s_;
  std::uint32_t* words_ = nullptr;      // pinned, mapped: [0] gate open, [1] expired
  std::uint32_t* words_dev_ = nullptr;  // their device address
  uint4* flush_ = nullptr;
  std::size_t flush_words_ = 0;
  std::uint32_t* sink_ = nullptr;
  cudaEvent_t a_ = nullptr, b_ = nullptr;
};

#if defined(OASISKV_BENCH_FLASHINFER)  // only FlashInfer's rows time whole calls
// Wall time of `f` (which synchronises), median of `reps` after `warmup`: for the calls that
// copy tables from pageable host memory, which no gate can hold.
double host_ms(cudaStream_t s, const std::function<void()>& f, int warmup = 3, int reps = 20) {
  for (int i = 0; i < warmup; ++i) {
    f();
  }
  BENCH_CHECK(cudaStreamSynchronize(s));
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    BENCH_CHECK(cudaStreamSynchronize(s));
    ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}
#endif

// Every row measured so far, and where the JSON goes.
std::vector<ob::row> rows;
const char* json_path = nullptr;

ob::row& add(const std::string& name) {
  rows.push_back(ob::row{name, {}});
  return rows.back();
}
void print(const ob::row& r) {
  std::printf("  %s\n", ob::to_json(r).c_str());
}
// Rewrites the JSON with every row so far and the targets they give.
void flush_json() {
  if (json_path == nullptr) {
    return;
  }
  // Written whole, then renamed over the last one: a run killed meanwhile (a time limit) leaves
  // the previous complete file, never half of one.
  const std::string s = ob::report_json(rows, ob::evaluate(rows, ob::cuda_bench_rules()));
  const std::string tmp = std::string(json_path) + ".tmp";
  if (FILE* f = std::fopen(tmp.c_str(), "w")) {
    const bool ok = std::fputs(s.c_str(), f) >= 0;
    if (std::fclose(f) == 0 && ok) {
      std::rename(tmp.c_str(), json_path);
    }
  }
}

// A batch of sequences whose tables list `blocks_per_seq` blocks of `context_blocks` (always the
// last one), staged in a pool of exactly those slots in a shuffled order (scattered reads, as a
// staging pool holds).
struct decode_setup {
  oasiskv::kv_layout l;
  std::uint32_t num_seqs, context_blocks, blocks_per_seq, q_len;
  std::byte* pool = nullptr;
  float *q = nullptr, *out = nullptr, *lse = nullptr;
  block_ref* refs = nullptr;
  std::uint32_t *offsets = nullptr, *lens = nullptr;
  std::vector<block_ref> host_refs;  // the tables, also on the host
  std::vector<std::uint32_t> host_offsets, host_lens;
  oasiskv::decode_params p;

  decode_setup(const oasiskv::kv_layout& layout, std::uint32_t seqs, std::uint32_t context,
               std::uint32_t per_seq, std::uint32_t qlen, std::mt19937& rng)
      : l(layout), num_seqs(seqs), context_blocks(context), blocks_per_seq(per_seq), q_len(qlen) {
    const std::uint32_t slots = seqs * per_seq;
    pool = device_alloc<std::byte>(std::size_t{slots} * l.block_bytes());
    fill_random(pool, std::size_t{slots} * l.block_bytes(), 17);
    std::vector<std::uint32_t> perm(slots);
    std::iota(perm.begin(), perm.end(), 0u);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<block_ref> h;
    std::vector<std::uint32_t> off{0}, len;
    for (std::uint32_t s = 0; s < seqs; ++s) {
      std::vector<std::uint32_t> idx(context);
      std::iota(idx.begin(), idx.end(), 0u);
      std::shuffle(idx.begin(), idx.end() - 1, rng);
      std::vector<std::uint32_t> chosen(idx.end() - per_seq, idx.end());
      std::sort(chosen.begin(), chosen.end());
      for (std::uint32_t b : chosen) {
        h.push_back({perm[h.size()], b});
      }
      off.push_back(static_cast<std::uint32_t>(h.size()));
      len.push_back(context * l.tokens_per_block);
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
  decode_setup(const decode_setup&) = delete;
  decode_setup& operator=(const decode_setup&) = delete;
  double selected_bytes() const {
    return double(num_seqs) * blocks_per_seq * static_cast<double>(l.block_bytes());
  }
};

// `expected_blocks`: the tables' size, known to a caller that knows its budget (the splits'
// heuristic takes it, as device_decode_step gives it).
oc::sparse_decode hot_decoder(cudaStream_t s, std::uint32_t expected_blocks,
                              bool pipelined = false) {
  oc::sparse_decode_options o;
  o.pipelined = pipelined;
  o.stream = s;
  o.asynchronous = true;
  o.check_pointers = false;  // the hot path: pointers were checked once
  o.expected_blocks = expected_blocks;
  return oc::sparse_decode(o);
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
  json_path = argc > 1 ? argv[1] : nullptr;
  cudaDeviceProp prop{};
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  const auto l2 = static_cast<double>(prop.l2CacheSize);
  print(add("device")
            .str("gpu", prop.name)
            .num("sms", prop.multiProcessorCount)
            .num("l2_bytes", l2)
            .num("memory_bytes", static_cast<double>(prop.totalGlobalMem))
            .num("compute_capability", prop.major * 10 + prop.minor));
  cudaStream_t s = nullptr;
  BENCH_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  device_clock clock(s, prop.l2CacheSize);
  std::mt19937 rng(1);

  // 0. The ceilings: the read probe (the best of a few grid shapes), and a device-to-device
  // copy for reference.
  double read_bw = 0.0;
  {
    std::size_t free_bytes = 0, total = 0;
    BENCH_CHECK(cudaMemGetInfo(&free_bytes, &total));
    const std::size_t bytes = std::min(std::size_t{2} << 30, free_bytes / 4) / 16 * 16;
    uint4* buf = device_alloc<uint4>(bytes / 16);
    fill_random(buf, bytes, 3);
    double best_ms = 0.0;
    unsigned best_ctas = 0, best_threads = 0;
    for (const unsigned per_sm : {2u, 4u, 8u}) {
      for (const unsigned threads : {256u, 512u}) {
        const unsigned ctas = per_sm * static_cast<unsigned>(prop.multiProcessorCount);
        const double ms = clock.probe(buf, bytes / 16, ctas, threads).ms;
        if (best_ms == 0.0 || ms < best_ms) {
          best_ms = ms;
          best_ctas = ctas;
          best_threads = threads;
        }
      }
    }
    read_bw = static_cast<double>(bytes) / (best_ms * 1e-3);
    print(add("read_probe")
              .num("bytes", static_cast<double>(bytes))
              .num("ms", best_ms)
              .num("ctas", best_ctas)
              .num("threads", best_threads)
              .num("GBps", read_bw / 1e9));
    std::byte* dst = device_alloc<std::byte>(bytes);
    const timing copy = clock.run(
        [&] { BENCH_CHECK(cudaMemcpyAsync(dst, buf, bytes, cudaMemcpyDeviceToDevice, s)); }, 2, 10,
        false);
    print(add("d2d_copy")
              .num("bytes", static_cast<double>(bytes))
              .num("ms", copy.ms)
              .num("GBps_read_plus_write", 2.0 * static_cast<double>(bytes) / copy.ms / 1e6));
    BENCH_CHECK(cudaFree(buf));
    BENCH_CHECK(cudaFree(dst));
  }
  flush_json();

  // 1. Decode: budget 2048 tokens (128 blocks) of a 32k context (2048 blocks), and the whole
  // context, at the same batches. Llama-3-8B's attention shape.
  const oasiskv::kv_layout l{1, 32, 8, 128, 16, oasiskv::dtype::bf16};
  const std::uint32_t context = 2048, budget = 128;
  std::vector<std::pair<std::uint32_t, double>> sparse_ms;  // q_len 1: (sequences, ms)
  // One setup, both kernels: the direct loads (the default, `name`) and the cp.async pipeline
  // (`name`_pipelined). Returns the default's milliseconds.
  auto decode_row = [&](const std::string& name, std::uint32_t seqs, std::uint32_t per_seq,
                        std::uint32_t q_len) {
    decode_setup d(l, seqs, context, per_seq, q_len, rng);
    double default_ms = 0.0;
    for (const bool pipelined : {false, true}) {
      oc::sparse_decode k = hot_decoder(s, per_seq, pipelined);
      k.decode(d.p);  // allocates the workspace outside the timed region
      const timing t = clock.run([&] { k.decode(d.p); });
      k.check_device_status();
      const double bw = d.selected_bytes() / (t.ms * 1e-3);
      print(add(pipelined ? name + "_pipelined" : name)
                .num("num_seqs", seqs)
                .num("q_len", q_len)
                .num("budget_tokens", per_seq * l.tokens_per_block)
                .num("context", context * l.tokens_per_block)
                .num("splits", k.splits_for(seqs, q_len, l))
                .num("kv_bytes", d.selected_bytes())
                .flag("kv_exceeds_l2", d.selected_bytes() > l2)
                .flag("l2_flushed", true)
                .num("ms", t.ms)
                .num("GBps", bw / 1e9)
                .num("ratio_to_read_probe", bw / read_bw)
                .flag("gated", t.gated));
      if (!pipelined) {
        default_ms = t.ms;
      }
    }
    return default_ms;
  };
  for (const std::uint32_t seqs : {1u, 8u, 32u, 64u}) {
    for (const std::uint32_t q_len : {1u, 4u}) {
      const double ms = decode_row("sparse_decode", seqs, budget, q_len);
      if (q_len == 1) {
        sparse_ms.emplace_back(seqs, ms);
      }
    }
    if (seqs <= 32) {  // 32 sequences of 32k: 4 GiB of KV
      decode_row("dense_decode", seqs, context, 1);
    }
    flush_json();
  }

  // 2. Selection (scoring + top-k) over f16 and int8 bounds, against the sparse decode of the
  // same batch and budget.
  for (const std::uint32_t seqs : {1u, 32u}) {
    const std::uint32_t capacity = seqs * context;
    decode_setup dense(l, seqs, context, 1, 1, rng);  // queries and lengths only
    std::vector<std::uint32_t> ids(capacity);
    std::iota(ids.begin(), ids.end(), 0u);
    std::uint32_t* dids = device_copy(ids);
    block_ref* refs = device_alloc<block_ref>(std::size_t{seqs} * budget);
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
    r.max_blocks = context;
    r.params = {budget, 1, 1};
    const double decode_ms = std::find_if(sparse_ms.begin(), sparse_ms.end(), [&](const auto& x) {
                               return x.first == seqs;
                             })->second;
    const double kv = double(seqs) * context * static_cast<double>(l.block_bytes());
    auto row = [&](const char* summary, double bytes, const timing& t) {
      print(add("selection")
                .num("num_seqs", seqs)
                .str("summary", summary)
                .num("context", context * l.tokens_per_block)
                .num("budget_tokens", budget * l.tokens_per_block)
                .num("ms", t.ms)
                .num("sparse_decode_ms", decode_ms)
                .num("over_sparse_decode", t.ms / decode_ms)
                .num("summary_bytes", bytes)
                .num("summary_bytes_over_kv", bytes / kv)
                .flag("gated", t.gated));
    };
    {
      oc::device_minmax_summary sum(l, capacity);
      fill_random(const_cast<oasiskv::f16*>(sum.bounds()),
                  std::size_t{l.num_kv_heads} * capacity * 2 * l.head_dim * 2, 5);
      fill_value(sum.tokens(), capacity, static_cast<std::uint16_t>(l.tokens_per_block));
      sel.select(sum, r);
      const timing t = clock.run([&] { sel.select(sum, r); });
      sel.check_status();
      row("f16", double(l.num_kv_heads) * capacity * 2 * l.head_dim * 2, t);
    }
    {
      oc::device_quantized_minmax_summary sum(l, capacity);
      const std::size_t slots = std::size_t{l.num_kv_heads} * capacity;
      fill_random(const_cast<std::uint32_t*>(sum.codes()), slots * l.head_dim / 2 * 4, 7);
      fill_value(sum.scales(), slots, 1.0f / 64);
      fill_value(sum.norms(), slots, 1.0f);
      fill_value(sum.biases(), capacity, 0.0f);
      fill_value(sum.tokens(), capacity, static_cast<std::uint16_t>(l.tokens_per_block));
      sel.select(sum, r);
      const timing t = clock.run([&] { sel.select(sum, r); });
      sel.check_status();
      row("int8", double(slots) * (l.head_dim / 2 * 4 + 8) + capacity * 4.0, t);
    }
    BENCH_CHECK(cudaFree(dids));
    BENCH_CHECK(cudaFree(refs));
    BENCH_CHECK(cudaFree(offsets));
  }
  flush_json();

#if defined(OASISKV_BENCH_FLASHINFER)
  // 3. The own kernel beside FlashInfer's paged decode on the same selection.
  for (const std::uint32_t seqs : {1u, 32u}) {
    decode_setup d(l, seqs, context, budget, 1, rng);
    oasiskv::decode_params host = d.p;  // the same tables, on the host
    host.table.refs = d.host_refs.data();
    host.table.offsets = d.host_offsets.data();
    host.seq_lens = d.host_lens.data();
    oc::sparse_decode own = hot_decoder(s, budget);
    oc::flashinfer_decode_options fo;
    fo.stream = s;
    fo.asynchronous = true;
    fo.check_pointers = false;
    oc::flashinfer_decode fi(fo);
    own.decode(d.p);
    fi.prepare(host);
    const oc::flashinfer_decode::plan_info plan = fi.last_plan();
    const timing own_t = clock.run([&] { own.decode(d.p); });
    own.check_device_status();
    const timing fi_t = clock.run([&] { fi.launch_prepared(d.p); });
    // Per call with host tables (the facade's way): pageable uploads, timed on the host.
    const double own_call_ms = host_ms(s, [&] { own.decode_host_tables(host); });
    const double fi_call_ms = host_ms(s, [&] { fi.decode_host_tables(host); });
    print(add("sparse_decode_vs_flashinfer")
              .num("num_seqs", seqs)
              .num("budget_tokens", budget * l.tokens_per_block)
              .num("context", context * l.tokens_per_block)
              .num("kv_bytes", d.selected_bytes())
              .flag("flashinfer_split", plan.split)
              .num("flashinfer_tiles", plan.tiles)
              .num("own_ms", own_t.ms)
              .num("flashinfer_ms", fi_t.ms)
              .num("own_over_flashinfer", own_t.ms / fi_t.ms)
              .num("flashinfer_GBps", d.selected_bytes() / fi_t.ms / 1e6)
              .num("own_call_ms", own_call_ms)
              .num("flashinfer_call_ms", fi_call_ms)
              .num("own_over_flashinfer_call", own_call_ms / fi_call_ms)
              .flag("gated", own_t.gated && fi_t.gated));
  }
  flush_json();
#endif

  // 4. The capturable step (device_decode_step) replayed, against its decode alone, with the
  // selection over int8 bounds (the one to prefer) and over f16 bounds.
  {
    const std::uint32_t seqs = 32;
    const double decode_ms = std::find_if(sparse_ms.begin(), sparse_ms.end(), [&](const auto& x) {
                               return x.first == seqs;
                             })->second;
    // The whole context in pinned host memory, its summaries on the device.
    const std::size_t cap_slots = std::size_t{seqs} * context;
    void* cap = nullptr;
    BENCH_CHECK(cudaHostAlloc(&cap, cap_slots * l.block_bytes(), cudaHostAllocMapped));
    fill_random(cap, cap_slots * l.block_bytes(), 11);  // through UVA
    std::byte* fast = device_alloc<std::byte>(std::size_t{seqs} * budget * l.block_bytes());
    const std::size_t qn = std::size_t{seqs} * l.num_q_heads * l.head_dim;
    std::vector<float> hq(qn);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (float& x : hq) {
      x = u(rng);
    }
    float* dq = device_copy(hq);
    float* dout = device_alloc<float>(qn);
    auto run_step = [&](const auto& sum, const char* summary) {
      oc::device_decode_step_options so;
      so.max_seqs = seqs;
      so.max_blocks = context;
      so.selection = {budget, 1, 1};
      so.fast = {fast, l.block_bytes(), seqs * budget, l};
      so.capacity = {static_cast<std::byte*>(cap), l.block_bytes(),
                     static_cast<std::uint32_t>(cap_slots), l};
      oc::device_decode_step step(sum, so);
      for (std::uint32_t q = 0; q < seqs; ++q) {
        step.seq_lens()[q] = context * l.tokens_per_block;
        for (std::uint32_t i = 0; i < context; ++i) {
          step.summary_ids(q)[i] = q * context + i;
          step.capacity_slots(q)[i] = q * context + i;
        }
      }
      oc::device_decode_step_io io;
      io.q = dq;
      io.lookahead = dq;
      io.out = dout;
      io.num_seqs = seqs;
      step.capture(io, s);
      step.replay(s);  // the first replay stages every selected block
      step.check_status(s);
      // validate_staging (host, O(blocks)) runs inside the gated region: not timed.
      const timing steady = clock.run([&] { step.replay(s); });
      const timing cold = clock.run([&] {
        step.invalidate(s);
        step.replay(s);
      });
      step.check_status(s);
      const double selected = double(seqs) * budget * static_cast<double>(l.block_bytes());
      print(add("device_step")
                .str("summary", summary)
                .num("num_seqs", seqs)
                .num("context", context * l.tokens_per_block)
                .num("budget_tokens", budget * l.tokens_per_block)
                .num("decode_splits", step.config().decode_splits)
                .num("decode_ms", decode_ms)
                .num("steady_ms", steady.ms)
                .num("steady_over_decode", steady.ms / decode_ms)
                .num("cold_ms", cold.ms)
                .num("cold_over_decode", cold.ms / decode_ms)
                .num("cold_h2d_GBps", selected / (cold.ms * 1e-3) / 1e9)
                .flag("gated", steady.gated && cold.gated));
    };
    {
      oc::device_quantized_minmax_summary sum(l, static_cast<std::uint32_t>(cap_slots));
      const std::size_t slots = std::size_t{l.num_kv_heads} * cap_slots;
      fill_random(const_cast<std::uint32_t*>(sum.codes()), slots * l.head_dim / 2 * 4, 13);
      fill_value(sum.scales(), slots, 1.0f / 64);
      fill_value(sum.norms(), slots, 1.0f);
      fill_value(sum.biases(), cap_slots, 0.0f);
      fill_value(sum.tokens(), cap_slots, static_cast<std::uint16_t>(l.tokens_per_block));
      run_step(sum, "int8");
    }
    {
      oc::device_minmax_summary sum(l, static_cast<std::uint32_t>(cap_slots));
      fill_random(const_cast<oasiskv::f16*>(sum.bounds()),
                  std::size_t{l.num_kv_heads} * cap_slots * 2 * l.head_dim * 2, 13);
      fill_value(sum.tokens(), cap_slots, static_cast<std::uint16_t>(l.tokens_per_block));
      run_step(sum, "f16");
    }
    BENCH_CHECK(cudaFree(dq));
    BENCH_CHECK(cudaFree(dout));
    BENCH_CHECK(cudaFree(fast));
    BENCH_CHECK(cudaFreeHost(cap));
  }
  flush_json();

  // 5. Copy engine: 128 MiB of scattered blocks host -> device vs one pinned cudaMemcpyAsync.
  {
    const std::size_t total = std::size_t{128} << 20;
    void* hbuf = nullptr;
    BENCH_CHECK(cudaHostAlloc(&hbuf, total, cudaHostAllocDefault));
    std::byte* dbuf = device_alloc<std::byte>(total);
    std::memset(hbuf, 0x5a, total);
    const timing ref = clock.run(
        [&] { BENCH_CHECK(cudaMemcpyAsync(dbuf, hbuf, total, cudaMemcpyHostToDevice, s)); }, 2, 10,
        false);
    const double ref_bw = static_cast<double>(total) / (ref.ms * 1e-3);
    print(add("h2d_pinned_memcpy")
              .num("bytes", static_cast<double>(total))
              .num("ms", ref.ms)
              .num("GBps", ref_bw / 1e9));
    BENCH_CHECK(cudaFree(dbuf));
    BENCH_CHECK(cudaFreeHost(hbuf));
    const oasiskv::kv_layout small{1, 8, 2, 64, 16, oasiskv::dtype::f16};  // 8 KiB blocks
    for (const oasiskv::kv_layout& layout : {l, small}) {
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
      const char* names[] = {"automatic", "gather_kernel", "batch_memcpy"};
      for (const auto path :
           {oc::copy_engine::copy_path::automatic, oc::copy_engine::copy_path::gather_kernel,
            oc::copy_engine::copy_path::batch_memcpy}) {
        oc::copy_engine::options eo;
        eo.path = path;
        oc::copy_engine e(eo);
        device_clock engine_clock(e.stream(), 0);
        oc::copy_engine::ticket last{};
        bool pending = false;
        // submit is the enqueue (validation and list staging happen while the gate holds the
        // engine's stream). The previous batch is waited for first (done already in a timed run,
        // which ends with its stop event): the engine refuses a batch writing slots an
        // unfinished one writes.
        const timing t = engine_clock.run(
            [&] {
              if (pending) {
                e.wait(last);
              }
              last = e.submit(src, dst, copies);
              pending = true;
            },
            2, 10, false);
        e.wait(last);
        const double bw = static_cast<double>(n) * layout.block_bytes() / (t.ms * 1e-3);
        print(add("copy_engine")
                  .str("path", names[static_cast<int>(path)])
                  .num("block_bytes", static_cast<double>(layout.block_bytes()))
                  .num("blocks", n)
                  .num("ms", t.ms)
                  .num("GBps", bw / 1e9)
                  .num("ratio_to_pinned_memcpy", bw / ref_bw)
                  .flag("gated", t.gated));
      }
    }
  }
  flush_json();

  // 6. The facade's step, lookahead prefetch overlapped, against the same step all-resident.
  for (const std::uint32_t seqs : {1u, 8u}) {
    const std::uint32_t tokens = 32768, layers = 4, budget_tokens = 2048;
    const std::uint32_t blocks = tokens / 16 + 1;
    // Fast memory for twice each (sequence, layer)'s budget, against the whole context.
    const step_figures tiered = facade_steps<lookahead_scheduler>(
        seqs * layers * 2 * (budget_tokens / 16 + 8), seqs, tokens, layers, budget_tokens, 5, 20);
    const step_figures resident = facade_steps<oasiskv::all_resident>(
        seqs * layers * (blocks + 8), seqs, tokens, layers, budget_tokens, 5, 20);
    ob::row& r = add("facade_step")
                     .num("num_seqs", seqs)
                     .num("layers", layers)
                     .num("context", tokens)
                     .num("budget_tokens", budget_tokens);
    auto fields = [&](const std::string& who, const step_figures& f) {
      r.num(who + "_ms", f.ms)
          .num(who + "_predict_ms", f.predict_ms)
          .num(who + "_hit_rate", f.hit_rate)
          .num(who + "_misses_per_step", f.misses)
          .num(who + "_prefetched_MiB_per_step", f.prefetched_mib)
          .num(who + "_stall_ms", f.stall_ms);
    };
    fields("tiered", tiered);
    fields("resident", resident);
    r.num("ratio", tiered.ms / resident.ms);
    print(r);
    flush_json();
  }

  const std::vector<ob::target> targets = ob::evaluate(rows, ob::cuda_bench_rules());
  for (const ob::target& t : targets) {
    std::printf("target %s: %s (%s %g)\n", t.name.c_str(),
                t.measured ? (t.pass() ? "pass" : "FAIL") : "not measured",
                t.at_least ? ">=" : "<=", t.bound);
  }
  flush_json();
  BENCH_CHECK(cudaStreamDestroy(s));
  return 0;
}
