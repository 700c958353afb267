// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Kernels of `cuda::sparse_decode`: split-K flash-decoding over a block table, and the
//! log-sum-exp merge of the splits.
#pragma once

#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "oasiskv/attention/validate.hpp"
#include "oasiskv/core/decode_params.hpp"
#include "oasiskv/cuda/detail/kv_vec.cuh"

namespace oasiskv::cuda::detail {

//! Bits of the device status word: table entries the kernel skipped.
inline constexpr std::uint32_t status_bad_slot = 1u;   //!< slot outside the pool
inline constexpr std::uint32_t status_bad_index = 2u;  //!< block past the sequence's end
inline constexpr std::uint32_t status_short_seq = 4u;  //!< seq_lens[s] < q_len

//! Blocks a split of `decode_split_kernel` takes at least, when the table size is known: two
//! passes of a CTA's lane groups over 16-token blocks (fewer would not repay loading the queries
//! and the merge).
inline constexpr std::uint32_t min_blocks_per_split = 4;

//! @brief The splits of each table (host code: the grid is fixed before launch). `fixed` (the
//! option `num_splits`) wins when nonzero. Otherwise about four CTAs per multiprocessor in flight
//! (`ctas`: sequences x KV heads x row chunks), enough loads outstanding to approach the memory
//! bandwidth, but no split under `min_blocks_per_split` blocks of the expected table size
//! (`expected_blocks`, 0: unknown); at most `max_splits`, at least 1.
inline std::uint32_t choose_decode_splits(std::uint32_t sms, std::uint64_t ctas,
                                          std::uint32_t expected_blocks, std::uint32_t fixed,
                                          std::uint32_t max_splits) {
  std::uint64_t splits = fixed;
  if (splits == 0) {
    const std::uint64_t target = 4ull * (sms == 0 ? 1 : sms);
    const std::uint64_t c = ctas == 0 ? 1 : ctas;
    splits = (target + c - 1) / c;
    if (expected_blocks != 0) {
      const std::uint64_t most = expected_blocks / min_blocks_per_split;
      splits = splits < most ? splits : (most == 0 ? 1 : most);
    }
  }
  const std::uint64_t cap = max_splits == 0 ? 1 : max_splits;
  return static_cast<std::uint32_t>(splits < 1 ? 1 : (splits > cap ? cap : splits));
}

//! @brief One launch of the split kernel; trivially copyable, passed by value.
struct decode_kernel_args {
  decode_params p{};          // device pointers
  float* part_out = nullptr;  // [num_seqs * q_len * num_q_heads][splits][head_dim] if splits > 1
  float* part_lse = nullptr;  // [num_seqs * q_len * num_q_heads][splits]
  std::uint32_t* status = nullptr;  // device word, OR of status_* bits
  std::uint32_t splits = 1;
  std::uint32_t rows = 1;        // query rows per (sequence, KV head): q_len * group_size
  std::uint32_t row_chunks = 1;  // CTAs along the rows: ceil(rows / Rows)
  float qscale = 1.0f;           // scale * log2(e): scores live in the exp2 domain
};
static_assert(std::is_trivially_copyable_v<decode_kernel_args>);

//! @brief How a CTA maps onto one (sequence, KV head, row chunk, split): 4 warps; a *lane group*
//! of `lanes` lanes reads one K or V row with one 16-byte load per lane, so a warp streams
//! `groups_per_warp` rows at once; each lane group keeps its own online-softmax state for all
//! `Rows` query rows and takes `unroll` consecutive tokens per step (loads in flight).
template <class T, int D, int Rows>
struct decode_shape {
  static constexpr int vec = kv_vec<T>::n;
  static constexpr int lanes = D / vec;
  static constexpr int groups_per_warp = 32 / lanes;
  static constexpr int warps = 4;
  static constexpr int threads = 32 * warps;
  static constexpr int groups = warps * groups_per_warp;
  static constexpr int unroll = Rows <= 4 ? 4 : 2;
  static_assert(D % vec == 0 && lanes <= 32 && 32 % lanes == 0);
};

//! @brief The end of a split: the CTA's lane groups merge their online-softmax states (`m`, `l`,
//! `acc` for the `Rows` query rows) through shared memory (`sm_m`, `sm_l`: `[groups][Rows]`,
//! `sm_acc`: `[groups][Rows][D]`), and the split's output rows and log-sum-exps are written: to
//! `out` and `lse` unsplit, else to the split workspace.
template <class T, int D, int Rows>
OASISKV_DEVICE void write_split_result(const decode_kernel_args& a, const float (&m)[Rows],
                                       const float (&l)[Rows],
                                       const float (&acc)[Rows][decode_shape<T, D, Rows>::vec],
                                       float* sm_m, float* sm_l, float* sm_acc, std::uint32_t seq,
                                       std::uint32_t kvh, std::uint32_t row0, std::uint32_t split,
                                       int g_id, int lin) {
  using S = decode_shape<T, D, Rows>;
  constexpr int V = S::vec;
  const decode_params& p = a.p;
  const std::uint32_t group = p.pool.layout.num_q_heads / p.pool.layout.num_kv_heads;
#pragma unroll
  for (int r = 0; r < Rows; ++r) {
    if (lin == 0) {
      sm_m[g_id * Rows + r] = m[r];
      sm_l[g_id * Rows + r] = l[r];
    }
#pragma unroll
    for (int i = 0; i < V; ++i) {
      sm_acc[(g_id * Rows + r) * D + lin * V + i] = acc[r][i];
    }
  }
  __syncthreads();
  constexpr float ln2 = 0.693147180559945309f;
  for (int idx = static_cast<int>(threadIdx.x); idx < Rows * D; idx += S::threads) {
    const int r = idx / D;
    const int x = idx % D;
    const std::uint32_t row = row0 + r;
    if (row >= a.rows) {
      continue;
    }
    float mm = -INFINITY;
#pragma unroll
    for (int g = 0; g < S::groups; ++g) {
      mm = fmaxf(mm, sm_m[g * Rows + r]);
    }
    float ls = 0.0f, o = 0.0f;
    if (mm != -INFINITY) {
#pragma unroll
      for (int g = 0; g < S::groups; ++g) {
        const float w = exp2f(sm_m[g * Rows + r] - mm);
        ls = fmaf(sm_l[g * Rows + r], w, ls);
        o = fmaf(sm_acc[(g * Rows + r) * D + x], w, o);
      }
    }
    const float out = mm == -INFINITY ? 0.0f : o / ls;
    const float lse = mm == -INFINITY ? -INFINITY : mm * ln2 + logf(ls);
    const std::uint32_t j = row / group;
    const std::uint32_t h = kvh * group + row % group;
    const std::size_t orow = p.lse_index(seq, j, h);
    if (a.splits == 1) {
      p.out[orow * D + x] = out;
      if (x == 0) {
        p.lse[orow] = lse;
      }
    } else {
      a.part_out[(orow * a.splits + split) * D + x] = out;
      if (x == 0) {
        a.part_lse[orow * a.splits + split] = lse;
      }
    }
  }
}

//! @brief The start of a split: this lane's slice of each of the CTA's query rows, pre-scaled
//! into the exp2 domain (`q`), each row's position (`qpos`), and an empty online-softmax state.
template <class T, int D, int Rows>
OASISKV_DEVICE void init_rows(const decode_kernel_args& a, std::uint32_t seq, std::uint32_t kvh,
                              std::uint32_t row0, std::uint32_t len, int lin,
                              float (&q)[Rows][decode_shape<T, D, Rows>::vec],
                              std::uint32_t (&qpos)[Rows], float (&m)[Rows], float (&l)[Rows],
                              float (&acc)[Rows][decode_shape<T, D, Rows>::vec]) {
  constexpr int V = decode_shape<T, D, Rows>::vec;
  const decode_params& p = a.p;
  const std::uint32_t group = p.pool.layout.num_q_heads / p.pool.layout.num_kv_heads;
#pragma unroll
  for (int r = 0; r < Rows; ++r) {
    const std::uint32_t row = row0 + r;
    qpos[r] = 0;
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      q[r][i] = 0.0f;
      acc[r][i] = 0.0f;
    }
    if (row < a.rows) {
      const std::uint32_t j = row / group;
      const float* qr = p.q + p.q_row(seq, j, kvh * group + row % group) + lin * V;
#pragma unroll
      for (int i = 0; i < V; i += 4) {
        const float4 x = *reinterpret_cast<const float4*>(qr + i);
        q[r][i] = x.x * a.qscale;
        q[r][i + 1] = x.y * a.qscale;
        q[r][i + 2] = x.z * a.qscale;
        q[r][i + 3] = x.w * a.qscale;
      }
      qpos[r] = len - p.q_len + j;
    }
  }
}

