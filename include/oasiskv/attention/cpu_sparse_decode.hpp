// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cpu::sparse_decode`: block-sparse decode attention on the CPU, one pass over the
//! selected K and V bytes, at (close to) the memory-read bandwidth.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

#include "oasiskv/attention/cpu/block.hpp"
#include "oasiskv/attention/cpu/range.hpp"
#include "oasiskv/attention/cpu/row_state.hpp"
#include "oasiskv/attention/validate.hpp"
#include "oasiskv/concepts/sparse_attention_kernel.hpp"
#include "oasiskv/core/decode_params.hpp"
#include "oasiskv/core/dtype.hpp"
#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/cpu/thread_pool.hpp"

namespace oasiskv::cpu {

//! @brief Decode attention of 1-16 query tokens per sequence over the blocks each table lists,
//! in one pass with an online softmax. Models `sparse_attention_kernel`.
//!
//! Each (sequence, KV head) reads its selected K and V rows once and uses each for all
//! `group_size x q_len` query rows of its GQA group. Work is split over the pool's threads by
//! (sequence, KV head) and, when that gives too few items to balance, by ranges of a table's
//! blocks, whose partial results are merged by log-sum-exp. Dense attention is this kernel with
//! every block listed. The SIMD path (AVX-512 for head dims 64 and 128, AVX2 + FMA + F16C for any
//! multiple of 8, portable C++ elsewhere) is chosen once, at construction, from what the CPU
//! supports; none needs a `-march` flag from the consumer.
//!
//! Copies share the owned thread pool. `decode` may be called from several threads; calls that
//! use the same pool run one after the other.
class sparse_decode {
 public:
  //! @brief Runs on the calling thread only.
  sparse_decode() : sparse_decode(1u) {}

