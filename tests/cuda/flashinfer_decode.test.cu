// SPDX-License-Identifier: Apache-2.0
// cuda::flashinfer_decode (FlashInfer's paged decode) and cuda::sparse_decode on the same inputs,
// each against reference_decode on host copies and against each other: sparse selections (sinks,
// recent window, a random middle; budget well below the context), several sequences, partial
// last blocks, GQA, f16 and bf16, head dims 64 and 128, 1 and several causal query tokens; and
// the checks before any launch. Built only where FlashInfer's headers were found.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/cuda_support.cuh"
#include "oasiskv/attention/cuda/flashinfer_decode.cuh"
#include "oasiskv/attention/reference_decode.hpp"
#include "oasiskv/cuda/cuda.cuh"
// The predictor's host scoring loops carry `#pragma GCC unroll`, unknown to nvcc's front end.
#pragma nv_diag_suppress 1675
#include "oasiskv/allocator/free_list_allocator.hpp"
#include "oasiskv/kv_cache.hpp"
#include "oasiskv/predictor/lookahead_predictor.hpp"
#include "oasiskv/summary/minmax_summary.hpp"
#pragma nv_diag_default 1675

namespace {

using oasiskv::block_ref;
using oasiskv::errc;
using oasiskv::testing::device_buffer;
using oasiskv::testing::error_code_of;
namespace oc = oasiskv::cuda;

// A batch on the host (for the reference) and its copy on the device. Each sequence keeps
// `sinks` first blocks, `recent` last blocks (the last one partial unless the length is a
// multiple of the block) and `middle` random blocks between: a budget far below the context.
struct problem {
  oasiskv::kv_layout layout;
  std::uint32_t num_seqs, q_len;
  std::vector<std::byte> pool;
  std::uint32_t slots = 0;
  std::vector<float> q;
  std::vector<block_ref> refs;
  std::vector<std::uint32_t> offsets{0}, lens;

  problem(const oasiskv::kv_layout& l, std::uint32_t seqs, std::uint32_t qlen, std::mt19937& rng)
      : layout(l), num_seqs(seqs), q_len(qlen) {
    std::uniform_int_distribution<std::uint32_t> len_dist(60 * l.tokens_per_block,
                                                          120 * l.tokens_per_block);
    const std::uint32_t sinks = 2, recent = 4, middle = 8;
    for (std::uint32_t s = 0; s < seqs; ++s) {
      std::uint32_t len = len_dist(rng);
      if (s == 0) {
        len = len / l.tokens_per_block * l.tokens_per_block;  // a full last block too
      }
      lens.push_back(len);
      const std::uint32_t blocks = l.blocks_for(len);
      std::vector<std::uint32_t> chosen;
      for (std::uint32_t b = 0; b < sinks; ++b) {
        chosen.push_back(b);
      }
      for (std::uint32_t b = blocks - recent; b < blocks; ++b) {
        chosen.push_back(b);
      }
      std::vector<std::uint32_t> mid(blocks - recent - sinks);
      std::iota(mid.begin(), mid.end(), sinks);
      std::shuffle(mid.begin(), mid.end(), rng);
      chosen.insert(chosen.end(), mid.begin(), mid.begin() + middle);
      std::shuffle(chosen.begin(), chosen.end(), rng);  // no kernel may rely on order
      for (std::uint32_t b : chosen) {
        refs.push_back({slots++, b});
      }
      offsets.push_back(static_cast<std::uint32_t>(refs.size()));
    }
    // Slots in a shuffled order across the pool: scattered reads.
    oasiskv::testing::scatter_and_fill_decode_batch(*this, rng);
  }