//! @brief One step of a lane group's online softmax over `U` tokens: their keys `kr` and values
//! `vr` (16 bytes of a row each, as loaded), whether each is a token of the sequence (`ok`) and
//! its position (`pos`, masked causally against each query row's `qpos`), folded into the state
//! (`m`, `l`, `acc`) of the `Rows` query rows `q` (pre-scaled into the exp2 domain). The dot
//! products are reduced across the group's lanes: the whole warp must call it.
template <class T, int D, int Rows>
OASISKV_DEVICE void accumulate_tokens(const float (&q)[Rows][decode_shape<T, D, Rows>::vec],
                                      const std::uint32_t (&qpos)[Rows],
                                      const uint4 (&kr)[decode_shape<T, D, Rows>::unroll],
                                      const uint4 (&vr)[decode_shape<T, D, Rows>::unroll],
                                      const bool (&ok)[decode_shape<T, D, Rows>::unroll],
                                      const std::uint32_t (&pos)[decode_shape<T, D, Rows>::unroll],
                                      float (&m)[Rows], float (&l)[Rows],
                                      float (&acc)[Rows][decode_shape<T, D, Rows>::vec]) {
  using S = decode_shape<T, D, Rows>;
  constexpr int V = S::vec;
  constexpr int L = S::lanes;
  constexpr int U = S::unroll;
  float s[U][Rows];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    float kf[V];
    kv_vec<T>::widen(kr[u], kf);
#pragma unroll
    for (int r = 0; r < Rows; ++r) {
      float d = 0.0f;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        d = fmaf(q[r][i], kf[i], d);
      }
#pragma unroll
      for (int off = L / 2; off > 0; off >>= 1) {
        d += __shfl_xor_sync(0xffffffffu, d, off);
      }
      s[u][r] = ok[u] && pos[u] <= qpos[r] ? d : -INFINITY;
    }
  }
  float vf[U][V];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    kv_vec<T>::widen(vr[u], vf[u]);
  }
