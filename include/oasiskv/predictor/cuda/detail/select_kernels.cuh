// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Kernels of `cuda::topk_selector`: min/max summary scoring, the softmax-mass
//! aggregation and a CTA-per-table radix top-k that writes the block table (with staging slots)
//! on the device.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <type_traits>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/ids.hpp"
#include "oasiskv/core/kept_window.hpp"
#include "oasiskv/core/layout.hpp"
#include "oasiskv/core/selection.hpp"
#include "oasiskv/cuda/detail/kv_vec.cuh"
#include "oasiskv/summary/cuda/detail/qminmax_math.cuh"

namespace oasiskv::cuda::detail {

inline constexpr std::uint32_t select_status_too_long = 1u;  //!< a sequence exceeds max_blocks
//! A draft weight is negative or not finite (treated as 0; the first is in `bad_weight`).
inline constexpr std::uint32_t select_status_bad_weight = 2u;
//! `bad_weight` when no weight was bad (above every key `bad_weight_key` makes).
inline constexpr unsigned long long no_bad_weight = ~0ull;

//! Whether a draft weight is usable: finite and >= 0 (the host's `check_queries` rule).
OASISKV_HOST_DEVICE bool weight_ok(float w) {
  return w >= 0.0f && w <= FLT_MAX;
}

//! The weight of query row `row` (lookahead token `row / group`) of sequence `seq` in
//! `weights[num_seqs][num_tokens]`: 1 when `weights` is null (the host's
//! `confidence_weighted_aggregation` with `query_view::weights == nullptr`), 0 for a negative or
//! non-finite weight (which the host refuses before scoring; the device reports it instead).
OASISKV_HOST_DEVICE float row_weight(const float* weights, std::uint32_t num_tokens,
                                     std::uint32_t seq, std::uint32_t row, std::uint32_t group) {
  if (weights == nullptr) {
    return 1.0f;
  }
  const float w = weights[std::size_t{seq} * num_tokens + row / group];
  return weight_ok(w) && w > 0.0f ? w : 0.0f;
}

//! A score clamped to finite values, as the host's `cpu::detail::clamp_finite_max` does before the
//! softmax (NaN as `+inf`: it takes the row's mass).
OASISKV_HOST_DEVICE float mass_clamp(float v) {
  return v <= FLT_MAX ? (v >= -FLT_MAX ? v : -FLT_MAX) : FLT_MAX;
}

//! The factor of a row's exponentials in the accumulated mass: its weight over their sum, as the
//! host's `add_scaled(acc, e, weight / sum)`. With weight 1 it is `1 / sum`, the bits of the
//! unweighted mass.
OASISKV_HOST_DEVICE float row_mass_factor(float weight, float sum) {
  return weight / sum;
}

//! The order of a bad weight's report: the lowest (sequence, token) wins, its value in the low
//! 32 bits. `seq < 2^16` and `token < 16` (`topk_request`'s bounds).
OASISKV_HOST_DEVICE unsigned long long bad_weight_key(std::uint32_t seq, std::uint32_t token,
                                                      float w) {
  std::uint32_t bits = 0;
  memcpy(&bits, &w, sizeof(bits));
  return (static_cast<unsigned long long>(seq) << 36) |
         (static_cast<unsigned long long>(token & 15u) << 32) | bits;
}

//! A decoded `bad_weight_key`.
struct bad_weight_report {
  std::uint32_t seq = 0;    //!< the sequence (row of `topk_request::weights`)
  std::uint32_t token = 0;  //!< the lookahead token
  float value = 0.0f;       //!< the weight, bit for bit
};
//! Decodes `bad_weight_key(seq, token, value)`.
OASISKV_HOST_DEVICE bad_weight_report decode_bad_weight(unsigned long long key) {
  bad_weight_report r;
  r.seq = static_cast<std::uint32_t>(key >> 36);
  r.token = static_cast<std::uint32_t>(key >> 32) & 15u;
  const auto bits = static_cast<std::uint32_t>(key);
  memcpy(&r.value, &bits, sizeof(bits));
  return r;
}

//! @brief Everything one selection step reads and writes; device pointers, passed by value.
struct select_kernel_args {
  kv_layout layout{};
  const f16* bounds = nullptr;            // [num_kv_heads][capacity][2][head_dim]: max, then min
  const std::uint16_t* tokens = nullptr;  // [capacity] tokens folded into each entry
  std::uint32_t capacity = 0;
  const float* queries = nullptr;  // [num_seqs][num_tokens][num_q_heads][head_dim]
  std::uint32_t num_tokens = 1;
  const std::uint32_t* seq_lens = nullptr;     // [num_seqs]
  const std::uint32_t* summary_ids = nullptr;  // [num_seqs][max_blocks]
  const slot_id* staged = nullptr;             // [num_seqs][max_blocks] fast slot or null_slot
  block_ref* refs = nullptr;                   // [num_seqs * tables_per_seq * budget]
  std::uint32_t* offsets = nullptr;            // [num_seqs * tables_per_seq + 1]
  std::uint32_t* misses = nullptr;             // [num_seqs * tables_per_seq][budget] block indices
  std::uint32_t* miss_counts = nullptr;        // [num_seqs * tables_per_seq]
  float* scores = nullptr;                     // workspace [num_seqs][num_kv_heads][max_blocks]
  std::uint32_t* keys = nullptr;               // workspace [num_seqs * tables_per_seq][max_blocks]
  std::uint32_t* status = nullptr;
  unsigned long long* bad_weight = nullptr;  // the lowest `bad_weight_key` seen, or no_bad_weight
  const float* weights = nullptr;            // [num_seqs][num_tokens] draft weights, or null
  std::uint32_t num_seqs = 0;
  std::uint32_t max_blocks = 0;
  std::uint32_t tables_per_seq = 1;
  selection_params sp{};
  bool softmax_mass = false;  // aggregate by softmax mass (else by max)
  bool weighted = false;      // softmax_mass: each row's mass times its token's weight
  float scale = 1.0f;         // softmax_mass: the logit scale, 1/sqrt(head_dim)
  float* raw = nullptr;       // softmax_mass workspace [num_seqs][num_kv_heads][rows][max_blocks]
  // A cuda::device_quantized_minmax_summary instead of `bounds` (score_qminmax_kernel):
  const std::uint32_t* qcodes = nullptr;  // [num_kv_heads][capacity][head_dim / 2] code words
  const float* qscale = nullptr;          // [num_kv_heads][capacity] 2^e
  const float* qnorm = nullptr;           // [num_kv_heads][capacity] ||A||_2 rounded up
  const float* qbias = nullptr;           // [capacity] 0, -inf empty, +inf overflowed
};
static_assert(std::is_trivially_copyable_v<select_kernel_args>);

inline constexpr int score_threads = 128;
inline constexpr int score_entries_per_cta = 64;
inline constexpr int score_row_chunk = 16;

OASISKV_DEVICE std::uint32_t seq_blocks(const select_kernel_args& a, std::uint32_t seq) {
  const std::uint32_t n = a.layout.blocks_for(a.seq_lens[seq]);
  return n < a.max_blocks ? n : a.max_blocks;
}

//! Scores entries [blockIdx.x * 64, +64) of one (sequence, KV head): for every query row of the
//! head's GQA group and every lookahead token, q+ . max + q- . min (the split query staged in
//! shared memory as minmax_summary::score does on the CPU), maxed over the rows; for the
//! softmax mass, every row's score is written to `raw` instead (`-inf` for an empty entry).
template <int D>
__global__ void __launch_bounds__(score_threads) score_minmax_kernel(const select_kernel_args a) {
  constexpr int lanes = 2 * D / 8;  // lanes per entry: 8 f16 bounds (16 bytes) each
  constexpr int per_warp = 32 / lanes;
  static_assert(lanes <= 32 && 32 % lanes == 0);
  __shared__ float sq[score_row_chunk][2 * D];
  __shared__ float best[score_entries_per_cta];

  const std::uint32_t seq = blockIdx.z;
  const std::uint32_t h = blockIdx.y;
  const std::uint32_t i0 = blockIdx.x * score_entries_per_cta;
  const std::uint32_t n = seq_blocks(a, seq);
  if (threadIdx.x == 0 && a.layout.blocks_for(a.seq_lens[seq]) > a.max_blocks) {
    atomicOr(a.status, select_status_too_long);
  }
  if (i0 >= n) {
    return;  // a fixed grid sized for max_blocks: this CTA has nothing of this sequence
  }
  const std::uint32_t group = a.layout.group_size();
  const std::uint32_t rows = a.num_tokens * group;
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int sub = lane / lanes;
  const int lin = lane % lanes;
  for (int e = static_cast<int>(threadIdx.x); e < score_entries_per_cta; e += score_threads) {
    best[e] = -INFINITY;
  }
  for (std::uint32_t r0 = 0; r0 < rows; r0 += score_row_chunk) {
    __syncthreads();  // the previous chunk's rows are no longer read
    const std::uint32_t nr = rows - r0 < score_row_chunk ? rows - r0 : score_row_chunk;
    for (std::uint32_t x = threadIdx.x; x < nr * D; x += score_threads) {
      const std::uint32_t r = x / D, d = x % D;
      const std::uint32_t row = r0 + r;  // row = token * group + member
      const float v =
          a.queries[((std::size_t{seq} * a.num_tokens + row / group) * a.layout.num_q_heads +
                     h * group + row % group) *
                        D +
                    d];
      sq[r][d] = v > 0.0f ? v : 0.0f;
      sq[r][D + d] = v < 0.0f ? v : 0.0f;
    }
    __syncthreads();
    for (int e = warp * per_warp + sub; e < score_entries_per_cta;
         e += (score_threads / 32) * per_warp) {
      const std::uint32_t i = i0 + static_cast<std::uint32_t>(e);
      const bool live = i < n;
      float b[8];
      if (live) {
        const std::uint32_t id = a.summary_ids[std::size_t{seq} * a.max_blocks + i];
        const f16* entry = a.bounds + (std::size_t{h} * a.capacity + id) * (2 * D) + lin * 8;
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(entry));
        kv_vec<f16>::widen(raw, b);
      } else {
#pragma unroll
        for (int x = 0; x < 8; ++x) {
          b[x] = 0.0f;
        }
      }
      float m = -INFINITY;
      for (std::uint32_t r = 0; r < nr; ++r) {
        const float* qr = sq[r] + lin * 8;
        float d = 0.0f;
#pragma unroll
        for (int x = 0; x < 8; ++x) {
          d = fmaf(qr[x], b[x], d);
        }
#pragma unroll
        for (int off = lanes / 2; off > 0; off >>= 1) {
          d += __shfl_xor_sync(0xffffffffu, d, off);
        }
        d = d != d ? INFINITY : d;  // 0 * inf of an overflowed bound: keep the block (as the CPU)
        m = fmaxf(m, d);
        if (a.softmax_mass && live && lin == 0) {
          const std::uint32_t id = a.summary_ids[std::size_t{seq} * a.max_blocks + i];
          a.raw[((std::size_t{seq} * a.layout.num_kv_heads + h) * rows + r0 + r) * a.max_blocks +
                i] = a.tokens[id] == 0 ? -INFINITY : d;
        }
      }
      if (live && lin == 0) {
        best[e] = fmaxf(best[e], m);
      }
    }
  }
  __syncthreads();
  if (a.softmax_mass) {
    return;  // softmax_mass_kernel folds the rows
  }
  for (int e = static_cast<int>(threadIdx.x); e < score_entries_per_cta; e += score_threads) {
    const std::uint32_t i = i0 + static_cast<std::uint32_t>(e);
    if (i < n) {
      const std::uint32_t id = a.summary_ids[std::size_t{seq} * a.max_blocks + i];
      const float s = a.tokens[id] == 0 ? -INFINITY : best[e];
      a.scores[(std::size_t{seq} * a.layout.num_kv_heads + h) * a.max_blocks + i] = s;
    }
  }
}

