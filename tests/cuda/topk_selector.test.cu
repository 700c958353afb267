// SPDX-License-Identifier: Apache-2.0
// cuda::topk_selector against the CPU lookahead predictor (minmax_summary<f16>, max aggregation,
// shared and per-KV-head tables), and a whole step (select on the GPU, decode) captured in a CUDA
// graph and replayed.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cuda/cuda_support.cuh"
#include "oasiskv/attention/reference_decode.hpp"
#include "oasiskv/cuda/cuda.cuh"
#include "oasiskv/predictor/lookahead_predictor.hpp"

namespace {

using oasiskv::block_ref;
using oasiskv::testing::device_buffer;
namespace oc = oasiskv::cuda;

struct setup {
  oasiskv::kv_layout l;
  std::uint32_t num_seqs, max_blocks, capacity;
  std::vector<std::uint32_t> lens, ids;  // ids: [num_seqs][max_blocks]
  std::vector<std::byte> blocks;         // capacity slots of keys/values (host)
  oasiskv::minmax_summary<oasiskv::f16> summary;

  setup(const oasiskv::kv_layout& layout, std::uint32_t seqs, std::uint32_t maxb, std::mt19937& rng)
      : l(layout),
        num_seqs(seqs),
        max_blocks(maxb),
        capacity(seqs * maxb),
        summary(layout, capacity) {
    std::uniform_int_distribution<std::uint32_t> len(1, maxb * l.tokens_per_block);
    blocks.resize(std::size_t{capacity} * l.block_bytes());
    const auto v =
        oasiskv::testing::random_floats(blocks.size() / l.elem_bytes(), rng, -3.0f, 3.0f);
    oasiskv::visit_dtype(l.kv_dtype, [&](auto e) {
      using T = decltype(e);
      auto* p = reinterpret_cast<T*>(blocks.data());
      for (std::size_t i = 0; i < v.size(); ++i) {
        p[i] = oasiskv::from_float<T>(v[i]);
      }
    });
    ids.assign(std::size_t{seqs} * maxb, 0);
    for (std::uint32_t s = 0; s < seqs; ++s) {
      lens.push_back(s == 0 ? maxb * l.tokens_per_block - 3 : len(rng));
      const std::uint32_t n = l.blocks_for(lens[s]);
      for (std::uint32_t i = 0; i < n; ++i) {
        const std::uint32_t id = s * maxb + (i * 7919u) % maxb;  // scattered entries
        ids[std::size_t{s} * maxb + i] = id;
        const std::uint32_t fill = oasiskv::block_fill(l, i, lens[s]);
        summary.update(id, blocks.data() + std::size_t{id} * l.block_bytes(), 0, fill);
      }
    }
  }
};

// The CPU selection of every sequence, as refs whose slot is the summary id (identity staging).
std::vector<std::vector<std::uint32_t>> cpu_select(setup& st, const std::vector<float>& q,
                                                   std::uint32_t tokens,
                                                   const oasiskv::selection_params& sp,
                                                   bool per_head) {
  std::vector<std::vector<std::uint32_t>> tables;
  for (std::uint32_t s = 0; s < st.num_seqs; ++s) {
    oasiskv::prediction_input<oasiskv::minmax_summary<oasiskv::f16>> in;
    in.layout = st.l;
    in.seq_len = st.lens[s];
    in.summaries = &st.summary;
    in.summary_ids = {st.ids.data() + std::size_t{s} * st.max_blocks, st.l.blocks_for(st.lens[s])};
    in.queries = {q.data() + std::size_t{s} * tokens * st.l.num_q_heads * st.l.head_dim, nullptr,
                  tokens};
    oasiskv::selection sel;
    if (per_head) {
      oasiskv::lookahead_predictor<oasiskv::minmax_summary<oasiskv::f16>, oasiskv::max_aggregation,
                                   oasiskv::per_kv_head_selection>
          p;
      p.select(in, sp, sel);
    } else {
      oasiskv::lookahead_predictor<oasiskv::minmax_summary<oasiskv::f16>, oasiskv::max_aggregation>
          p;
      p.select(in, sp, sel);
    }
    for (std::uint32_t t = 0; t < sel.tables; ++t) {
      const auto tb = sel.table(t);
      tables.emplace_back(tb.begin(), tb.end());
    }
  }
  return tables;
}

}  // namespace