#pragma unroll
  for (int r = 0; r < Rows; ++r) {
    float mx = m[r];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      mx = fmaxf(mx, s[u][r]);
    }
    if (mx == -INFINITY) {
      continue;  // nothing visible yet for this row
    }
    const float alpha = exp2f(m[r] - mx);  // 0 while m[r] is still -inf
    l[r] *= alpha;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      acc[r][i] *= alpha;
    }
    m[r] = mx;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const float pr = exp2f(s[u][r] - mx);
      l[r] += pr;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        acc[r][i] = fmaf(pr, vf[u][i], acc[r][i]);
      }
    }
  }
}

//! @brief A CTA of the split decode kernels and one of its threads: the sequence (grid z), the
//! KV head and first query row (grid y), the split (grid x) and its range `[e0, e1)` of the
//! table's entries, and the thread's lane group. Flags `status_short_seq` for a sequence shorter
//! than its query tokens.
template <class S, int Rows>
struct split_cta {
  std::uint32_t seq, kvh, row0, split, tpb, len, nblocks, first, e0, e1;
  int warp, sub, lin, g_id;

  __device__ explicit split_cta(const decode_kernel_args& a)
      : seq(blockIdx.z),
        kvh(blockIdx.y / a.row_chunks),
        row0((blockIdx.y % a.row_chunks) * Rows),
        split(blockIdx.x),
        tpb(a.p.pool.layout.tokens_per_block),
        len(a.p.seq_lens[seq]),
        nblocks((len + tpb - 1) / tpb) {
    const std::uint32_t table = a.p.table.table_index(seq, kvh);
    first = a.p.table.offsets[table];
    const std::uint32_t n = a.p.table.offsets[table + 1] - first;
    e0 = static_cast<std::uint32_t>(std::uint64_t{n} * split / a.splits);
    e1 = static_cast<std::uint32_t>(std::uint64_t{n} * (split + 1) / a.splits);
    const int lane = static_cast<int>(threadIdx.x & 31u);
    warp = static_cast<int>(threadIdx.x >> 5);
    sub = lane / S::lanes;
    lin = lane % S::lanes;
    g_id = warp * S::groups_per_warp + sub;
    if (len < a.p.q_len && threadIdx.x == 0) {
      atomicOr(a.status, status_short_seq);
    }
  }
};