  oasiskv::decode_params host_params(float* out, float* lse) const {
    return oasiskv::testing::host_decode_params(*this, 1, out, lse);
  }
};

using device_problem = oasiskv::testing::device_decode_problem<problem>;

struct result {
  std::vector<float> out, lse;
};

result reference(const problem& h) {
  result r{std::vector<float>(h.q.size()), std::vector<float>(h.q.size() / h.layout.head_dim)};
  oasiskv::reference_decode{}.decode(h.host_params(r.out.data(), r.lse.data()));
  return r;
}

// Relative L2 error of the outputs and the largest lse difference; NaN fails at once.
void compare(const result& got, const result& want, double out_tol, float lse_tol) {
  REQUIRE(got.out.size() == want.out.size());
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < got.out.size(); ++i) {
    REQUIRE(std::isfinite(got.out[i]));
    REQUIRE(std::isfinite(want.out[i]));
    const double d = double{got.out[i]} - want.out[i];
    num += d * d;
    den += double{want.out[i]} * want.out[i];
  }
  CHECK(std::sqrt(num / den) < out_tol);
  for (std::size_t i = 0; i < got.lse.size(); ++i) {
    REQUIRE(std::isfinite(got.lse[i]));
    CHECK(std::abs(got.lse[i] - want.lse[i]) < lse_tol * std::max(1.0f, std::abs(want.lse[i])));
  }
}

}  // namespace

TEST_CASE("cuda::flashinfer_decode and cuda::sparse_decode match reference_decode and each other") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(25);
  for (const auto dt : {oasiskv::dtype::bf16, oasiskv::dtype::f16}) {
    for (const std::uint32_t d : {64u, 128u}) {
      for (const std::uint32_t group : {1u, 4u, 8u}) {
        for (const std::uint32_t q_len : {1u, 3u}) {
          const std::uint32_t tpb = q_len == 3 ? 7 : 16;  // odd block sizes: partial blocks
          const oasiskv::kv_layout l{1, 2 * group, 2, d, tpb, dt};
          CAPTURE(oasiskv::to_string(dt));
          CAPTURE(d);
          CAPTURE(group);
          CAPTURE(q_len);
          const problem h(l, 3, q_len, rng);
          const result want = reference(h);
          device_problem dev(h);

          oc::sparse_decode_options so;
          so.check_tables = true;
          oc::sparse_decode(so).decode(dev.p);
          const result own{dev.out.download(), dev.lse.download()};

          // Own: f32 accumulation and output over exactly stored f16/bf16 values and f32
          // queries. FlashInfer: f32 accumulation, but its output (and, split, each partial
          // output) is rounded to the KV type: about 2^-9 relative for bf16, 2^-11 for f16.
          compare(own, want, 1e-3, 1e-3f);
          const double fi_tol = dt == oasiskv::dtype::bf16 ? 8e-3 : 2e-3;
          for (const auto split : {oc::flashinfer_split::automatic, oc::flashinfer_split::never}) {
            CAPTURE(split == oc::flashinfer_split::never);
            dev.poison();
            oc::flashinfer_decode_options fo;
            fo.split = split;
            oc::flashinfer_decode k(fo);
            k.decode(dev.p);
            const result fi{dev.out.download(), dev.lse.download()};
            // 14 pages per request of 16 tokens: FlashInfer's planner splits them (pages of 7
            // tokens: a chunk of 18 pages holds them whole); a split plan has its workspace.
            const oc::flashinfer_decode::plan_info plan = k.last_plan();
            CHECK(plan.split == (split == oc::flashinfer_split::automatic && tpb == 16));
            CHECK(plan.tiles >= plan.requests);
            CHECK(plan.allocated_bytes >= plan.workspace_bytes);
            compare(fi, want, fi_tol, 1e-3f);
            compare(fi, own, fi_tol, 1e-3f);
          }
        }
      }
    }
  }
}