TEST_CASE("cuda::topk_selector selects what the CPU lookahead predictor selects") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(31);
  for (const std::uint32_t d : {64u, 128u}) {
    for (const bool per_head : {false, true}) {
      for (const std::uint32_t tokens : {1u, 4u}) {
        CAPTURE(d);
        CAPTURE(per_head);
        CAPTURE(tokens);
        const oasiskv::kv_layout l{1, 8, 2, d, 16, oasiskv::dtype::f16};
        setup st(l, 5, 200, rng);
        const oasiskv::selection_params sp{48, 2, 3};
        const auto q = oasiskv::testing::random_floats(
            std::size_t{st.num_seqs} * tokens * l.num_q_heads * d, rng);
        const auto expect = cpu_select(st, q, tokens, sp, per_head);

        oc::device_minmax_summary ds(l, st.capacity);
        std::vector<std::uint32_t> all(st.capacity);
        for (std::uint32_t i = 0; i < st.capacity; ++i) {
          all[i] = i;
        }
        ds.upload(st.summary, all);
        // Identity staging except every 5th block, which is a miss.
        std::vector<oasiskv::slot_id> staged(st.ids.size());
        for (std::size_t i = 0; i < staged.size(); ++i) {
          staged[i] = (i % st.max_blocks) % 5 == 4 ? oasiskv::null_slot : st.ids[i];
        }
        oc::topk_selector::options o;
        o.per_kv_head = per_head;
        oc::topk_selector sel(o);
        const std::uint32_t tables = st.num_seqs * sel.tables_per_seq(l);
        device_buffer<float> dq(q);
        device_buffer<std::uint32_t> dlens(st.lens), dids(st.ids);
        device_buffer<oasiskv::slot_id> dstaged(staged);
        device_buffer<block_ref> refs(std::size_t{tables} * sp.budget_blocks);
        device_buffer<std::uint32_t> offsets(tables + 1),
            misses(std::size_t{tables} * sp.budget_blocks), miss_counts(tables);
        oc::topk_request r;
        r.queries = dq.get();
        r.num_tokens = tokens;
        r.seq_lens = dlens.get();
        r.summary_ids = dids.get();
        r.staged_slots = dstaged.get();
        r.refs = refs.get();
        r.offsets = offsets.get();
        r.misses = misses.get();
        r.miss_counts = miss_counts.get();
        r.num_seqs = st.num_seqs;
        r.max_blocks = st.max_blocks;
        r.params = sp;
        sel.select(ds, r);
        sel.check_status();
        const auto got_refs = refs.download();
        const auto got_off = offsets.download();
        const auto got_mc = miss_counts.download();
        REQUIRE(expect.size() == tables);
        CHECK(got_off[0] == 0);
        for (std::uint32_t t = 0; t < tables; ++t) {
          CAPTURE(t);
          REQUIRE(got_off[t + 1] - got_off[t] == expect[t].size());
          std::uint32_t expected_misses = 0;
          for (std::size_t i = 0; i < expect[t].size(); ++i) {
            const block_ref g = got_refs[got_off[t] + i];
            CHECK(g.index == expect[t][i]);
            const std::size_t at = std::size_t{t / sel.tables_per_seq(l)} * st.max_blocks + g.index;
            CHECK(g.slot == staged[at]);
            expected_misses += staged[at] == oasiskv::null_slot ? 1 : 0;
          }
          CHECK(got_mc[t] == expected_misses);
        }
      }
    }
  }
}