template <class T, int D, int Rows>
__global__ void __launch_bounds__(128) decode_split_kernel(const decode_kernel_args a) {
  using S = decode_shape<T, D, Rows>;
  constexpr int V = S::vec;
  constexpr int U = S::unroll;
  __shared__ float sm_m[S::groups][Rows];
  __shared__ float sm_l[S::groups][Rows];
  __shared__ float sm_acc[S::groups][Rows][D];

  const decode_params& p = a.p;
  const kv_layout& lay = p.pool.layout;
  const split_cta<S, Rows> c(a);
  const std::uint32_t seq = c.seq, kvh = c.kvh, row0 = c.row0, split = c.split, tpb = c.tpb,
                      len = c.len, nblocks = c.nblocks, first = c.first, e0 = c.e0, e1 = c.e1;
  const int warp = c.warp, sub = c.sub, lin = c.lin, g_id = c.g_id;

  float q[Rows][V];
  std::uint32_t qpos[Rows];
  float m[Rows], l[Rows], acc[Rows][V];
  init_rows<T, D, Rows>(a, seq, kvh, row0, len, lin, q, qpos, m, l, acc);

  // Tokens [0, total) of this split, block after block. The loop bound is uniform per warp, so
  // the shuffles below always see the whole warp; a lane group past the end masks its tokens.
  const std::uint32_t total = (e1 - e0) * tpb;
  for (std::uint32_t base = static_cast<std::uint32_t>(warp) * (S::groups_per_warp * U);
       base < total; base += S::groups * U) {
    const std::uint32_t t0 = base + static_cast<std::uint32_t>(sub) * U;
    std::uint32_t e = e0 + t0 / tpb;
    std::uint32_t k = t0 % tpb;
    uint4 kr[U], vr[U];
    std::uint32_t pos[U];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      ok[u] = false;
      pos[u] = 0;
      kr[u] = make_uint4(0, 0, 0, 0);
      vr[u] = make_uint4(0, 0, 0, 0);
      if (t0 + u < total) {
        const block_ref ref = p.table.refs[first + e];
        const bool good_slot = ref.slot < p.pool.num_slots;
        const bool good_index = ref.index < nblocks;
        if (good_slot && good_index) {
          if (k < block_fill(lay, ref.index, len)) {
            ok[u] = true;
            pos[u] = ref.index * tpb + k;
            const std::size_t at = std::size_t{k} * D + static_cast<std::size_t>(lin) * V;
            kr[u] = __ldg(reinterpret_cast<const uint4*>(p.pool.keys<T>(ref.slot, kvh) + at));
            vr[u] = __ldg(reinterpret_cast<const uint4*>(p.pool.values<T>(ref.slot, kvh) + at));
          }
        } else if (ref.slot != null_slot && lin == 0 && k == 0) {
          // null_slot is a block the scheduler dropped (skip-on-miss): skipped silently.
          atomicOr(a.status, good_slot ? status_bad_index : status_bad_slot);
        }
      }
      if (++k == tpb) {
        k = 0;
        ++e;
      }
    }

    accumulate_tokens<T, D, Rows>(q, qpos, kr, vr, ok, pos, m, l, acc);
  }

  write_split_result<T, D, Rows>(a, m, l, acc, &sm_m[0][0], &sm_l[0][0], &sm_acc[0][0][0], seq, kvh,
                                 row0, split, g_id, lin);
}