//! `score_minmax_kernel` for a `device_quantized_minmax_summary`: each query row quantized once
//! per CTA into shared memory (`qminmax_quantize_query`, a thread per row, the host's order), then
//! per entry the integer dot product of the u8 query codes with the int8 code words (`dp4a`, one
//! 16-byte load of four words per lane) and the host's epilogue `dot (s t) + ||A|| slack + bias`
//! (`qminmax_score`): the host summary's `score` up to f32 rounding. Maxed over the rows, or
//! every row written to `raw` for the softmax mass (`-inf` for an empty entry).
template <int D>
__global__ void __launch_bounds__(score_threads) score_qminmax_kernel(const select_kernel_args a) {
  constexpr int words = D / 2;  // code words per (entry, KV head)
  constexpr int lanes = D / 8;  // lanes per entry: 4 words (16 bytes) each
  constexpr int per_warp = 32 / lanes;
  static_assert(lanes <= 32 && 32 % lanes == 0);
  __shared__ std::uint32_t sq[score_row_chunk][words];
  __shared__ float st[score_row_chunk], sslack[score_row_chunk];
  __shared__ float best[score_entries_per_cta];

  const std::uint32_t seq = blockIdx.z;
  const std::uint32_t h = blockIdx.y;
  const std::uint32_t i0 = blockIdx.x * score_entries_per_cta;
  const std::uint32_t n = seq_blocks(a, seq);
  if (threadIdx.x == 0 && a.layout.blocks_for(a.seq_lens[seq]) > a.max_blocks) {
    atomicOr(a.status, select_status_too_long);
  }
  if (i0 >= n) {
    return;  // a fixed grid sized for max_blocks: this CTA has nothing of this sequence
  }
  const std::uint32_t group = a.layout.group_size();
  const std::uint32_t rows = a.num_tokens * group;
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int sub = lane / lanes;
  const int lin = lane % lanes;
  for (int e = static_cast<int>(threadIdx.x); e < score_entries_per_cta; e += score_threads) {
    best[e] = -INFINITY;
  }
  for (std::uint32_t r0 = 0; r0 < rows; r0 += score_row_chunk) {
    __syncthreads();  // the previous chunk's rows are no longer read
    const std::uint32_t nr = rows - r0 < score_row_chunk ? rows - r0 : score_row_chunk;
    if (threadIdx.x < nr) {
      const std::uint32_t row = r0 + threadIdx.x;  // row = token * group + member
      const float* q =
          a.queries + ((std::size_t{seq} * a.num_tokens + row / group) * a.layout.num_q_heads +
                       h * group + row % group) *
                          D;
      qminmax_quantize_query(q, D, sq[threadIdx.x], st[threadIdx.x], sslack[threadIdx.x]);
    }
    __syncthreads();
    for (int e = warp * per_warp + sub; e < score_entries_per_cta;
         e += (score_threads / 32) * per_warp) {
      const std::uint32_t i = i0 + static_cast<std::uint32_t>(e);
      const bool live = i < n;
      uint4 c = make_uint4(0u, 0u, 0u, 0u);
      float scale = 0.0f, norm = 0.0f, bias = 0.0f;
      std::uint32_t id = 0;
      if (live) {
        id = a.summary_ids[std::size_t{seq} * a.max_blocks + i];
        const std::size_t slot = std::size_t{h} * a.capacity + id;
        c = __ldg(reinterpret_cast<const uint4*>(a.qcodes + slot * words) + lin);
        scale = a.qscale[slot];
        norm = a.qnorm[slot];
        bias = a.qbias[id];
      }
      float m = -INFINITY;
      for (std::uint32_t r = 0; r < nr; ++r) {
        const std::uint32_t* qr = sq[r] + lin * 4;
        std::int32_t d = qminmax_dot4(qr[0], c.x, 0);
        d = qminmax_dot4(qr[1], c.y, d);
        d = qminmax_dot4(qr[2], c.z, d);
        d = qminmax_dot4(qr[3], c.w, d);
#pragma unroll
        for (int off = lanes / 2; off > 0; off >>= 1) {
          d += __shfl_xor_sync(0xffffffffu, d, off);
        }
        float v = qminmax_score(d, scale, st[r], norm, sslack[r], bias);
        v = v != v ? INFINITY : v;  // an overflowed entry's 0 * inf: keep the block (as the CPU)
        m = fmaxf(m, v);
        if (a.softmax_mass && live && lin == 0) {
          a.raw[((std::size_t{seq} * a.layout.num_kv_heads + h) * rows + r0 + r) * a.max_blocks +
                i] = a.tokens[id] == 0 ? -INFINITY : v;
        }
      }
      if (live && lin == 0) {
        best[e] = fmaxf(best[e], m);
      }
    }
  }
  __syncthreads();
  if (a.softmax_mass) {
    return;  // softmax_mass_kernel folds the rows
  }
  for (int e = static_cast<int>(threadIdx.x); e < score_entries_per_cta; e += score_threads) {
    const std::uint32_t i = i0 + static_cast<std::uint32_t>(e);
    if (i < n) {
      const std::uint32_t id = a.summary_ids[std::size_t{seq} * a.max_blocks + i];
      const float s = a.tokens[id] == 0 ? -INFINITY : best[e];
      a.scores[(std::size_t{seq} * a.layout.num_kv_heads + h) * a.max_blocks + i] = s;
    }
  }
}