TEST_CASE("a decode step (GPU selection, then sparse decode) captured in a CUDA graph") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(77);
  const oasiskv::kv_layout l{1, 8, 2, 128, 16, oasiskv::dtype::bf16};
  setup st(l, 3, 64, rng);
  const oasiskv::selection_params sp{16, 1, 2};
  const std::uint32_t tokens = 1;
  oc::device_minmax_summary ds(l, st.capacity);
  std::vector<std::uint32_t> all(st.capacity);
  for (std::uint32_t i = 0; i < st.capacity; ++i) {
    all[i] = i;
  }
  ds.upload(st.summary, all);
  // The capacity pool is the fast pool here (identity staging): the graph's subject is the
  // selection feeding the kernel with no host round trip.
  device_buffer<std::byte> pool(st.blocks);
  device_buffer<float> dq(std::size_t{st.num_seqs} * tokens * l.num_q_heads * l.head_dim);
  device_buffer<std::uint32_t> dlens(st.lens), dids(st.ids);
  device_buffer<oasiskv::slot_id> dstaged(st.ids);
  device_buffer<block_ref> refs(std::size_t{st.num_seqs} * sp.budget_blocks);
  device_buffer<std::uint32_t> offsets(st.num_seqs + 1);
  device_buffer<float> out(dq.size()), lse(dq.size() / l.head_dim);
  cudaStream_t s = nullptr;
  OASISKV_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  oc::topk_selector::options so;
  so.stream = s;
  oc::topk_selector sel(so);
  oc::sparse_decode_options ko;
  ko.stream = s;
  ko.num_splits = 2;
  oc::sparse_decode kernel(ko);
  sel.reserve(l, st.num_seqs, st.max_blocks);
  kernel.reserve(st.num_seqs, tokens, l);

  oc::topk_request r;
  r.queries = dq.get();
  r.num_tokens = tokens;
  r.seq_lens = dlens.get();
  r.summary_ids = dids.get();
  r.staged_slots = dstaged.get();
  r.refs = refs.get();
  r.offsets = offsets.get();
  r.num_seqs = st.num_seqs;
  r.max_blocks = st.max_blocks;
  r.params = sp;
  oasiskv::decode_params p;
  p.q = dq.get();
  p.pool = {pool.get(), l.block_bytes(), st.capacity, l};
  p.table = {refs.get(), offsets.get(), st.num_seqs, 1};
  p.seq_lens = dlens.get();
  p.out = out.get();
  p.lse = lse.get();
  p.num_seqs = st.num_seqs;
  p.q_len = tokens;
  p.scale = 1.0f / std::sqrt(128.0f);

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  OASISKV_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  sel.select(ds, r);
  kernel.decode(p);
  OASISKV_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  OASISKV_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    const auto q = oasiskv::testing::random_floats(dq.size(), rng);  // fresh queries each step
    dq.upload(q);
    OASISKV_CUDA_CHECK(cudaMemset(out.get(), 0xff, out.size() * sizeof(float)));
    OASISKV_CUDA_CHECK(cudaGraphLaunch(exec, s));
    OASISKV_CUDA_CHECK(cudaStreamSynchronize(s));
    // The CPU pipeline: the CPU predictor's tables, then the reference kernel.
    const auto tables = cpu_select(st, q, tokens, sp, false);
    std::vector<block_ref> hrefs;
    std::vector<std::uint32_t> hoff{0};
    for (const auto& t : tables) {
      for (std::uint32_t b : t) {
        const std::size_t seq = hoff.size() - 1;  // one table per sequence
        hrefs.push_back({st.ids[seq * st.max_blocks + b], b});
      }
      hoff.push_back(static_cast<std::uint32_t>(hrefs.size()));
    }
    CHECK(refs.download() == hrefs);
    std::vector<float> ref_out(out.size()), ref_lse(lse.size());
    oasiskv::decode_params hp = p;
    hp.q = q.data();
    hp.pool.base = st.blocks.data();
    hp.table = {hrefs.data(), hoff.data(), st.num_seqs, 1};
    hp.seq_lens = st.lens.data();
    hp.out = ref_out.data();
    hp.lse = ref_lse.data();
    oasiskv::reference_decode{}.decode(hp);
    const auto got = out.download();
    double num = 0.0, den = 0.0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      REQUIRE(std::isfinite(got[i]));
      num += (double{got[i]} - ref_out[i]) * (double{got[i]} - ref_out[i]);
      den += double{ref_out[i]} * ref_out[i];
    }
    CHECK(std::sqrt(num / den) < 1e-4);
  }
  OASISKV_CUDA_CHECK(cudaGraphExecDestroy(exec));
  OASISKV_CUDA_CHECK(cudaGraphDestroy(graph));
  OASISKV_CUDA_CHECK(cudaStreamDestroy(s));
}