//! @brief Shared memory of `decode_pipelined_kernel`: two stages of `tile` tokens' K and V rows
//! (a stage is what the CTA's lane groups take in one pass: `groups x unroll` tokens); after the
//! main loop the same bytes hold the lane groups' partial outputs for the merge.
template <class T, int D, int Rows>
struct pipeline_shape {
  using S = decode_shape<T, D, Rows>;
  static constexpr int tile = S::groups * S::unroll;  //!< tokens per stage
  static constexpr int pieces = S::lanes;             //!< 16-byte pieces of one K or V row
  static constexpr std::size_t half = std::size_t{tile} * D * sizeof(T);  //!< a stage's K rows
  static constexpr std::size_t stage = 2 * half;                          //!< K, then V
  static constexpr std::size_t acc = std::size_t{S::groups} * Rows * D * sizeof(float);
  static constexpr std::size_t bytes = 2 * stage > acc ? 2 * stage : acc;
  static_assert(pieces * 16 == D * sizeof(T) && bytes <= 40 * 1024);
};

//! A staged token that is none of the sequence's (past the split, past a partial block's fill, a
//! skipped entry): its rows are zero-filled and it is masked.
inline constexpr std::uint32_t no_token = 0xffffffffu;

//! @brief `decode_split_kernel` with its K/V reads pipelined: each pass's tile of tokens is
//! copied into shared memory with asynchronous copies (`cp.async` on sm_80+, `cuda_pipeline.h`)
//! one pass ahead, double buffered, the tile's positions and slots staged in shared memory first
//! (one thread per token reads the table), so the loads of the next tile are in flight while this
//! one is computed. Same grid, same results (the same `accumulate_tokens` on the same values).
template <class T, int D, int Rows>
__global__ void __launch_bounds__(128) decode_pipelined_kernel(const decode_kernel_args a) {
  using S = decode_shape<T, D, Rows>;
  using P = pipeline_shape<T, D, Rows>;
  constexpr int V = S::vec;
  constexpr int U = S::unroll;
  __shared__ __align__(16) unsigned char sm_data[P::bytes];
  __shared__ float sm_m[S::groups][Rows];
  __shared__ float sm_l[S::groups][Rows];
  __shared__ std::uint32_t sm_pos[2][P::tile];   // each staged token's position, or no_token
  __shared__ std::uint32_t sm_slot[2][P::tile];  // its slot, when it has a position

  const decode_params& p = a.p;
  const kv_layout& lay = p.pool.layout;
  const split_cta<S, Rows> c(a);
  const std::uint32_t seq = c.seq, kvh = c.kvh, row0 = c.row0, split = c.split, tpb = c.tpb,
                      len = c.len, nblocks = c.nblocks, first = c.first, e0 = c.e0, e1 = c.e1;
  const int lin = c.lin, g_id = c.g_id;
  float q[Rows][V];
  std::uint32_t qpos[Rows];
  float m[Rows], l[Rows], acc[Rows][V];
  init_rows<T, D, Rows>(a, seq, kvh, row0, len, lin, q, qpos, m, l, acc);

  const std::uint32_t total = (e1 - e0) * tpb;  // tokens [0, total) of this split
  const std::uint32_t tiles = (total + P::tile - 1) / P::tile;
  // Stages tile `it` into stage `st`: positions and slots first (a thread per token), then the
  // rows' 16-byte pieces, zero-filled for a token that is none. Reached by every thread.
  auto issue = [&](std::uint32_t it, int st) {
    for (int x = static_cast<int>(threadIdx.x); x < P::tile; x += S::threads) {
      const std::uint32_t t = it * P::tile + static_cast<std::uint32_t>(x);
      std::uint32_t pos = no_token, slot = 0;
      if (t < total) {
        const std::uint32_t k = t % tpb;
        const block_ref ref = p.table.refs[first + e0 + t / tpb];
        const bool good_slot = ref.slot < p.pool.num_slots;
        const bool good_index = ref.index < nblocks;
        if (good_slot && good_index) {
          if (k < block_fill(lay, ref.index, len)) {
            pos = ref.index * tpb + k;
            slot = ref.slot;
          }
        } else if (ref.slot != null_slot && k == 0) {
          // null_slot is a block the scheduler dropped (skip-on-miss): skipped silently.
          atomicOr(a.status, good_slot ? status_bad_index : status_bad_slot);
        }
      }
      sm_pos[st][x] = pos;
      sm_slot[st][x] = slot;
    }
    __syncthreads();
    unsigned char* stage = sm_data + st * P::stage;
    for (int c = static_cast<int>(threadIdx.x); c < 2 * P::tile * P::pieces; c += S::threads) {
      const int value = c / (P::tile * P::pieces);  // 0: K, 1: V
      const int x = (c / P::pieces) % P::tile;
      const int piece = c % P::pieces;
      const std::uint32_t pos = sm_pos[st][x];
      const bool live = pos != no_token;
      const std::uint32_t k = (it * P::tile + static_cast<std::uint32_t>(x)) % tpb;
      const std::size_t at = std::size_t{k} * D + static_cast<std::size_t>(piece) * V;
      const T* src = reinterpret_cast<const T*>(p.pool.base);  // read nothing when not live
      if (live) {
        src = (value == 0 ? p.pool.keys<T>(sm_slot[st][x], kvh)
                          : p.pool.values<T>(sm_slot[st][x], kvh)) +
              at;
      }
      unsigned char* dst =
          stage + value * P::half +
          (std::size_t{static_cast<unsigned>(x)} * D + static_cast<std::size_t>(piece) * V) *
              sizeof(T);
      __pipeline_memcpy_async(dst, src, 16, live ? 0 : 16);
    }
  };

  if (tiles > 0) {
    issue(0, 0);
  }
  __pipeline_commit();
  for (std::uint32_t it = 0; it < tiles; ++it) {  // uniform over the CTA: barriers are safe
    const int st = static_cast<int>(it & 1u);
    if (it + 1 < tiles) {
      issue(it + 1, st ^ 1);  // the stage tile it - 1 used: released by the barrier below
    }
    __pipeline_commit();
    __pipeline_wait_prior(1);  // this thread's copies of tile `it` have landed
    __syncthreads();           // and everyone's
    const unsigned char* stage = sm_data + st * P::stage;
    uint4 kr[U], vr[U];
    std::uint32_t pos[U];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int x = g_id * U + u;
      pos[u] = sm_pos[st][x];
      ok[u] = pos[u] != no_token;
      const std::size_t at = (std::size_t{static_cast<unsigned>(x)} * D + lin * V) * sizeof(T);
      kr[u] = *reinterpret_cast<const uint4*>(stage + at);
      vr[u] = *reinterpret_cast<const uint4*>(stage + P::half + at);
      pos[u] = ok[u] ? pos[u] : 0;
    }
    accumulate_tokens<T, D, Rows>(q, qpos, kr, vr, ok, pos, m, l, acc);
    __syncthreads();  // stage `st` is refilled by the next pass's issue
  }
  __pipeline_wait_prior(0);

  write_split_result<T, D, Rows>(a, m, l, acc, &sm_m[0][0], &sm_l[0][0],
                                 reinterpret_cast<float*>(sm_data), seq, kvh, row0, split, g_id,
                                 lin);
}