inline constexpr int mass_threads = 256;

struct max_op {
  OASISKV_DEVICE float operator()(float x, float y) const { return x > y ? x : y; }
};

//! One CTA per (KV head, sequence): for each query row of the head (lookahead tokens x GQA
//! members), the softmax over the sequence's blocks of `scale * score`, the scores clamped to
//! finite values first (`cpu::detail::clamp_finite_max`: an empty entry's `-inf` gets no mass
//! unless every entry is empty, `+inf` takes the row's mass), summed over the rows into `scores`:
//! with equal weights (the host's `softmax_mass_aggregation`, `add_scaled(acc, e, 1 / sum)`) or,
//! when `weighted`, each row's mass times its lookahead token's weight (`confidence_weighted_
//! aggregation`, `add_scaled(acc, e, w / sum)`; `row_weight`). A row of weight 0 adds nothing
//! and is skipped. A thread owns the same blocks in every pass, so only the reductions
//! synchronise.
// A template: a plain __global__ function in a header is defined again by every translation unit
// that includes it, and a program of two such units fails to link (test_cuda_two_units).
template <class = void>
__global__ void __launch_bounds__(mass_threads) softmax_mass_kernel(const select_kernel_args a) {
  using reduce = cub::BlockReduce<float, mass_threads>;
  __shared__ typename reduce::TempStorage storage;
  __shared__ float shared_value;
  const std::uint32_t h = blockIdx.x;
  const std::uint32_t seq = blockIdx.y;
  const std::uint32_t kv = a.layout.num_kv_heads;
  const std::uint32_t n = seq_blocks(a, seq);
  const std::uint32_t rows = a.num_tokens * a.layout.group_size();
  float* acc = a.scores + (std::size_t{seq} * kv + h) * a.max_blocks;
  for (std::uint32_t i = threadIdx.x; i < n; i += mass_threads) {
    acc[i] = 0.0f;
  }
  const std::uint32_t group = a.layout.group_size();
  for (std::uint32_t r = 0; r < rows; ++r) {
    // The same for every thread of the CTA, so skipping the row keeps the barriers uniform.
    const float w = a.weighted ? row_weight(a.weights, a.num_tokens, seq, r, group) : 1.0f;
    if (w == 0.0f) {
      continue;  // adds w * e = +0 to every block's mass: nothing
    }
    float* x = a.raw + ((std::size_t{seq} * kv + h) * rows + r) * a.max_blocks;
    float m = -FLT_MAX;
    for (std::uint32_t i = threadIdx.x; i < n; i += mass_threads) {
      const float v = mass_clamp(x[i]);
      x[i] = v;
      m = v > m ? v : m;
    }
    m = reduce(storage).Reduce(m, max_op{});
    if (threadIdx.x == 0) {
      shared_value = m;
    }
    __syncthreads();
    m = shared_value;
    float sum = 0.0f;
    for (std::uint32_t i = threadIdx.x; i < n; i += mass_threads) {
      const float e = expf(a.scale * (x[i] - m));
      x[i] = e;
      sum += e;
    }
    __syncthreads();  // everyone has read shared_value; the storage is free again
    sum = reduce(storage).Sum(sum);
    if (threadIdx.x == 0) {
      shared_value = sum;
    }
    __syncthreads();
    // shared_value >= 1: the row's maximum contributes exp(0).
    const float k = row_mass_factor(w, shared_value);
    for (std::uint32_t i = threadIdx.x; i < n; i += mass_threads) {
      acc[i] += k * x[i];
    }
    __syncthreads();  // shared_value and the storage are rewritten by the next row
  }
}