TEST_CASE("cuda::flashinfer_decode: host tables, null slots, a larger GQA batch") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(7);
  const oasiskv::kv_layout l{1, 32, 8, 128, 16, oasiskv::dtype::bf16};
  problem h(l, 4, 1, rng);
  // A dropped block (null_slot) is skipped; the reference rejects such entries, so it runs on
  // the same table without that entry.
  problem without = h;
  h.refs[3].slot = oasiskv::null_slot;
  without.refs.erase(without.refs.begin() + 3);
  for (std::size_t i = 1; i < without.offsets.size(); ++i) {
    without.offsets[i] -= 1;
  }
  const result want = reference(without);
  device_problem dev(h);
  oasiskv::decode_params p = dev.p;
  p.table.refs = h.refs.data();
  p.table.offsets = h.offsets.data();
  p.seq_lens = h.lens.data();
  oc::flashinfer_decode k;
  k.decode_host_tables(p);
  compare({dev.out.download(), dev.lse.download()}, want, 8e-3, 1e-3f);
  dev.poison();
  p.lse = nullptr;  // as the facade passes it: the kernel's own buffer takes the lse
  k.decode_host_tables(p);
  const auto out = dev.out.download();
  for (std::size_t i = 0; i < out.size(); ++i) {
    REQUIRE(std::isfinite(out[i]));
  }
  compare({out, want.lse}, want, 8e-3, 1e-3f);
  dev.poison();
  dev.refs.upload(h.refs);
  k.decode(dev.p);
  compare({dev.out.download(), dev.lse.download()}, want, 8e-3, 1e-3f);
}

TEST_CASE("cuda::flashinfer_decode: bad input raises before any launch") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(5);
  const oasiskv::kv_layout l{1, 8, 2, 64, 16, oasiskv::dtype::f16};
  const problem h(l, 2, 1, rng);
  device_problem dev(h);
  oc::flashinfer_decode k;
  auto with = [&](auto change) {
    oasiskv::decode_params p = dev.p;
    change(p);
    return error_code_of([&] { k.decode(p); });
  };
  std::vector<float> host_out(h.q.size());
  CHECK(with([&](auto& p) { p.table.tables_per_seq = 2; }) == errc::unsupported);  // per head
  // f32 KV: unsupported (here the f16-sized slots fail the pool's layout check first).
  CHECK(with([&](auto& p) { p.pool.layout.kv_dtype = oasiskv::dtype::f32; }) != errc{});
  CHECK(with([&](auto& p) { p.pool.layout.num_q_heads = 10; }) == errc::unsupported);  // group 5
  CHECK(with([&](auto& p) { p.q = h.q.data(); }) == errc::invalid_argument);  // host pointer
  CHECK(with([&](auto& p) { p.out = host_out.data(); }) == errc::invalid_argument);
  CHECK(with([&](auto& p) { p.q_len = 17; }) == errc::invalid_argument);
  CHECK(with([&](auto& p) { p.table.num_seqs = 3; }) == errc::invalid_argument);
  CHECK(with([&](auto& p) { p.q = p.q + 1; }) == errc::misaligned);
  std::vector<block_ref> bad = h.refs;
  bad[0].slot = h.slots + 3;
  dev.refs.upload(bad);
  CHECK(with([](auto&) {}) == errc::invalid_slot);
  bad = h.refs;
  bad[1] = bad[0];
  dev.refs.upload(bad);
  CHECK(with([](auto&) {}) == errc::invalid_argument);  // a block listed twice
  dev.refs.upload(h.refs);
  k.decode(dev.p);
  compare({dev.out.download(), dev.lse.download()}, reference(h), 2e-3, 1e-3f);
}

namespace {

// The facade with FlashInfer as its kernel: KV heads share one table (the predictor's default
// granularity), the tables are built on the host and handed to `decode_host_tables`.
struct flashinfer_policies {
  using allocator = oasiskv::free_list_allocator;
  using fast_tier = oc::device_tier;
  using slow_tier = oc::pinned_host_tier;
  using transfer = oc::copy_engine;
  using predictor = oasiskv::lookahead_predictor<oasiskv::minmax_summary<>>;
  using scheduler = oasiskv::lookahead_prefetcher<oasiskv::lru_eviction>;
  using kernel = oc::flashinfer_decode;
};
static_assert(oasiskv::check_policy_bundle<flashinfer_policies>);
static_assert(oasiskv::tiered_kv_cache<flashinfer_policies>::host_table_kernel);

}  // namespace

