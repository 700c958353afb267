// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Kernels of `cuda::sparse_decode`: split-K flash-decoding over a block table, and the
//! log-sum-exp merge of the splits.
#pragma once

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

template <class T, int D, int Rows>
__global__ void __launch_bounds__(128) decode_split_kernel(const decode_kernel_args a) {
  using S = decode_shape<T, D, Rows>;
  constexpr int V = S::vec;
  constexpr int L = S::lanes;
  constexpr int U = S::unroll;
  __shared__ float sm_m[S::groups][Rows];
  __shared__ float sm_l[S::groups][Rows];
  __shared__ float sm_acc[S::groups][Rows][D];

  const decode_params& p = a.p;
  const kv_layout& lay = p.pool.layout;
  const std::uint32_t seq = blockIdx.z;
  const std::uint32_t kvh = blockIdx.y / a.row_chunks;
  const std::uint32_t row0 = (blockIdx.y % a.row_chunks) * Rows;
  const std::uint32_t split = blockIdx.x;
  const std::uint32_t group = lay.num_q_heads / lay.num_kv_heads;
  const std::uint32_t tpb = lay.tokens_per_block;
  const std::uint32_t len = p.seq_lens[seq];
  const std::uint32_t nblocks = (len + tpb - 1) / tpb;
  const std::uint32_t table = p.table.table_index(seq, kvh);
  const std::uint32_t first = p.table.offsets[table];
  const std::uint32_t n = p.table.offsets[table + 1] - first;
  const auto e0 = static_cast<std::uint32_t>(std::uint64_t{n} * split / a.splits);
  const auto e1 = static_cast<std::uint32_t>(std::uint64_t{n} * (split + 1) / a.splits);

  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int sub = lane / L;
  const int lin = lane % L;
  const int g_id = warp * S::groups_per_warp + sub;
  if (len < p.q_len && threadIdx.x == 0) {
    atomicOr(a.status, status_short_seq);
  }

  // This lane's slice of each query row, pre-scaled into the exp2 domain.
  float q[Rows][V];
  std::uint32_t qpos[Rows];
#pragma unroll
  for (int r = 0; r < Rows; ++r) {
    const std::uint32_t row = row0 + r;
    qpos[r] = 0;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      q[r][i] = 0.0f;
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

  float m[Rows], l[Rows], acc[Rows][V];
#pragma unroll
  for (int r = 0; r < Rows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      acc[r][i] = 0.0f;
    }
  }

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

  // Merge the lane groups' states through shared memory, then write this split's result.
#pragma unroll
  for (int r = 0; r < Rows; ++r) {
    if (lin == 0) {
      sm_m[g_id][r] = m[r];
      sm_l[g_id][r] = l[r];
    }
#pragma unroll
    for (int i = 0; i < V; ++i) {
      sm_acc[g_id][r][lin * V + i] = acc[r][i];
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
      mm = fmaxf(mm, sm_m[g][r]);
    }
    float ls = 0.0f, o = 0.0f;
    if (mm != -INFINITY) {
#pragma unroll
      for (int g = 0; g < S::groups; ++g) {
        const float w = exp2f(sm_m[g][r] - mm);
        ls = fmaf(sm_l[g][r], w, ls);
        o = fmaf(sm_acc[g][r][x], w, o);
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