//! @brief Merges the splits of each output row (one CTA of `D` threads per row) by their
//! log-sum-exp: out = sum_s w_s o_s / sum_s w_s with w_s = exp(lse_s - max lse).
template <int D>
__global__ void __launch_bounds__(D)
    merge_splits_kernel(float* out, float* lse, const float* part_out, const float* part_lse,
                        std::uint32_t splits) {
  const std::size_t row = blockIdx.x;
  const unsigned x = threadIdx.x;
  const float* pl = part_lse + row * splits;
  float mm = -INFINITY;
  for (std::uint32_t s = 0; s < splits; ++s) {
    mm = fmaxf(mm, pl[s]);
  }
  if (mm == -INFINITY) {
    out[row * D + x] = 0.0f;
    if (x == 0) {
      lse[row] = -INFINITY;
    }
    return;
  }
  float w_sum = 0.0f, o = 0.0f;
  for (std::uint32_t s = 0; s < splits; ++s) {
    const float w = expf(pl[s] - mm);
    w_sum += w;
    o = fmaf(w, part_out[(row * splits + s) * D + x], o);
  }
  out[row * D + x] = o / w_sum;
  if (x == 0) {
    lse[row] = mm + logf(w_sum);
  }
}

}  // namespace oasiskv::cuda::detail