TEST_CASE("tiered_kv_cache with cuda::flashinfer_decode as its kernel matches the reference") {
  oasiskv::testing::require_cuda_device_or_skip();
  const oasiskv::kv_layout l{2, 8, 2, 64, 16, oasiskv::dtype::bf16};
  const float scale = 0.125f;
  std::mt19937 rng(31);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  auto rows = [&](std::size_t n) {
    std::vector<oasiskv::bf16> r(n * l.num_kv_heads * l.head_dim);
    for (auto& x : r) {
      x = oasiskv::bf16::from_float(u(rng));
    }
    return r;
  };
  auto queries = [&](std::size_t n) {
    std::vector<float> q(n * l.num_q_heads * l.head_dim);
    for (float& x : q) {
      x = 2.0f * u(rng);
    }
    return q;
  };
  for (const std::uint32_t budget : {1024u, 64u}) {  // covering the context, and a fifth of it
    CAPTURE(budget);
    oasiskv::tiered_kv_cache<flashinfer_policies> cache(oc::pinned_host_tier(l, 256),
                                                        oc::device_tier(l, 96),
                                                        {.budget_tokens = budget, .scale = scale});
    std::vector<oasiskv::sequence_id> ids;
    for (std::uint32_t i = 0; i < 3; ++i) {
      ids.push_back(cache.add_sequence());
      for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
        const auto k = rows(300 + 21 * i), v = rows(300 + 21 * i);
        cache.append(ids.back(), layer, k.data(), v.data(), 300 + 21 * i);
      }
    }
    for (int step = 0; step < 3; ++step) {
      for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
        const auto k = rows(ids.size()), v = rows(ids.size());
        cache.append(ids, layer, k.data(), v.data(), 1);
        const auto draft = queries(ids.size());
        cache.lookahead(ids, layer, draft.data(), 1);
        const auto q = queries(ids.size());
        device_buffer<float> dq(q), dout(q.size()), dlse(ids.size() * l.num_q_heads);
        oasiskv::attended_blocks attended;
        cache.attend(ids, layer, dq.get(), 1, dout.get(), dlse.get(), &attended);
        const result got{dout.download(), dlse.download()};
        // The reference over the capacity tier's copies of the blocks the tables named.
        std::vector<block_ref> refs;
        std::vector<std::uint32_t> offsets{0}, lens;
        REQUIRE(attended.tables_per_seq == 1);
        REQUIRE(attended.offsets.size() == ids.size() + 1);
        for (std::size_t i = 0; i < ids.size(); ++i) {
          const auto slots = cache.block_slots(ids[i], layer);
          for (std::uint32_t j = attended.offsets[i]; j < attended.offsets[i + 1]; ++j) {
            refs.push_back({slots[attended.blocks[j]], attended.blocks[j]});
          }
          offsets.push_back(static_cast<std::uint32_t>(refs.size()));
          lens.push_back(cache.length(ids[i], layer));
          if (budget == 1024) {
            CHECK(attended.offsets[i + 1] - attended.offsets[i] == slots.size());
          } else {
            CHECK(attended.offsets[i + 1] - attended.offsets[i] < slots.size());
          }
        }
        result want{std::vector<float>(q.size()), std::vector<float>(dlse.size())};
        oasiskv::reference_decode{}.decode(
            {q.data(),
             cache.capacity_tier().view(),
             {refs.data(), offsets.data(), static_cast<std::uint32_t>(ids.size()), 1},
             lens.data(),
             want.out.data(),
             want.lse.data(),
             static_cast<std::uint32_t>(ids.size()),
             1,
             scale});
        compare(got, want, 8e-3, 1e-3f);  // FlashInfer rounds its output to bf16
      }
    }
    CHECK(cache.audit() > 0);
  }
}