//! Orders floats as unsigned integers (NaN as +inf: the CPU selector's rule).
OASISKV_DEVICE std::uint32_t order_key(float f) {
  if (f != f) {
    f = INFINITY;
  }
  const std::uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

inline constexpr int topk_threads = 256;

//! @brief What one table of the top-k holds: `count = min(blocks, budget)` entries, the sinks
//! `[0, sinks)` and the recent window `[end, blocks)` always, and the `take` best of the
//! candidates `[sinks, end)`. `take` is 0 when the budget is exactly the kept window
//! (`budget == sinks + recent`, which validation allows): then no candidate is kept, and none is
//! even scored.
struct topk_table {
  std::uint32_t count = 0;  //!< entries of the table
  std::uint32_t sinks = 0;  //!< candidates start here
  std::uint32_t end = 0;    //!< candidates end here: the recent window's first block
  std::uint32_t take = 0;   //!< candidates kept (0 when `take_all`)
  bool take_all = false;    //!< the budget covers every block
};

//! @brief The table of a sequence of `blocks` blocks (the kernel's rule, on host and device).
//! `budget` is at least the kept window (`min_budget_blocks`, checked on the host).
OASISKV_HOST_DEVICE constexpr topk_table plan_topk_table(std::uint32_t blocks, std::uint32_t budget,
                                                         std::uint32_t sink_blocks,
                                                         std::uint32_t recent_blocks) {
  const block_window w = kept_window(blocks, sink_blocks, recent_blocks);
  topk_table t;
  t.take_all = budget >= blocks;
  t.count = t.take_all ? blocks : budget;
  t.sinks = w.sinks;
  t.end = w.recent_from;
  t.take = t.take_all || budget <= w.kept() ? 0u : budget - w.kept();
  return t;
}

//! @brief One pass of the radix select: the bucket where the count of `hist[bucket..top]` (the
//! `runs` buckets from `top` down) reaches `remaining`, and the count above it, starting from
//! `above` already counted above `top`. `found` is false when the run ends first.
struct radix_pick {
  std::uint32_t bucket = 0;
  std::uint32_t above = 0;
  bool found = false;
};
OASISKV_HOST_DEVICE radix_pick pick_radix_bucket(const std::uint32_t* hist, std::uint32_t top,
                                                 std::uint32_t runs, std::uint32_t above,
                                                 std::uint32_t remaining) {
  radix_pick p;
  for (std::uint32_t j = 0; j < runs; ++j) {
    const std::uint32_t b = top - j;
    if (above + hist[b] >= remaining) {
      p.bucket = b;
      p.above = above;
      p.found = true;
      return p;
    }
    above += hist[b];
  }
  p.above = above;
  return p;
}

//! @brief Whether block `i` (order key `key`) enters table `t`, in index order: the kept window
//! always; a candidate above the threshold; a candidate equal to it while its `rank` among the
//! equal ones (counted up by the call) is below `take_equal` (ties to the lower index); no
//! candidate when `t.take == 0`.
OASISKV_HOST_DEVICE bool topk_keeps(const topk_table& t, std::uint32_t i, std::uint32_t key,
                                    std::uint32_t threshold, std::uint32_t take_equal,
                                    std::uint32_t& rank) {
  if (t.take_all || i < t.sinks || i >= t.end) {
    return true;
  }
  if (t.take == 0) {
    return false;
  }
  if (key == threshold) {
    return rank++ < take_equal;
  }
  return key > threshold;
}

//! One CTA per table: the sinks, the recent window and the top `budget - sinks - recent`
//! candidates by score (ties to the lower index), found by an 8-bit radix select over
//! shared-memory histograms, then compacted in index order with block scans and translated to
//! staging slots. The table's offset follows from the lengths alone (every table holds
//! min(blocks, budget) entries), so tables are packed with no grid-wide step.
template <class = void>  // a template: see softmax_mass_kernel
__global__ void __launch_bounds__(topk_threads) topk_select_kernel(const select_kernel_args a) {
  using scan = cub::BlockScan<std::uint32_t, topk_threads>;
  __shared__ typename scan::TempStorage scan_storage;
  __shared__ std::uint32_t hist[256];
  __shared__ std::uint32_t pick_bucket, pick_above;

  const std::uint32_t t = blockIdx.x;
  const std::uint32_t seq = t / a.tables_per_seq;
  const std::uint32_t head = t % a.tables_per_seq;
  const std::uint32_t budget = a.sp.budget_blocks;
  const std::uint32_t n = seq_blocks(a, seq);
  const std::uint32_t count = n < budget ? n : budget;
  if (head == 0 && a.weights != nullptr && threadIdx.x < a.num_tokens) {
    // The sequence's weights are checked once (by its first table) whatever the aggregation,
    // as the host's check_queries does; a bad one is reported, and weighs 0 in the mass.
    const float w = a.weights[std::size_t{seq} * a.num_tokens + threadIdx.x];
    if (!weight_ok(w)) {
      atomicOr(a.status, select_status_bad_weight);
      atomicMin(a.bad_weight, bad_weight_key(seq, threadIdx.x, w));
    }
  }
  std::uint32_t offset = 0;
  for (std::uint32_t s = threadIdx.x; s < seq; s += topk_threads) {
    const std::uint32_t ns = seq_blocks(a, s);
    offset += (ns < budget ? ns : budget) * a.tables_per_seq;
  }
  {
    std::uint32_t ignored = 0, before_seq = 0;
    scan(scan_storage).ExclusiveSum(offset, ignored, before_seq);
    __syncthreads();
    offset = before_seq + head * count;
  }
  if (threadIdx.x == 0) {
    a.offsets[t] = offset;
    if (t + 1 == gridDim.x) {
      a.offsets[t + 1] = offset + count;
    }
  }

  const topk_table plan =
      plan_topk_table(n, budget, a.sp.sink_blocks, a.sp.recent_blocks);  // plan.count == count
  const std::uint32_t sinks = plan.sinks, end = plan.end;                // candidates: [sinks, end)
  // Scored and ranked only when some candidate is taken: with budget == sinks + recent the
  // table is the kept window alone.
  const bool rank_candidates = plan.take > 0;
  std::uint32_t* keys = a.keys + std::size_t{t} * a.max_blocks;
  std::uint32_t threshold = 0, take_equal = 0;
  if (rank_candidates) {  // uniform over the CTA: its barriers are reached by every thread
    const std::uint32_t kv = a.layout.num_kv_heads;
    for (std::uint32_t i = sinks + threadIdx.x; i < end; i += topk_threads) {
      float s;
      if (a.tables_per_seq == 1 && a.softmax_mass) {
        s = 0.0f;  // masses add over KV heads, in head order
        for (std::uint32_t h = 0; h < kv; ++h) {
          s += a.scores[(std::size_t{seq} * kv + h) * a.max_blocks + i];
        }
      } else if (a.tables_per_seq == 1) {
        s = -INFINITY;
        for (std::uint32_t h = 0; h < kv; ++h) {
          const float v = a.scores[(std::size_t{seq} * kv + h) * a.max_blocks + i];
          s = v > s || v != v ? v : s;  // NaN wins, as +inf
        }
      } else {
        s = a.scores[(std::size_t{seq} * kv + head) * a.max_blocks + i];
      }
      keys[i] = order_key(s);
    }
    __syncthreads();  // the keys are read by other threads below, whatever the passes do
    std::uint32_t remaining = plan.take;  // >= 1, and at most the candidates
    std::uint32_t prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (std::uint32_t b = threadIdx.x; b < 256; b += topk_threads) {
        hist[b] = 0;
      }
      __syncthreads();
      for (std::uint32_t i = sinks + threadIdx.x; i < end; i += topk_threads) {
        const std::uint32_t k = keys[i];
        if ((k & mask) == prefix) {
          atomicAdd(&hist[(k >> shift) & 255u], 1u);
        }
      }
      __syncthreads();
      if (threadIdx.x < 32) {
        // Lane l sums buckets 255-8l down to 248-8l; an inclusive scan over lanes finds the
        // run where the count from the top reaches `remaining`, which pick_radix_bucket walks.
        const unsigned lane = threadIdx.x;
        std::uint32_t local = 0;
        for (int j = 0; j < 8; ++j) {
          local += hist[255 - 8 * lane - j];
        }
        std::uint32_t incl = local;
        for (int off = 1; off < 32; off <<= 1) {
          const std::uint32_t o = __shfl_up_sync(0xffffffffu, incl, off);
          incl += lane >= static_cast<unsigned>(off) ? o : 0u;
        }
        const unsigned hit = __ballot_sync(0xffffffffu, incl >= remaining);
        const unsigned first = static_cast<unsigned>(__ffs(static_cast<int>(hit)) - 1);
        if (lane == first) {
          const radix_pick pk = pick_radix_bucket(hist, 255 - 8 * lane, 8, incl - local, remaining);
          pick_bucket = pk.bucket;
          pick_above = pk.above;
        }
      }
      __syncthreads();
      remaining -= pick_above;  // stays >= 1: the bucket holds the rest
      prefix |= pick_bucket << shift;
      mask |= 255u << shift;
      __syncthreads();  // pick_* are rewritten next pass
    }
    threshold = prefix;
    take_equal = remaining;
  }

  // Keep-flags in index order: a chunk of consecutive blocks per thread, so two block scans give
  // each equal-to-threshold candidate its rank and each kept block its position.
  const std::uint32_t chunk = (n + topk_threads - 1) / topk_threads;
  const std::uint32_t c0 = threadIdx.x * chunk < n ? threadIdx.x * chunk : n;
  const std::uint32_t c1 = c0 + chunk < n ? c0 + chunk : n;
  std::uint32_t equal = 0;
  if (rank_candidates) {
    for (std::uint32_t i = c0; i < c1; ++i) {
      equal += (i >= sinks && i < end && keys[i] == threshold) ? 1u : 0u;
    }
  }
  std::uint32_t equal_before = 0;
  scan(scan_storage).ExclusiveSum(equal, equal_before);
  __syncthreads();
  auto kept = [&](std::uint32_t i, std::uint32_t& rank) {
    const bool candidate = rank_candidates && i >= sinks && i < end;
    return topk_keeps(plan, i, candidate ? keys[i] : 0u, threshold, take_equal, rank);
  };
  std::uint32_t keep = 0;
  {
    std::uint32_t rank = equal_before;
    for (std::uint32_t i = c0; i < c1; ++i) {
      keep += kept(i, rank) ? 1u : 0u;
    }
  }
  std::uint32_t pos = 0;
  scan(scan_storage).ExclusiveSum(keep, pos);
  std::uint32_t rank = equal_before;
  const std::size_t row = std::size_t{seq} * a.max_blocks;
  for (std::uint32_t i = c0; i < c1; ++i) {
    if (!kept(i, rank)) {
      continue;
    }
    const slot_id fast = a.staged[row + i];
    a.refs[offset + pos] = block_ref{fast, i};
    ++pos;
    if (fast == null_slot && a.misses != nullptr) {
      const std::uint32_t m = atomicAdd(&a.miss_counts[t], 1u);
      a.misses[std::size_t{t} * budget + m] = i;
    }
  }
}

//! Zeroes the miss counters (a kernel, so the whole step stays one capturable sequence).
template <class = void>  // a template: see softmax_mass_kernel
__global__ void clear_counts_kernel(std::uint32_t* counts, std::uint32_t n) {
  for (std::uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += gridDim.x * blockDim.x) {
    counts[i] = 0;
  }
}

}  // namespace oasiskv::cuda::detail