  //! @brief Owns a pool of `threads` threads (1: run inline). `isa` forces a code path (tests,
  //! benchmarks); throws `errc::unsupported` if this machine cannot run it.
  explicit sparse_decode(unsigned threads, cpu_isa isa = cpu_isa::best)
      : owned_(threads > 1 ? std::make_shared<thread_pool>(threads) : nullptr),
        pool_(owned_.get()),
        isa_(resolve_isa(isa)) {
    if (threads == 0) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "sparse_decode threads = 0 must be >= 1");
    }
  }

  //! @brief Runs on `pool`, which must outlive this kernel and its copies.
  explicit sparse_decode(thread_pool& pool, cpu_isa isa = cpu_isa::best)
      : pool_(&pool), isa_(resolve_isa(isa)) {}

  //! @brief The code path in use (never `best`).
  cpu_isa isa() const noexcept { return isa_; }
  //! @brief Threads a call runs on, the caller included.
  unsigned threads() const noexcept { return pool_ != nullptr ? pool_->size() : 1u; }

  //! @brief The fewest tokens a split range of one table covers: enough that merging partial
  //! results costs little next to the range's reads, few enough that two threads balance on one
  //! long sequence.
  static constexpr std::uint32_t min_split_tokens = 256;

  //! @brief See `sparse_attention_kernel`. Throws `oasiskv::error` (from `validate`) before
  //! writing anything when `p` is malformed.
  void decode(const decode_params& p) const {
    validate(p);
    const kv_layout& l = p.pool.layout;
    const detail::range_fn fn = detail::range_kernel(isa_, l.kv_dtype, l.head_dim);
    run(p, fn);
  }

 private:
  static constexpr std::uint32_t no_part = std::numeric_limits<std::uint32_t>::max();

  // One task: entries [begin, end) of the table of (seq, KV heads [head, head + heads)). With one
  // table per sequence a task serves every KV head, block by block, so it streams each slot's
  // bytes in address order (the hardware prefetchers follow that; a head-by-head walk would
  // touch each slot's 64 KiB in scattered 4 KiB pieces). `part` indexes the partial result
  // buffers when the table is split, or is no_part when the task writes p.out directly.
  struct work_item {
    std::uint32_t seq, head, heads, begin, end, part;
  };
  // A table whose entries were split into `count` consecutive partial results.
  struct split_group {
    std::uint32_t seq, head, heads, first_part, count;
  };

  void run(const decode_params& p, detail::range_fn fn) const {
    const kv_layout& l = p.pool.layout;
    const std::uint32_t rows = p.q_len * l.group_size();
    const std::uint32_t d = l.head_dim;
    const unsigned nthreads = threads();
    const std::uint32_t heads = p.table.tables_per_seq == 1 ? l.num_kv_heads : 1;
    const std::uint32_t tables = l.num_kv_heads / heads;

    // Split tables only when there are several threads: ranges that give each thread about 8
    // items, so the atomic hand-out balances uneven tables, but never below min_split_tokens.
    std::uint64_t total = 0;
    for (std::uint32_t s = 0; s < p.num_seqs; ++s) {
      for (std::uint32_t t = 0; t < tables; ++t) {
        total += std::uint64_t{p.table.size(p.table.table_index(s, t * heads))} * heads;
      }
    }
    std::uint64_t chunk = std::numeric_limits<std::uint32_t>::max();
    if (nthreads > 1) {
      const std::uint64_t min_blocks = std::max<std::uint64_t>(
          1, (min_split_tokens + l.tokens_per_block - 1) / l.tokens_per_block);
      const std::uint64_t per_item = (total + nthreads * 8 - 1) / (nthreads * 8);
      chunk = std::max<std::uint64_t>(min_blocks, (per_item + heads - 1) / heads);
    }
    std::vector<work_item> items;
    std::vector<split_group> groups;
    std::uint32_t parts = 0;
    for (std::uint32_t s = 0; s < p.num_seqs; ++s) {
      for (std::uint32_t t = 0; t < tables; ++t) {
        const std::uint32_t h = t * heads;
        const std::uint32_t n = p.table.size(p.table.table_index(s, h));
        const auto count = static_cast<std::uint32_t>((n + chunk - 1) / chunk);
        if (count <= 1) {
          items.push_back({s, h, heads, 0, n, no_part});
          continue;
        }
        groups.push_back({s, h, heads, parts, count});
        for (std::uint32_t i = 0; i < count; ++i) {
          const auto begin = static_cast<std::uint32_t>(std::uint64_t{n} * i / count);
          const auto end = static_cast<std::uint32_t>(std::uint64_t{n} * (i + 1) / count);
          items.push_back({s, h, heads, begin, end, parts++});
        }
      }
    }
    // Partial results: [part][head in item][row][d] and [part][head in item][row].
    const std::size_t part_rows = std::size_t{heads} * rows;
    std::vector<float> part_out(parts * part_rows * d);
    std::vector<float> part_lse(parts * part_rows);

    auto task = [&](std::size_t i) {
      run_item(p, fn, items[i], part_out.data(), part_lse.data());
    };
    if (pool_ != nullptr) {
      pool_->parallel_for(items.size(), task);
    } else {
      for (std::size_t i = 0; i < items.size(); ++i) {
        task(i);
      }
    }

    const std::uint32_t g = l.group_size();
    for (const split_group& sg : groups) {
      float* out = part_out.data() + sg.first_part * part_rows * d;
      float* lse = part_lse.data() + sg.first_part * part_rows;
      for (std::uint32_t i = 1; i < sg.count; ++i) {
        merge_partial(out, lse, out + i * part_rows * d, lse + i * part_rows, part_rows, d);
      }
      for (std::uint32_t hr = 0; hr < part_rows; ++hr) {
        const std::uint32_t hi = hr / rows;
        const std::uint32_t r = hr % rows;
        const std::uint32_t qh = (sg.head + hi) * g + r % g;
        std::copy_n(out + std::size_t{hr} * d, d, p.out + p.q_row(sg.seq, r / g, qh));
        p.lse[p.lse_index(sg.seq, r / g, qh)] = lse[hr];
      }
    }
  }

  static void run_item(const decode_params& p, detail::range_fn fn, const work_item& w,
                       float* part_out, float* part_lse) {
    const kv_layout& l = p.pool.layout;
    const std::uint32_t g = l.group_size();
    const std::uint32_t rows = p.q_len * g;
    const std::uint32_t d = l.head_dim;
    const std::uint32_t tpb = l.tokens_per_block;
    const std::uint32_t s_stride = (tpb + 15) / 16 * 16;

    // One row_state per KV head of the item, carved from one zeroed, aligned allocation.
    const std::size_t rd = std::size_t{rows} * d;
    // Rounded up to 16 floats so that each head's arrays start on a cache line.
    const std::size_t per_head =
        (2 * rd + std::size_t{rows} * (s_stride + 16) + 3 * std::size_t{rows} + 15) / 16 * 16;
    detail::aligned_floats scratch(per_head * w.heads);
    std::vector<detail::row_state> states(w.heads);
    const float qscale = p.scale * detail::log2e;  // scores come out in log2 units
    for (std::uint32_t hi = 0; hi < w.heads; ++hi) {
      detail::row_state& st = states[hi];
      st.rows = rows;
      st.head_dim = d;
      st.s_stride = s_stride;
      st.q = scratch.data() + hi * per_head;
      st.acc = st.q + rd;
      st.s = st.acc + rd;
      st.lv = st.s + std::size_t{rows} * s_stride;
      st.m = st.lv + std::size_t{rows} * 16;
      st.l = st.m + rows;
      st.alpha = st.l + rows;
      for (std::uint32_t r = 0; r < rows; ++r) {
        const float* q = p.q + p.q_row(w.seq, r / g, (w.head + hi) * g + r % g);
        for (std::uint32_t x = 0; x < d; ++x) {
          st.q[std::size_t{r} * d + x] = q[x] * qscale;
        }
        st.m[r] = -std::numeric_limits<float>::infinity();
      }
    }

    detail::item_span span;
    span.states = states.data();
    span.pool = p.pool;
    span.refs = p.table.begin(p.table.table_index(w.seq, w.head));
    span.begin = w.begin;
    span.end = w.end;
    span.head = w.head;
    span.heads = w.heads;
    span.len = p.seq_lens[w.seq];
    span.q_len = p.q_len;
    span.group = g;
    fn(span);

    for (std::uint32_t hi = 0; hi < w.heads; ++hi) {
      const std::uint32_t h = w.head + hi;
      if (w.part == no_part) {
        detail::finalize_rows(
            states[hi],
            [&](std::uint32_t r) { return p.out + p.q_row(w.seq, r / g, h * g + r % g); },
            [&](std::uint32_t r) -> float& {
              return p.lse[p.lse_index(w.seq, r / g, h * g + r % g)];
            });
      } else {
        const std::size_t base = (std::size_t{w.part} * w.heads + hi) * rows;
        detail::finalize_rows(
            states[hi], [&](std::uint32_t r) { return part_out + (base + r) * d; },
            [&](std::uint32_t r) -> float& { return part_lse[base + r]; });
      }
    }
  }

  std::shared_ptr<thread_pool> owned_;
  thread_pool* pool_ = nullptr;
  cpu_isa isa_ = cpu_isa::scalar;
};

static_assert(sparse_attention_kernel<sparse_decode>);

}  // namespace oasiskv::cpu