TEST_CASE("cuda::flashinfer_decode: a split plan writes each row once, nothing past the outputs") {
  oasiskv::testing::require_cuda_device_or_skip();
  // Split plans have more tiles than requests; FlashInfer's kernel writes tile rows, which are
  // the requests' rows only after the merge. Outputs with guard rows after them must come out
  // as the reference, the guards untouched; also with an empty table and a null slot.
  std::mt19937 rng(1445);
  const oasiskv::kv_layout l{1, 16, 2, 128, 16, oasiskv::dtype::bf16};  // GQA group 8
  for (const std::uint32_t q_len : {1u, 16u}) {  // q_len 16: 16 requests per sequence
    CAPTURE(q_len);
    problem h(l, 3, q_len, rng);
    // Sequence 1 selects nothing (an empty table); sequence 2 drops a block (a null slot).
    problem without = h;
    const std::uint32_t drop = h.offsets[2];
    h.refs[drop].slot = oasiskv::null_slot;
    without.refs.erase(without.refs.begin() + drop);
    for (std::size_t i = 3; i < without.offsets.size(); ++i) {
      without.offsets[i] -= 1;
    }
    const std::uint32_t first = h.offsets[1], last = h.offsets[2];
    for (problem* x : {&h, &without}) {
      x->refs.erase(x->refs.begin() + first, x->refs.begin() + last);
      for (std::size_t i = 2; i < x->offsets.size(); ++i) {
        x->offsets[i] -= last - first;
      }
    }
    const result want = reference(without);
    const std::size_t rows = want.lse.size(), guard = 4096;
    device_problem dev(h);
    device_buffer<float> out(rows * l.head_dim + guard * l.head_dim), lse(rows + guard);
    out.fill(0xff);
    lse.fill(0xff);
    oasiskv::decode_params p = dev.p;
    p.out = out.get();
    p.lse = lse.get();
    oc::flashinfer_decode k;
    k.decode(p);
    const oc::flashinfer_decode::plan_info plan = k.last_plan();
    CHECK(plan.split);
    CHECK(plan.tiles > plan.requests);
    CHECK(plan.allocated_bytes >= plan.workspace_bytes);
    const auto got_out = out.download();
    const auto got_lse = lse.download();
    const std::uint32_t poison = 0xffffffffu;
    for (std::size_t i = rows * l.head_dim; i < got_out.size(); ++i) {
      std::uint32_t bits = 0;
      std::memcpy(&bits, &got_out[i], 4);
      REQUIRE(bits == poison);
    }
    for (std::size_t i = rows; i < got_lse.size(); ++i) {
      std::uint32_t bits = 0;
      std::memcpy(&bits, &got_lse[i], 4);
      REQUIRE(bits == poison);
    }
    // Sequence 1's rows: out 0, lse -inf (the reference's, for an empty table).
    const std::size_t per_seq = std::size_t{q_len} * l.num_q_heads;
    result rest{{}, {}};
    result want_rest{{}, {}};
    for (std::size_t r = 0; r < rows; ++r) {
      const bool empty = r / per_seq == 1;
      for (std::uint32_t x = 0; x < l.head_dim; ++x) {
        const float v = got_out[r * l.head_dim + x];
        if (empty) {
          REQUIRE(v == 0.0f);
        } else {
          rest.out.push_back(v);
          want_rest.out.push_back(want.out[r * l.head_dim + x]);
        }
      }
      if (empty) {
        CHECK(std::isinf(got_lse[r]));
        CHECK(got_lse[r] < 0.0f);
      } else {
        rest.lse.push_back(got_lse[r]);
        want_rest.lse.push_back(want.lse[r]);
      }
    }
    compare(rest, want_rest, 8e-3, 1e-3f);
  }
}
