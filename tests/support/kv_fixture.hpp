// SPDX-License-Identifier: Apache-2.0
//! Test fixtures: pools of random KV blocks, block tables over them, and the buffers of one
//! decode call. Shared by the reference tests and every kernel's tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "oasiskv/core/decode_params.hpp"
#include "oasiskv/core/dtype.hpp"
#include "oasiskv/tier/host_tier.hpp"

namespace oasiskv::testing {

// The key of (slot, kv head, token) of a host tier, as f32.
inline std::vector<float> key_of(const host_tier& t, slot_id s, std::uint32_t h,
                                 std::uint32_t tok) {
  const kv_layout& l = t.layout();
  std::vector<float> k(l.head_dim);
  visit_dtype(l.kv_dtype, [&](auto elem) {
    using T = decltype(elem);
    const T* p = reinterpret_cast<const T*>(t.slot_data(s) + l.key_offset(h)) +
                 std::size_t{tok} * l.head_dim;
    for (std::uint32_t x = 0; x < l.head_dim; ++x) {
      k[x] = to_float(p[x]);
    }
  });
  return k;
}

//! Fills every slot of `tier` with values uniform in [-1, 1], stored in the layout's dtype.
inline void fill_random(host_tier& tier, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  const kv_layout& l = tier.layout();
  const std::size_t elems = l.block_bytes() / l.elem_bytes();
  visit_dtype(l.kv_dtype, [&](auto elem) {
    using T = decltype(elem);
    for (slot_id s = 0; s < tier.num_slots(); ++s) {
      T* p = reinterpret_cast<T*>(tier.slot_data(s));
      for (std::size_t i = 0; i < elems; ++i) {
        p[i] = from_float<T>(dist(rng));
      }
    }
  });
}

//! How a case chooses the blocks each table lists.
enum class pick { all, random_subset };

//! Everything one decode call needs, owning its buffers.
struct decode_case {
  host_tier pool;
  std::vector<std::uint32_t> seq_lens;
  std::vector<block_ref> refs;
  std::vector<std::uint32_t> offsets;
  std::vector<float> q, out, lse;
  std::uint32_t q_len = 1;
  std::uint32_t tables_per_seq = 1;
  float scale = 1.0f;

  decode_params params() {
    decode_params p;
    p.q = q.data();
    p.pool = pool.view();
    p.table = {refs.data(), offsets.data(), static_cast<std::uint32_t>(seq_lens.size()),
               tables_per_seq};
    p.seq_lens = seq_lens.data();
    p.out = out.data();
    p.lse = lse.data();
    p.num_seqs = static_cast<std::uint32_t>(seq_lens.size());
    p.q_len = q_len;
    p.scale = scale;
    return p;
  }
};

//! Builds a batch: each sequence's blocks in distinct, shuffled slots of one pool (random KV),
//! random queries, and tables that list every block (`pick::all`) or a random subset that always
//! keeps the last block (`pick::random_subset`), in shuffled order.
inline decode_case make_decode_case(const kv_layout& layout, std::vector<std::uint32_t> seq_lens,
                                    std::uint32_t q_len, bool per_kv_head, pick mode,
                                    std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uint32_t total_blocks = 0;
  for (auto len : seq_lens) {
    total_blocks += layout.blocks_for(len);
  }
  decode_case c{
      host_tier(layout, total_blocks + 3, {.align = host_tier_options::alignment::cache_line}),
      std::move(seq_lens),
      {},
      {},
      {},
      {},
      {}};
  fill_random(c.pool, seed + 1);
  c.q_len = q_len;
  c.tables_per_seq = per_kv_head ? layout.num_kv_heads : 1;
  c.scale = 1.0f / std::sqrt(static_cast<float>(layout.head_dim));

  std::vector<slot_id> slots(c.pool.num_slots());
  std::iota(slots.begin(), slots.end(), 0u);
  std::shuffle(slots.begin(), slots.end(), rng);
  std::size_t next_slot = 0;
  c.offsets.push_back(0);
  for (std::uint32_t len : c.seq_lens) {
    const std::uint32_t nblocks = layout.blocks_for(len);
    std::vector<slot_id> seq_slots(slots.begin() + next_slot, slots.begin() + next_slot + nblocks);
    next_slot += nblocks;
    for (std::uint32_t t = 0; t < c.tables_per_seq; ++t) {
      std::vector<block_ref> table;
      for (std::uint32_t b = 0; b < nblocks; ++b) {
        const bool keep = mode == pick::all || b + 1 == nblocks || (rng() % 3 != 0);
        if (keep) {
          table.push_back({seq_slots[b], b});
        }
      }
      std::shuffle(table.begin(), table.end(), rng);
      c.refs.insert(c.refs.end(), table.begin(), table.end());
      c.offsets.push_back(static_cast<std::uint32_t>(c.refs.size()));
    }
  }
  const std::size_t rows = c.seq_lens.size() * q_len * layout.num_q_heads;
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  c.q.resize(rows * layout.head_dim);
  for (float& x : c.q) {
    x = dist(rng);
  }
  c.out.assign(rows * layout.head_dim, 0.0f);
  c.lse.assign(rows, 0.0f);
  return c;
}

//! Largest |a - b| / max(1, |b|) over two arrays, or +inf where they cannot be compared: a NaN
//! on either side, an infinity not matched by the same infinity (an empty row's LSE is -inf on
//! both), or different lengths. So `max_rel_error(got, want) <= tol` fails on any of those,
//! where a fold through std::max would keep the previous value past a NaN.
inline double max_rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  constexpr double inf = std::numeric_limits<double>::infinity();
  if (a.size() != b.size()) {
    return inf;
  }
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double x = a[i], y = b[i];
    if (!std::isfinite(x) || !std::isfinite(y)) {
      if (std::isnan(x) || std::isnan(y) || x != y) {
        return inf;
      }
      continue;
    }
    const double e = std::abs(x - y) / std::max(1.0, std::abs(y));
    if (e > worst) {
      worst = e;
    }
  }
  return worst;
}

}  // namespace oasiskv::testing
