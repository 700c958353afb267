// SPDX-License-Identifier: Apache-2.0
// cuda::topk_selector against the CPU lookahead predictor (minmax_summary<f16>, max and
// softmax-mass aggregation, shared and per-KV-head tables; quantized_minmax_summary with max
// aggregation, its per-row scores too), and a whole step (select on the GPU,
// decode) captured in a CUDA graph and replayed. Per-token draft weights
// (`confidence_weighted`) against the CPU's `confidence_weighted_aggregation` over both
// summaries.
//
// Two ctest entries run this binary (tests/cuda/CMakeLists.txt): the cases of the test suite
// "host" need no driver and always run (test_cuda_topk_selector_host: the selection parameters'
// checks, the weights' device math against the host aggregation, and the premises of the
// weighted device cases); the others need a device and exit 77 (skipped) without one
// (test_cuda_topk_selector).
#include <doctest/doctest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda/cuda_support.cuh"
#include "oasiskv/attention/reference_decode.hpp"
#include "oasiskv/cuda/cuda.cuh"
#include "oasiskv/predictor/lookahead_predictor.hpp"

namespace {

using oasiskv::block_ref;
using oasiskv::testing::device_buffer;
namespace oc = oasiskv::cuda;

// Random keys in every block, summarised by a host `Summary` (minmax_summary<f16> or
// quantized_minmax_summary).
template <class Summary = oasiskv::minmax_summary<oasiskv::f16>>
struct basic_setup {
  using summary_type = Summary;
  oasiskv::kv_layout l;
  std::uint32_t num_seqs, max_blocks, capacity;
  std::vector<std::uint32_t> lens, ids;  // ids: [num_seqs][max_blocks]
  std::vector<std::byte> blocks;         // capacity slots of keys/values (host)
  Summary summary;

  basic_setup(const oasiskv::kv_layout& layout, std::uint32_t seqs, std::uint32_t maxb,
              std::mt19937& rng)
      : l(layout),
        num_seqs(seqs),
        max_blocks(maxb),
        capacity(seqs * maxb),
        summary(layout, capacity) {
    std::uniform_int_distribution<std::uint32_t> len(1, maxb * l.tokens_per_block);
    blocks.resize(std::size_t{capacity} * l.block_bytes());
    oasiskv::testing::fill_random(blocks.data(), l.kv_dtype, blocks.size() / l.elem_bytes(), rng,
                                  -3.0f, 3.0f);
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
using setup = basic_setup<>;

// Whether the candidates' cut (sinks and recent window aside) is clear by a relative 1e-4 of the
// scores' size, for max aggregation.
bool clear_cut_max(const std::vector<double>& score, const oasiskv::selection_params& sp) {
  const auto n = static_cast<std::uint32_t>(score.size());
  const std::uint32_t recent = std::max(sp.recent_blocks, 1u);
  if (sp.budget_blocks >= n || n <= sp.sink_blocks + recent) {
    return true;
  }
  std::vector<double> c(score.begin() + sp.sink_blocks, score.end() - recent);
  std::sort(c.begin(), c.end(), std::greater<>());
  const std::uint32_t take = sp.budget_blocks - sp.sink_blocks - recent;
  if (take == 0 || take >= c.size()) {
    return true;
  }
  return c[take - 1] - c[take] > 1e-4 * (std::abs(c[take - 1]) + std::abs(c[take]));
}

// The CPU selection of every sequence, as refs whose slot is the summary id (identity staging).
// `weights` (optional): [num_seqs][tokens], each sequence's `query_view::weights`.
template <class Aggregation = oasiskv::max_aggregation, class Setup>
std::vector<std::vector<std::uint32_t>> cpu_select(Setup& st, const std::vector<float>& q,
                                                   std::uint32_t tokens,
                                                   const oasiskv::selection_params& sp,
                                                   bool per_head,
                                                   const std::vector<float>* weights = nullptr) {
  std::vector<std::vector<std::uint32_t>> tables;
  for (std::uint32_t s = 0; s < st.num_seqs; ++s) {
    using summary_type = typename Setup::summary_type;
    oasiskv::prediction_input<summary_type> in;
    in.layout = st.l;
    in.seq_len = st.lens[s];
    in.summaries = &st.summary;
    in.summary_ids = {st.ids.data() + std::size_t{s} * st.max_blocks, st.l.blocks_for(st.lens[s])};
    in.queries = {q.data() + std::size_t{s} * tokens * st.l.num_q_heads * st.l.head_dim,
                  weights == nullptr ? nullptr : weights->data() + std::size_t{s} * tokens, tokens};
    oasiskv::selection sel;
    if (per_head) {
      oasiskv::lookahead_predictor<summary_type, Aggregation, oasiskv::per_kv_head_selection> p;
      p.select(in, sp, sel);
    } else {
      oasiskv::lookahead_predictor<summary_type, Aggregation> p;
      p.select(in, sp, sel);
    }
    for (std::uint32_t t = 0; t < sel.tables; ++t) {
      const auto tb = sel.table(t);
      tables.emplace_back(tb.begin(), tb.end());
    }
  }
  return tables;
}

// Keys built for the softmax-mass comparison: block i of sequence s, KV head h, holds keys
// `level * u + noise` with `level = 0.02 * perm[i]` (a permutation per sequence and KV head)
// and queries are `u + noise`, so each head's bounds, and masses, are spread in clear steps
// (e^(0.02 * |u|^2 / sqrt(d)) apart, 17% at d = 64) rather than left to random near-ties that
// float summation order could flip. `margin_ok` checks, on the host, that the tables' cut is
// clear (for a shared table, the sum over heads).
template <class Summary = oasiskv::minmax_summary<oasiskv::f16>>
struct basic_mass_setup {
  using summary_type = Summary;
  oasiskv::kv_layout l;
  std::uint32_t num_seqs, max_blocks, capacity;
  std::vector<std::uint32_t> lens, ids;
  std::vector<std::byte> blocks;
  std::vector<float> u;
  Summary summary;

  basic_mass_setup(const oasiskv::kv_layout& layout, std::uint32_t seqs, std::uint32_t maxb,
                   std::mt19937& rng)
      : l(layout),
        num_seqs(seqs),
        max_blocks(maxb),
        capacity(seqs * maxb),
        u(layout.head_dim),
        summary(layout, capacity) {
    std::uniform_real_distribution<float> noise(-0.02f, 0.02f);
    std::uniform_int_distribution<std::uint32_t> len(maxb * l.tokens_per_block / 2,
                                                     maxb * l.tokens_per_block);
    for (float& x : u) {
      x = rng() % 2 == 0 ? 1.0f : -1.0f;
    }
    blocks.resize(std::size_t{capacity} * l.block_bytes());
    ids.assign(std::size_t{seqs} * maxb, 0);
    for (std::uint32_t s = 0; s < seqs; ++s) {
      lens.push_back(s == 0 ? maxb * l.tokens_per_block - 5 : len(rng));
      const std::uint32_t n = l.blocks_for(lens[s]);
      std::vector<std::vector<std::uint32_t>> perm(l.num_kv_heads);
      for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
        perm[h].resize(n);
        for (std::uint32_t i = 0; i < n; ++i) {
          perm[h][i] = i;
        }
        std::shuffle(perm[h].begin(), perm[h].end(), rng);
      }
      for (std::uint32_t i = 0; i < n; ++i) {
        const std::uint32_t id = s * maxb + (i * 7919u) % maxb;
        ids[std::size_t{s} * maxb + i] = id;
        std::byte* slot = blocks.data() + std::size_t{id} * l.block_bytes();
        const std::uint32_t fill = oasiskv::block_fill(l, i, lens[s]);
        for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
          auto* k = reinterpret_cast<oasiskv::f16*>(slot + l.key_offset(h));
          const float level = 0.02f * static_cast<float>(perm[h][i]);
          for (std::uint32_t t = 0; t < fill; ++t) {
            for (std::uint32_t x = 0; x < l.head_dim; ++x) {
              k[std::size_t{t} * l.head_dim + x] =
                  oasiskv::from_float<oasiskv::f16>(level * u[x] + noise(rng));
            }
          }
        }
        summary.update(id, slot, 0, fill);
      }
    }
  }

  // Queries `u + noise`; with `flip_odd` the odd lookahead tokens' are `-u + noise`, so they
  // prefer the blocks the even tokens like least.
  std::vector<float> queries(std::uint32_t tokens, std::mt19937& rng, bool flip_odd = false) const {
    std::uniform_real_distribution<float> noise(-0.3f, 0.3f);
    const std::size_t token_elems = std::size_t{l.num_q_heads} * l.head_dim;
    std::vector<float> q(std::size_t{num_seqs} * tokens * token_elems);
    for (std::size_t i = 0; i < q.size(); ++i) {
      const bool odd = (i / token_elems) % tokens % 2 == 1;
      q[i] = (flip_odd && odd ? -u[i % l.head_dim] : u[i % l.head_dim]) + noise(rng);
    }
    return q;
  }

  // Whether every table's kept candidates outweigh the rest by a relative 1e-3 or more, the
  // masses computed in double from the host summary's own scores (each row's mass times its
  // token's weight when `weights`, [num_seqs][tokens], is given).
  bool margin_ok(const std::vector<float>& q, std::uint32_t tokens,
                 const oasiskv::selection_params& sp, bool per_head,
                 const std::vector<float>* weights = nullptr) const {
    const std::uint32_t group = l.group_size(), rows = tokens * group, d = l.head_dim;
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    for (std::uint32_t s = 0; s < num_seqs; ++s) {
      const std::uint32_t n = l.blocks_for(lens[s]);
      const std::span<const std::uint32_t> sid(ids.data() + std::size_t{s} * max_blocks, n);
      std::vector<double> shared(n, 0.0);
      for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
        std::vector<float> qr(std::size_t{rows} * d), raw(std::size_t{rows} * n);
        for (std::uint32_t r = 0; r < rows; ++r) {  // row = token * group + member
          for (std::uint32_t x = 0; x < d; ++x) {
            qr[std::size_t{r} * d + x] =
                q[((std::size_t{s} * tokens + r / group) * l.num_q_heads + h * group + r % group) *
                      d +
                  x];
          }
        }
        summary.score_rows(h, sid, qr.data(), rows, raw.data());
        std::vector<double> mass(n, 0.0);
        for (std::uint32_t r = 0; r < rows; ++r) {
          const float* x = raw.data() + std::size_t{r} * n;
          const double m = *std::max_element(x, x + n);
          double sum = 0.0;
          for (std::uint32_t i = 0; i < n; ++i) {
            sum += std::exp(scale * (x[i] - m));
          }
          const double w =
              weights == nullptr ? 1.0 : (*weights)[std::size_t{s} * tokens + r / group];
          for (std::uint32_t i = 0; i < n; ++i) {
            mass[i] += w * std::exp(scale * (x[i] - m)) / sum;
          }
        }
        for (std::uint32_t i = 0; i < n; ++i) {
          shared[i] += mass[i];
        }
        if (per_head && !clear_cut(mass, sp)) {
          return false;
        }
      }
      if (!per_head && !clear_cut(shared, sp)) {
        return false;
      }
    }
    return true;
  }

  static bool clear_cut(const std::vector<double>& mass, const oasiskv::selection_params& sp) {
    const auto n = static_cast<std::uint32_t>(mass.size());
    if (sp.budget_blocks >= n) {
      return true;
    }
    const std::uint32_t recent = std::max(sp.recent_blocks, 1u);
    std::vector<double> c(mass.begin() + sp.sink_blocks, mass.end() - recent);
    std::sort(c.begin(), c.end(), std::greater<>());
    const std::uint32_t take = sp.budget_blocks - sp.sink_blocks - recent;
    return c[take - 1] > c[take] * (1.0 + 1e-3);
  }
};
using mass_setup = basic_mass_setup<>;
using qmass_setup = basic_mass_setup<oasiskv::quantized_minmax_summary>;

using tables_t = std::vector<std::vector<std::uint32_t>>;
template <class Setup>
constexpr bool quantized =
    std::is_same_v<typename Setup::summary_type, oasiskv::quantized_minmax_summary>;

const oasiskv::selection_params weighted_sp{20, 2, 3};

template <class Setup>
auto device_summary_of(const Setup& st) {
  const std::vector<std::uint32_t> all = oasiskv::testing::iota(st.capacity);
  if constexpr (quantized<Setup>) {
    oc::device_quantized_minmax_summary ds(st.l, st.capacity);
    ds.upload(st.summary, all);
    return ds;
  } else {
    oc::device_minmax_summary ds(st.l, st.capacity);
    ds.upload(st.summary, all);
    return ds;
  }
}

struct gpu_tables {
  std::vector<block_ref> refs;
  std::vector<std::uint32_t> offsets;
};

// A selection request over `st` (identity staging: staged slot = summary id) and the device
// buffers it reads and writes.
struct device_request {
  device_buffer<float> q;
  device_buffer<std::uint32_t> lens, ids;
  device_buffer<oasiskv::slot_id> staged;
  device_buffer<block_ref> refs;
  device_buffer<std::uint32_t> offsets;
  std::unique_ptr<device_buffer<float>> weights;
  oc::topk_request r;

  template <class Setup>
  device_request(const oc::topk_selector& sel, const Setup& st, const std::vector<float>& queries,
                 std::uint32_t tokens, const std::vector<float>* w,
                 const oasiskv::selection_params& sp)
      : q(queries),
        lens(st.lens),
        ids(st.ids),
        staged(st.ids),
        refs(std::size_t{st.num_seqs} * sel.tables_per_seq(st.l) * sp.budget_blocks),
        offsets(st.num_seqs * sel.tables_per_seq(st.l) + 1) {
    if (w != nullptr) {
      weights = std::make_unique<device_buffer<float>>(*w);
    }
    r.queries = q.get();
    r.weights = weights == nullptr ? nullptr : weights->get();
    r.num_tokens = tokens;
    r.seq_lens = lens.get();
    r.summary_ids = ids.get();
    r.staged_slots = staged.get();
    r.refs = refs.get();
    r.offsets = offsets.get();
    r.num_seqs = st.num_seqs;
    r.max_blocks = st.max_blocks;
    r.params = sp;
  }
  gpu_tables download() const { return {refs.download(), offsets.download()}; }
};

// One selection by `sel`; `check` calls check_status afterwards.
template <class Setup, class DeviceSummary>
gpu_tables gpu_select(const oc::topk_selector& sel, const Setup& st, const DeviceSummary& ds,
                      const std::vector<float>& q, std::uint32_t tokens,
                      const std::vector<float>* weights, bool check = true,
                      const oasiskv::selection_params& sp = weighted_sp) {
  device_request req(sel, st, q, tokens, weights, sp);
  sel.select(ds, req.r);
  if (check) {
    sel.check_status();
  }
  OASISKV_CUDA_CHECK(cudaDeviceSynchronize());
  return req.download();
}

oc::topk_selector make_selector(bool per_head, oc::selection_aggregation agg) {
  oc::topk_selector::options o;
  o.per_kv_head = per_head;
  o.aggregation = agg;
  return oc::topk_selector(o);
}

void check_tables(const gpu_tables& got, const tables_t& expect,
                  const oasiskv::selection_params& sp = weighted_sp) {
  REQUIRE(got.offsets.size() == expect.size() + 1);
  CHECK(got.offsets[0] == 0);
  for (std::size_t t = 0; t < expect.size(); ++t) {
    CAPTURE(t);
    REQUIRE(got.offsets[t + 1] - got.offsets[t] == expect[t].size());
    CHECK(expect[t].size() == sp.budget_blocks);
    for (std::size_t i = 0; i < expect[t].size(); ++i) {
      CHECK(got.refs[got.offsets[t] + i].index == expect[t][i]);
    }
  }
}

// Mass setups drawn until the host masses cut clearly (a shared table sums two heads' masses,
// which can come close), so the GPU's rounding cannot flip the selection; null if none did.
template <class Setup>
std::pair<std::unique_ptr<Setup>, std::vector<float>> draw_clear_cut(
    const oasiskv::kv_layout& l, std::uint32_t tokens, const oasiskv::selection_params& sp,
    bool per_head, std::mt19937& rng) {
  for (int attempt = 0; attempt < 64; ++attempt) {
    auto st = std::make_unique<Setup>(l, 3, 96, rng);
    auto q = st->queries(tokens, rng);
    if (st->margin_ok(q, tokens, sp, per_head)) {
      return {std::move(st), std::move(q)};
    }
  }
  return {};
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
        const std::vector<std::uint32_t> all = oasiskv::testing::iota(st.capacity);
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

TEST_CASE(
    "cuda::topk_selector: budget == sinks + recent writes the kept window, within its table") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(45);
  for (const bool per_head : {false, true}) {
    for (const auto agg :
         {oc::selection_aggregation::max, oc::selection_aggregation::softmax_mass}) {
      CAPTURE(per_head);
      CAPTURE(static_cast<int>(agg));
      const oasiskv::kv_layout l{1, 8, 2, 64, 16, oasiskv::dtype::f16};
      setup st(l, 5, 200, rng);
      st.lens[1] = 3 * l.tokens_per_block;  // shorter than the budget: its whole length
      const oasiskv::selection_params sp{5, 2, 3};
      const auto q =
          oasiskv::testing::random_floats(std::size_t{st.num_seqs} * l.num_q_heads * 64, rng);
      oc::device_minmax_summary ds(l, st.capacity);
      const std::vector<std::uint32_t> all = oasiskv::testing::iota(st.capacity);
      ds.upload(st.summary, all);
      oc::topk_selector::options o;
      o.per_kv_head = per_head;
      o.aggregation = agg;
      oc::topk_selector sel(o);
      const std::uint32_t tables = st.num_seqs * sel.tables_per_seq(l);
      const std::size_t room = std::size_t{tables} * sp.budget_blocks;
      constexpr std::size_t guard = 4096;  // entries past the tables: must stay untouched
      device_buffer<float> dq(q);
      device_buffer<std::uint32_t> dlens(st.lens), dids(st.ids);
      device_buffer<oasiskv::slot_id> dstaged(st.ids);
      device_buffer<block_ref> refs(room + guard);
      device_buffer<std::uint32_t> offsets(tables + 1 + guard), misses(room + guard),
          miss_counts(tables);
      refs.fill(0xab);
      offsets.fill(0xab);
      misses.fill(0xab);
      oc::topk_request r;
      r.queries = dq.get();
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
      CHECK(got_off[0] == 0);
      std::size_t t = 0;
      for (std::uint32_t s = 0; s < st.num_seqs; ++s) {
        const std::uint32_t n = l.blocks_for(st.lens[s]);
        const oasiskv::block_window w = oasiskv::kept_window(n, sp);
        for (std::uint32_t h = 0; h < sel.tables_per_seq(l); ++h, ++t) {
          CAPTURE(t);
          const std::uint32_t size = got_off[t + 1] - got_off[t];
          REQUIRE(size == std::min(n, sp.budget_blocks));
          for (std::uint32_t i = 0; i < size; ++i) {
            const std::uint32_t b = got_refs[got_off[t] + i].index;
            CHECK((n <= sp.budget_blocks || w.keeps(b)));  // the window alone
          }
        }
      }
      const std::uint32_t used = got_off[tables];
      CHECK(used <= room);
      for (std::size_t i = used; i < got_refs.size(); ++i) {  // nothing written past the tables
        REQUIRE(got_refs[i].slot == 0xababababu);
      }
      for (std::size_t i = tables + 1; i < got_off.size(); ++i) {
        REQUIRE(got_off[i] == 0xababababu);
      }
      const auto got_misses = misses.download();
      for (std::size_t i = room; i < got_misses.size(); ++i) {
        REQUIRE(got_misses[i] == 0xababababu);
      }
    }
  }
}

namespace {

using qsetup = basic_setup<oasiskv::quantized_minmax_summary>;

// The host quantized summary's score of row `r` of `rows` (KV head h, block i of sequence s),
// and the size of its two terms, |dot s t| + ||A|| slack (the f32 rounding scale).
struct host_qscore {
  float score, size;
};
host_qscore qscore(const qsetup& st, const std::vector<float>& q, std::uint32_t tokens,
                   std::uint32_t s, std::uint32_t h, std::uint32_t r, std::uint32_t i) {
  namespace od = oasiskv::cuda::detail;
  const oasiskv::kv_layout& l = st.l;
  const std::uint32_t d = l.head_dim, group = l.group_size();
  const float* qr =
      q.data() +
      ((std::size_t{s} * tokens + r / group) * l.num_q_heads + h * group + r % group) * d;
  const std::uint32_t id = st.ids[std::size_t{s} * st.max_blocks + i];
  float out = 0.0f;
  st.summary.score(h, std::span<const std::uint32_t>(&id, 1), qr, 1, &out);
  std::vector<std::uint32_t> qw(d / 2), cw(d / 2);
  float t = 0.0f, slack = 0.0f;
  od::qminmax_quantize_query(qr, d, qw.data(), t, slack);
  const float scale = st.summary.bound_words(h, id, cw.data());
  std::int32_t dot = 0;
  for (std::uint32_t p = 0; p < d / 2; ++p) {
    dot = od::qminmax_dot4(qw[p], cw[p], dot);
  }
  return {out, std::abs(static_cast<float>(dot) * (scale * t)) + st.summary.norm(h, id) * slack};
}

// Whether every table's cut (the host's aggregated max scores) is clear by a relative 1e-4, so
// that f32 rounding cannot move a block across it.
bool max_cut_is_clear(const qsetup& st, const std::vector<float>& q, std::uint32_t tokens,
                      const oasiskv::selection_params& sp, bool per_head) {
  const oasiskv::kv_layout& l = st.l;
  const std::uint32_t rows = tokens * l.group_size();
  for (std::uint32_t s = 0; s < st.num_seqs; ++s) {
    const std::uint32_t n = l.blocks_for(st.lens[s]);
    std::vector<double> shared(n, -INFINITY);
    for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
      std::vector<double> head(n, -INFINITY);
      for (std::uint32_t i = 0; i < n; ++i) {
        for (std::uint32_t r = 0; r < rows; ++r) {
          head[i] = std::max<double>(head[i], qscore(st, q, tokens, s, h, r, i).score);
        }
        shared[i] = std::max(shared[i], head[i]);
      }
      if (per_head && !clear_cut_max(head, sp)) {
        return false;
      }
    }
    if (!per_head && !clear_cut_max(shared, sp)) {
      return false;
    }
  }
  return true;
}

}  // namespace

TEST_CASE("cuda::topk_selector over int8 bounds: the host summary's scores and selection") {
  oasiskv::testing::require_cuda_device_or_skip();
  namespace od = oasiskv::cuda::detail;
  std::mt19937 rng(57);
  for (const std::uint32_t d : {64u, 128u}) {
    for (const bool per_head : {false, true}) {
      for (const std::uint32_t tokens : {1u, 4u}) {
        CAPTURE(d);
        CAPTURE(per_head);
        CAPTURE(tokens);
        const auto dt = d == 64 ? oasiskv::dtype::f16 : oasiskv::dtype::bf16;
        const oasiskv::kv_layout l{1, 8, 2, d, 16, dt};
        qsetup st(l, 4, 150, rng);
        const oasiskv::selection_params sp{40, 2, 3};
        std::vector<float> q;
        bool clear = false;
        for (int attempt = 0; attempt < 20 && !clear; ++attempt) {
          q = oasiskv::testing::random_floats(std::size_t{st.num_seqs} * tokens * l.num_q_heads * d,
                                              rng);
          clear = max_cut_is_clear(st, q, tokens, sp, per_head);
        }
        REQUIRE(clear);
        const auto expect = cpu_select(st, q, tokens, sp, per_head);

        // The device summary: recomputed from the blocks on the device for one token count,
        // uploaded for the other (both give the host's bits: device_qminmax_summary.test.cu).
        oc::device_quantized_minmax_summary ds(l, st.capacity);
        device_buffer<std::byte> dblocks(st.blocks);
        if (tokens == 1) {
          const std::vector<std::uint32_t> all = oasiskv::testing::iota(st.capacity);
          ds.upload(st.summary, all);
        } else {
          for (std::uint32_t e = 0; e < st.capacity; ++e) {
            if (st.summary.tokens(e) > 0) {
              ds.recompute(e, dblocks.get() + std::size_t{e} * l.block_bytes(),
                           st.summary.tokens(e));
            }
          }
        }
        device_buffer<float> dq(q);
        device_buffer<std::uint32_t> dlens(st.lens), dids(st.ids);

        // The scoring kernel alone, every row's score kept (the softmax-mass workspace).
        const std::uint32_t rows = tokens * l.group_size();
        device_buffer<float> dscores(std::size_t{st.num_seqs} * l.num_kv_heads * st.max_blocks);
        device_buffer<float> draw(std::size_t{st.num_seqs} * l.num_kv_heads * rows * st.max_blocks);
        device_buffer<std::uint32_t> dstatus(1);
        oasiskv::testing::fill_device(dstatus.get(), 0, sizeof(std::uint32_t));
        od::select_kernel_args a;
        a.layout = l;
        a.qcodes = ds.codes();
        a.qscale = ds.scales();
        a.qnorm = ds.norms();
        a.qbias = ds.biases();
        a.tokens = ds.tokens();
        a.capacity = ds.capacity();
        a.queries = dq.get();
        a.num_tokens = tokens;
        a.seq_lens = dlens.get();
        a.summary_ids = dids.get();
        a.scores = dscores.get();
        a.status = dstatus.get();
        a.num_seqs = st.num_seqs;
        a.max_blocks = st.max_blocks;
        a.softmax_mass = true;
        a.raw = draw.get();
        const dim3 grid((st.max_blocks + od::score_entries_per_cta - 1) / od::score_entries_per_cta,
                        l.num_kv_heads, st.num_seqs);
        if (d == 64) {
          od::score_qminmax_kernel<64><<<grid, od::score_threads>>>(a);
        } else {
          od::score_qminmax_kernel<128><<<grid, od::score_threads>>>(a);
        }
        OASISKV_CUDA_CHECK(cudaGetLastError());
        OASISKV_CUDA_CHECK(cudaDeviceSynchronize());
        const auto raw = draw.download();
        std::size_t compared = 0;
        for (std::uint32_t s = 0; s < st.num_seqs; ++s) {
          for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
            for (std::uint32_t r = 0; r < rows; ++r) {
              for (std::uint32_t i = 0; i < l.blocks_for(st.lens[s]); ++i) {
                const host_qscore want = qscore(st, q, tokens, s, h, r, i);
                const float got =
                    raw[((std::size_t{s} * l.num_kv_heads + h) * rows + r) * st.max_blocks + i];
                CAPTURE(s);
                CAPTURE(h);
                CAPTURE(r);
                CAPTURE(i);
                REQUIRE(!std::isnan(got));
                REQUIRE(std::isfinite(want.score));
                // f32 rounding of the two-term epilogue: 2^-20 of the terms' size.
                CHECK(!(std::abs(got - want.score) > 0x1p-20f * want.size));
                ++compared;
              }
            }
          }
        }
        CHECK(compared > 0);

        // The whole selection against the CPU predictor over the same host summary.
        std::vector<oasiskv::slot_id> staged(st.ids.size());
        for (std::size_t i = 0; i < staged.size(); ++i) {
          staged[i] = (i % st.max_blocks) % 5 == 4 ? oasiskv::null_slot : st.ids[i];
        }
        oc::topk_selector::options o;
        o.per_kv_head = per_head;
        oc::topk_selector sel(o);
        const std::uint32_t tables = st.num_seqs * sel.tables_per_seq(l);
        device_buffer<oasiskv::slot_id> dstaged(staged);
        device_buffer<block_ref> refs(std::size_t{tables} * sp.budget_blocks);
        device_buffer<std::uint32_t> offsets(tables + 1);
        oc::topk_request req;
        req.queries = dq.get();
        req.num_tokens = tokens;
        req.seq_lens = dlens.get();
        req.summary_ids = dids.get();
        req.staged_slots = dstaged.get();
        req.refs = refs.get();
        req.offsets = offsets.get();
        req.num_seqs = st.num_seqs;
        req.max_blocks = st.max_blocks;
        req.params = sp;
        sel.select(ds, req);
        sel.check_status();
        const auto got_refs = refs.download();
        const auto got_off = offsets.download();
        REQUIRE(expect.size() == tables);
        CHECK(got_off[0] == 0);
        for (std::uint32_t t = 0; t < tables; ++t) {
          CAPTURE(t);
          REQUIRE(got_off[t + 1] - got_off[t] == expect[t].size());
          for (std::size_t i = 0; i < expect[t].size(); ++i) {
            const block_ref g = got_refs[got_off[t] + i];
            CHECK(g.index == expect[t][i]);
            const std::size_t at = std::size_t{t / sel.tables_per_seq(l)} * st.max_blocks + g.index;
            CHECK(g.slot == staged[at]);
          }
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
  const std::vector<std::uint32_t> all = oasiskv::testing::iota(st.capacity);
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
  oasiskv::testing::stream_guard s;
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
    oasiskv::testing::fill_device(out.get(), 0xff, out.size() * sizeof(float));
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
  s.destroy();
}

TEST_CASE("cuda::topk_selector softmax mass selects what the CPU softmax-mass predictor selects") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(53);
  for (const std::uint32_t d : {64u, 128u}) {
    for (const bool per_head : {false, true}) {
      for (const std::uint32_t tokens : {1u, 4u}) {
        CAPTURE(d);
        CAPTURE(per_head);
        CAPTURE(tokens);
        const oasiskv::kv_layout l{1, 8, 2, d, 16, oasiskv::dtype::f16};
        const oasiskv::selection_params sp{20, 2, 3};  // a budget well below 48..96 blocks
        auto [pst, q] = draw_clear_cut<mass_setup>(l, tokens, sp, per_head, rng);
        REQUIRE(pst != nullptr);
        mass_setup& st = *pst;
        const auto expect =
            cpu_select<oasiskv::softmax_mass_aggregation>(st, q, tokens, sp, per_head);
        // A shared table sums masses over KV heads that rank blocks differently, where max
        // aggregation takes the higher bound: the selections differ, so this test tells the
        // aggregations apart. (Per KV head they rank alike by construction.)
        if (!per_head) {
          CHECK(expect != cpu_select(st, q, tokens, sp, per_head));
        }

        const auto ds = device_summary_of(st);
        const oc::topk_selector sel =
            make_selector(per_head, oc::selection_aggregation::softmax_mass);
        device_request req(sel, st, q, tokens, nullptr, sp);
        sel.select(ds, req.r);
        sel.check_status();
        const gpu_tables got = req.download();
        REQUIRE(expect.size() == st.num_seqs * sel.tables_per_seq(l));
        check_tables(got, expect, sp);

        // The same selection captured in a CUDA graph (the workspace reserved first) and
        // replayed into cleared outputs gives the same tables.
        if (d == 128 && tokens == 4) {
          oasiskv::testing::stream_guard stream;
          oc::topk_selector::options co;
          co.per_kv_head = per_head;
          co.aggregation = oc::selection_aggregation::softmax_mass;
          co.stream = stream;
          oc::topk_selector captured(co);
          captured.reserve(l, st.num_seqs, st.max_blocks, tokens);
          cudaGraph_t graph = nullptr;
          cudaGraphExec_t exec = nullptr;
          OASISKV_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
          captured.select(ds, req.r);
          OASISKV_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
          OASISKV_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
          oasiskv::testing::fill_device(req.refs.get(), 0xff, req.refs.size() * sizeof(block_ref));
          oasiskv::testing::fill_device(req.offsets.get(), 0xff,
                                        req.offsets.size() * sizeof(std::uint32_t));
          OASISKV_CUDA_CHECK(cudaGraphLaunch(exec, stream));
          OASISKV_CUDA_CHECK(cudaStreamSynchronize(stream));
          CHECK(req.refs.download() == got.refs);
          CHECK(req.offsets.download() == got.offsets);
          OASISKV_CUDA_CHECK(cudaGraphExecDestroy(exec));
          OASISKV_CUDA_CHECK(cudaGraphDestroy(graph));
          stream.destroy();
        }
      }
    }
  }
}

TEST_CASE(
    "cuda::topk_selector softmax mass over int8 bounds selects what the CPU predictor selects") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(59);
  for (const std::uint32_t d : {64u, 128u}) {
    for (const bool per_head : {false, true}) {
      const std::uint32_t tokens = per_head ? 1u : 4u;
      CAPTURE(d);
      CAPTURE(per_head);
      const oasiskv::kv_layout l{1, 8, 2, d, 16, oasiskv::dtype::f16};
      const oasiskv::selection_params sp{20, 2, 3};
      auto [pst, q] = draw_clear_cut<qmass_setup>(l, tokens, sp, per_head, rng);
      REQUIRE(pst != nullptr);
      const auto expect =
          cpu_select<oasiskv::softmax_mass_aggregation>(*pst, q, tokens, sp, per_head);
      const auto ds = device_summary_of(*pst);
      const oc::topk_selector sel =
          make_selector(per_head, oc::selection_aggregation::softmax_mass);
      check_tables(gpu_select(sel, *pst, ds, q, tokens, nullptr, true, sp), expect, sp);
    }
  }
}

TEST_CASE("cuda::topk_selector: bad requests throw before any launch") {
  oasiskv::testing::require_cuda_device_or_skip();
  const oasiskv::kv_layout l{1, 8, 2, 64, 16, oasiskv::dtype::f16};
  oc::topk_selector::options o;
  o.aggregation = oc::selection_aggregation::softmax_mass;
  oc::topk_selector sel(o);
  auto code = [](auto&& f) {
    try {
      f();
    } catch (const oasiskv::error& e) {
      return e.code();
    }
    return oasiskv::errc{};
  };
  CHECK(code([&] { sel.reserve(l, 2, 64, 0); }) == oasiskv::errc::invalid_argument);
  CHECK(code([&] { sel.reserve(l, 2, 64, 17); }) == oasiskv::errc::invalid_argument);
  oc::device_minmax_summary ds(l, 8);
  device_buffer<float> dq(std::size_t{17} * l.num_q_heads * l.head_dim);
  device_buffer<std::uint32_t> u32(64);
  device_buffer<oasiskv::slot_id> slots(64);
  device_buffer<block_ref> refs(64);
  oc::topk_request r;
  r.queries = dq.get();
  r.seq_lens = u32.get();
  r.summary_ids = u32.get();
  r.staged_slots = slots.get();
  r.refs = refs.get();
  r.offsets = u32.get();
  r.num_seqs = 1;
  r.max_blocks = 8;
  r.params = {8, 1, 1};
  r.num_tokens = 17;
  CHECK(code([&] { sel.select(ds, r); }) == oasiskv::errc::invalid_argument);
  r.num_tokens = 1;
  r.params = {2, 1, 2};  // below sinks + recent
  CHECK(code([&] { sel.select(ds, r); }) == oasiskv::errc::invalid_argument);
  r.params = {8, 1, 1};
  std::vector<float> host_q(dq.size());
  r.queries = host_q.data();
  CHECK(code([&] { sel.select(ds, r); }) == oasiskv::errc::invalid_argument);
  r.queries = dq.get();
  // Weights in pageable host memory: named before any launch.
  std::vector<float> host_w(2, 1.0f);
  r.weights = host_w.data();
  std::string what;
  try {
    sel.select(ds, r);
  } catch (const oasiskv::error& e) {
    CHECK(e.code() == oasiskv::errc::invalid_argument);
    what = e.what();
  }
  CHECK_MESSAGE(what.find("topk_request.weights") != std::string::npos, what);
}

TEST_CASE("topk_selector::validate judges the selection on the host" *
          doctest::test_suite("host")) {
  const oasiskv::kv_layout l{1, 8, 2, 64, 16, oasiskv::dtype::f16};
  auto error_of = [&](const oasiskv::kv_layout& layout, const oasiskv::selection_params& sp) {
    try {
      oc::topk_selector::validate(layout, sp);
    } catch (const oasiskv::error& e) {
      return std::pair{e.code(), std::string(e.what())};
    }
    return std::pair{oasiskv::errc{}, std::string()};
  };
  CHECK_NOTHROW(oc::topk_selector::validate(l, {8, 1, 2}));
  auto [code, what] = error_of(l, {2, 1, 2});
  CHECK(code == oasiskv::errc::invalid_argument);
  CHECK_MESSAGE(what.find("budget_blocks = 2") != std::string::npos, what);
  oasiskv::selection_params adaptive{8, 1, 2};
  adaptive.target_mass = 0.5f;
  std::tie(code, what) = error_of(l, adaptive);
  CHECK(code == oasiskv::errc::unsupported);
  CHECK_MESSAGE(what.find("target_mass = 0.5") != std::string::npos, what);
  oasiskv::kv_layout l96 = l;
  l96.head_dim = 96;
  std::tie(code, what) = error_of(l96, {8, 1, 2});
  CHECK(code == oasiskv::errc::unsupported);
  CHECK_MESSAGE(what.find("head_dim = 96") != std::string::npos, what);
}

namespace {

// The top-k kernel's decisions composed on the host as the kernel composes them: the table's
// plan (`plan_topk_table`), the 8-bit radix passes (per pass, the lanes' runs of eight buckets
// from the top, the first run whose running count reaches the rest, walked by
// `pick_radix_bucket`), then `topk_keeps` over the blocks in index order.
std::vector<std::uint32_t> emulate_topk(const std::vector<std::uint32_t>& keys,
                                        const oc::detail::topk_table& plan) {
  std::uint32_t threshold = 0, take_equal = 0;
  if (plan.take > 0) {
    std::uint32_t remaining = plan.take, prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
      std::uint32_t hist[256] = {};
      for (std::uint32_t i = plan.sinks; i < plan.end; ++i) {
        if ((keys[i] & mask) == prefix) {
          ++hist[(keys[i] >> shift) & 255u];
        }
      }
      std::uint32_t incl = 0;
      oc::detail::radix_pick pick;
      for (std::uint32_t lane = 0; lane < 32 && !pick.found; ++lane) {
        std::uint32_t local = 0;
        for (std::uint32_t j = 0; j < 8; ++j) {
          local += hist[255 - 8 * lane - j];
        }
        incl += local;
        if (incl >= remaining) {
          pick = oc::detail::pick_radix_bucket(hist, 255 - 8 * lane, 8, incl - local, remaining);
          REQUIRE(pick.found);
        }
      }
      REQUIRE(pick.found);
      remaining -= pick.above;
      REQUIRE(remaining >= 1);
      prefix |= pick.bucket << shift;
      mask |= 255u << shift;
    }
    threshold = prefix;
    take_equal = remaining;
  }
  std::vector<std::uint32_t> table;
  std::uint32_t rank = 0;
  for (std::uint32_t i = 0; i < keys.size(); ++i) {
    if (oc::detail::topk_keeps(plan, i, keys[i], threshold, take_equal, rank)) {
      table.push_back(i);
    }
  }
  return table;
}

// The table by sorting: the kept window, and the best `budget - window` candidates by key, ties
// to the lower index.
std::vector<std::uint32_t> sorted_topk(const std::vector<std::uint32_t>& keys, std::uint32_t budget,
                                       std::uint32_t sinks, std::uint32_t recent) {
  const auto n = static_cast<std::uint32_t>(keys.size());
  if (budget >= n) {
    return oasiskv::testing::iota(n);
  }
  const oasiskv::block_window w = oasiskv::kept_window(n, sinks, recent);
  std::vector<std::uint32_t> cand(w.candidates());
  std::iota(cand.begin(), cand.end(), w.sinks);
  std::stable_sort(cand.begin(), cand.end(),
                   [&](std::uint32_t a, std::uint32_t b) { return keys[a] > keys[b]; });
  cand.resize(budget - w.kept());
  for (std::uint32_t i = 0; i < n; ++i) {
    if (w.keeps(i)) {
      cand.push_back(i);
    }
  }
  std::sort(cand.begin(), cand.end());
  return cand;
}

}  // namespace

TEST_CASE("topk_selector's table: budget == sinks + recent keeps the window alone" *
          doctest::test_suite("host")) {
  // 100 blocks, 3 sinks, 4 recent, budget 7: no candidate is taken (the kernel used to keep
  // every one, writing 100 entries into a table of 7).
  const oc::detail::topk_table t = oc::detail::plan_topk_table(100, 7, 3, 4);
  CHECK(!t.take_all);
  CHECK(t.count == 7);
  CHECK(t.take == 0);
  CHECK(t.sinks == 3);
  CHECK(t.end == 96);
  std::vector<std::uint32_t> keys(100, 0x80000000u);  // all equal: no threshold can split them
  CHECK(emulate_topk(keys, t) == std::vector<std::uint32_t>{0, 1, 2, 96, 97, 98, 99});
  // recent 0 keeps the last block all the same: budget 3 + 1.
  const oc::detail::topk_table t0 = oc::detail::plan_topk_table(100, 4, 3, 0);
  CHECK(t0.take == 0);
  CHECK(emulate_topk(keys, t0) == std::vector<std::uint32_t>{0, 1, 2, 99});
  // A sequence no longer than the budget: all of it.
  const oc::detail::topk_table short_seq = oc::detail::plan_topk_table(6, 7, 3, 4);
  CHECK(short_seq.take_all);
  CHECK(short_seq.count == 6);
  CHECK(emulate_topk(std::vector<std::uint32_t>(6, 1u), short_seq).size() == 6);
}

TEST_CASE("topk_selector's table: the radix select's threshold and table sizes" *
          doctest::test_suite("host")) {
  std::mt19937 rng(451);
  for (int trial = 0; trial < 3000; ++trial) {
    CAPTURE(trial);
    std::uniform_int_distribution<std::uint32_t> nd(1, 600), small(0, 6);
    const std::uint32_t n = nd(rng), sinks = small(rng), recent = small(rng);
    const auto least = static_cast<std::uint32_t>(oasiskv::min_budget_blocks(sinks, recent));
    std::uniform_int_distribution<std::uint32_t> bd(least, least + n);
    const std::uint32_t budget = trial % 5 == 0 ? least : bd(rng);  // the equality often
    // Keys with many ties (few distinct values) or spread over all 32 bits.
    std::vector<std::uint32_t> keys(n);
    std::uniform_int_distribution<std::uint32_t> few(0, 3), any;
    for (std::uint32_t& k : keys) {
      k = trial % 2 == 0 ? 0x80000000u + few(rng) * 0x01010101u : any(rng);
    }
    CAPTURE(n);
    CAPTURE(budget);
    CAPTURE(sinks);
    CAPTURE(recent);
    const oc::detail::topk_table t = oc::detail::plan_topk_table(n, budget, sinks, recent);
    CHECK(t.count == std::min(n, budget));
    const std::vector<std::uint32_t> got = emulate_topk(keys, t);
    CHECK(got.size() == t.count);  // exactly the table's room: never more
    CHECK(got == sorted_topk(keys, budget, sinks, recent));
  }
}

// Per-token draft weights (`selection_aggregation::confidence_weighted`).

namespace {

using oasiskv::confidence_weighted_aggregation;
using oasiskv::softmax_mass_aggregation;

oasiskv::kv_layout weighted_layout(std::uint32_t d) {
  return {1, 8, 2, d, 16, oasiskv::dtype::f16};
}

// Each weighted input gets a seed of its own, so that the host cases check the premises of the
// very inputs the device cases select from.
std::uint32_t input_seed(std::uint32_t d, bool per_head, bool quant, std::uint32_t kind) {
  return 1000u * kind + d + (per_head ? 7u : 0u) + (quant ? 13u : 0u);
}

// Four lookahead tokens, the odd ones against the even (`flip_odd`), weighted per sequence by a
// rotation of {1, 0.25, 0.9, 0.1} (the even tokens outweigh the odd in sequences 0 and 2, the
// odd the even in sequence 1). Drawn until the weighted masses cut clearly and the host's
// weighted selection differs from its unweighted one (so the weights matter); `st` stays null if
// no draw did.
template <class Setup>
struct weighted_inputs {
  std::unique_ptr<Setup> st;
  std::uint32_t tokens = 4;
  std::vector<float> q, w;  // w: [num_seqs][tokens]
  tables_t expect;          // the CPU predictor with confidence_weighted_aggregation
};

template <class Setup>
weighted_inputs<Setup> make_weighted(std::uint32_t d, bool per_head) {
  std::mt19937 rng(input_seed(d, per_head, quantized<Setup>, 1));
  weighted_inputs<Setup> x;
  const float base[4] = {1.0f, 0.25f, 0.9f, 0.1f};
  for (int attempt = 0; attempt < 64; ++attempt) {
    auto st = std::make_unique<Setup>(weighted_layout(d), 3, 96, rng);
    auto q = st->queries(x.tokens, rng, true);
    std::vector<float> w(std::size_t{st->num_seqs} * x.tokens);
    for (std::uint32_t s = 0; s < st->num_seqs; ++s) {
      for (std::uint32_t t = 0; t < x.tokens; ++t) {
        w[std::size_t{s} * x.tokens + t] = base[(t + s) % 4];
      }
    }
    if (!st->margin_ok(q, x.tokens, weighted_sp, per_head, &w)) {
      continue;
    }
    auto expect =
        cpu_select<confidence_weighted_aggregation>(*st, q, x.tokens, weighted_sp, per_head, &w);
    if (expect == cpu_select<softmax_mass_aggregation>(*st, q, x.tokens, weighted_sp, per_head)) {
      continue;
    }
    x.st = std::move(st);
    x.q = std::move(q);
    x.w = std::move(w);
    x.expect = std::move(expect);
    break;
  }
  return x;
}

// Two lookahead tokens, the second against the first (`flip_odd`); sequence s keeps token s % 2
// (weight 1) and drops the other (weight 0). `expect` is the CPU selection from the kept token's
// rows alone, `dropped` from the dropped token's alone. Drawn until `expect`'s cut is clear and
// every table of `dropped` differs from `expect`'s (the dropped token alone picks other blocks).
template <class Setup>
struct zero_inputs {
  std::unique_ptr<Setup> st;
  std::vector<float> q, w;  // two tokens; w: [num_seqs][2]
  std::vector<float> kept_q, dropped_q;
  tables_t expect, dropped;
};

template <class Setup>
zero_inputs<Setup> make_zero(std::uint32_t d, bool per_head) {
  std::mt19937 rng(input_seed(d, per_head, quantized<Setup>, 2));
  zero_inputs<Setup> x;
  for (int attempt = 0; attempt < 64; ++attempt) {
    auto st = std::make_unique<Setup>(weighted_layout(d), 3, 96, rng);
    const std::size_t te = std::size_t{st->l.num_q_heads} * st->l.head_dim;
    auto q = st->queries(2, rng, true);
    std::vector<float> w(std::size_t{st->num_seqs} * 2), kept(st->num_seqs * te),
        dropped(st->num_seqs * te);
    for (std::uint32_t s = 0; s < st->num_seqs; ++s) {
      const std::uint32_t keep = s % 2;
      w[std::size_t{s} * 2 + keep] = 1.0f;
      w[std::size_t{s} * 2 + (1 - keep)] = 0.0f;
      std::copy_n(q.begin() + (std::size_t{s} * 2 + keep) * te, te, kept.begin() + s * te);
      std::copy_n(q.begin() + (std::size_t{s} * 2 + 1 - keep) * te, te, dropped.begin() + s * te);
    }
    if (!st->margin_ok(kept, 1, weighted_sp, per_head)) {
      continue;
    }
    auto expect = cpu_select<softmax_mass_aggregation>(*st, kept, 1, weighted_sp, per_head);
    auto other = cpu_select<softmax_mass_aggregation>(*st, dropped, 1, weighted_sp, per_head);
    bool all_differ = expect.size() == other.size();
    for (std::size_t t = 0; all_differ && t < expect.size(); ++t) {
      all_differ = expect[t] != other[t];
    }
    if (!all_differ) {
      continue;
    }
    x.st = std::move(st);
    x.q = std::move(q);
    x.w = std::move(w);
    x.kept_q = std::move(kept);
    x.dropped_q = std::move(dropped);
    x.expect = std::move(expect);
    x.dropped = std::move(other);
    break;
  }
  return x;
}

// The message of the oasiskv::error `f` throws (its code in `code`), or "" if none.
template <class F>
std::string error_of(F&& f, oasiskv::errc& code) {
  try {
    f();
  } catch (const oasiskv::error& e) {
    code = e.code();
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("topk_selector weights: the device's weight math is the host's" *
          doctest::test_suite("host")) {
  namespace od = oasiskv::cuda::detail;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();

  // Usable weights: the host's check_queries rule (finite, >= 0; -0 passes it too).
  CHECK(od::weight_ok(0.0f));
  CHECK(od::weight_ok(-0.0f));
  CHECK(od::weight_ok(0.5f));
  CHECK(od::weight_ok(std::numeric_limits<float>::max()));
  CHECK(!od::weight_ok(-1e-30f));
  CHECK(!od::weight_ok(nan));
  CHECK(!od::weight_ok(inf));
  CHECK(!od::weight_ok(-inf));

  // A row's weight: its token's (row / group) of its sequence's; 1 without weights; 0 for a bad
  // one, and +0 for -0.
  const std::vector<float> w = {0.5f, 2.0f, 0.25f, 3.0f, nan, -1.0f, inf, -0.0f, 0.75f};
  CHECK(od::row_weight(nullptr, 3, 2, 5, 2) == 1.0f);
  for (std::uint32_t s = 0; s < 3; ++s) {
    for (std::uint32_t r = 0; r < 6; ++r) {  // group 2: rows 2t and 2t + 1 are token t's
      CAPTURE(s);
      CAPTURE(r);
      const float want = w[s * 3 + r / 2];
      const float got = od::row_weight(w.data(), 3, s, r, 2);
      REQUIRE(!std::isnan(got));
      CHECK(!std::signbit(got));
      CHECK(got == (oasiskv::cuda::detail::weight_ok(want) ? want : 0.0f));
    }
  }
  CHECK(od::row_weight(w.data(), 3, 1, 1, 2) == 3.0f);  // sequence 1, token 0
  CHECK(od::row_weight(w.data(), 3, 1, 2, 2) == 0.0f);  // token 1: NaN
  CHECK(od::row_weight(w.data(), 3, 1, 5, 2) == 0.0f);  // token 2: -1
  CHECK(od::row_weight(w.data(), 3, 2, 4, 2) == 0.75f);

  // The clamp before the softmax: finite values kept, infinities to +-FLT_MAX, NaN to +FLT_MAX.
  CHECK(od::mass_clamp(-3.5f) == -3.5f);
  CHECK(od::mass_clamp(inf) == FLT_MAX);
  CHECK(od::mass_clamp(-inf) == -FLT_MAX);
  CHECK(od::mass_clamp(nan) == FLT_MAX);

  // A bad weight's report: the lowest (sequence, token) first whatever the value, decoded back
  // to the same sequence, token and bits.
  CHECK(od::bad_weight_key(1, 2, nan) < od::bad_weight_key(2, 0, -1.0f));
  CHECK(od::bad_weight_key(1, 2, -inf) < od::bad_weight_key(1, 3, -1.0f));
  CHECK(od::bad_weight_key(65535, 15, nan) < od::no_bad_weight);
  for (const float v : {nan, -inf, inf, -1.0f, -0x1p-149f}) {
    for (const std::uint32_t seq : {0u, 1u, 777u, 65535u}) {
      for (const std::uint32_t token : {0u, 5u, 15u}) {
        const od::bad_weight_report r = od::decode_bad_weight(od::bad_weight_key(seq, token, v));
        CHECK(r.seq == seq);
        CHECK(r.token == token);
        std::uint32_t a = 0, b = 0;
        std::memcpy(&a, &v, 4);
        std::memcpy(&b, &r.value, 4);
        CHECK(a == b);
      }
    }
  }

  // Weight 1 scales a row by exactly 1 / sum: weights all 1 give the unweighted mass's bits.
  std::mt19937 rng(61);
  std::uniform_real_distribution<float> sums(1.0f, 5000.0f);
  for (int i = 0; i < 1000; ++i) {
    const float sum = sums(rng);
    CHECK(od::row_mass_factor(1.0f, sum) == 1.0f / sum);
  }
}

TEST_CASE("topk_selector weights: the device's row fold is confidence_weighted_aggregation's" *
          doctest::test_suite("host")) {
  // The softmax-mass kernel's fold of one KV head's rows, serially, from the same functions it
  // calls (row_weight, mass_clamp, row_mass_factor), against the host aggregation on scores
  // with empty (-inf), overflowed (+inf) and NaN entries.
  namespace od = oasiskv::cuda::detail;
  std::mt19937 rng(67);
  std::uniform_real_distribution<float> score(-40.0f, 40.0f), weight(0.0f, 2.0f);
  const std::uint32_t n = 37;
  const float scale = 0.125f;
  for (const std::uint32_t group : {1u, 4u}) {
    for (const std::uint32_t tokens : {1u, 3u, 16u}) {
      CAPTURE(group);
      CAPTURE(tokens);
      const std::uint32_t rows = tokens * group;
      std::vector<float> raw(std::size_t{rows} * n);
      for (float& x : raw) {
        x = score(rng);
      }
      raw[3] = -INFINITY;
      raw[n + 5] = INFINITY;
      raw[std::size_t{rows - 1} * n + 7] = std::numeric_limits<float>::quiet_NaN();
      std::vector<float> w(tokens);
      for (float& x : w) {
        x = weight(rng);
      }
      if (tokens > 1) {
        w[tokens / 2] = 0.0f;  // a dropped token (its rows skipped by the kernel)
      }
      for (const bool weighted : {true, false}) {
        CAPTURE(weighted);
        const float* wp = weighted ? w.data() : nullptr;
        std::vector<float> device(n, 0.0f), host(n, 0.0f);
        for (std::uint32_t r = 0; r < rows; ++r) {
          const float wr = od::row_weight(wp, tokens, 0, r, group);
          if (wr == 0.0f) {
            continue;
          }
          std::vector<float> x(n);
          float m = -FLT_MAX;
          for (std::uint32_t i = 0; i < n; ++i) {
            x[i] = od::mass_clamp(raw[std::size_t{r} * n + i]);
            m = std::max(m, x[i]);
          }
          float sum = 0.0f;
          for (std::uint32_t i = 0; i < n; ++i) {
            x[i] = std::exp(scale * (x[i] - m));
            sum += x[i];
          }
          const float k = od::row_mass_factor(wr, sum);
          for (std::uint32_t i = 0; i < n; ++i) {
            device[i] += k * x[i];
          }
        }
        oasiskv::confidence_weighted_aggregation agg;
        const oasiskv::aggregation_context c{n, rows, group, scale, wp};
        agg.combine(c, raw.data(), host.data(), true);
        double total = 0.0;
        for (std::uint32_t r = 0; r < rows; ++r) {
          total += wp == nullptr ? 1.0 : wp[r / group];
        }
        REQUIRE(total > 0.0);
        double got_total = 0.0;
        for (std::uint32_t i = 0; i < n; ++i) {
          CAPTURE(i);
          REQUIRE(std::isfinite(device[i]));
          REQUIRE(std::isfinite(host[i]));
          CHECK(!(std::abs(device[i] - host[i]) > 1e-5 * total));
          got_total += device[i];
        }
        // Each row gives its weight's worth of mass.
        CHECK(!(std::abs(got_total - total) > 1e-4 * total));
      }
    }
  }
}

TEST_CASE("topk_selector weights: the weighted device cases' inputs (on the CPU)" *
          doctest::test_suite("host")) {
  // What the device cases below rely on, checked where there is no device: their inputs exist
  // (a clear cut, weights that change the host's selection, a dropped token that alone would
  // pick other blocks) and the host predictor with a zero weight selects as if the token were
  // not there.
  for (const std::uint32_t d : {64u, 128u}) {
    for (const bool per_head : {false, true}) {
      CAPTURE(d);
      CAPTURE(per_head);
      auto check = [&]<class Setup>() {
        CAPTURE(quantized<Setup>);
        const auto x = make_weighted<Setup>(d, per_head);
        REQUIRE(x.st != nullptr);
        CHECK(x.expect.size() == x.st->num_seqs * (per_head ? x.st->l.num_kv_heads : 1u));
        const auto z = make_zero<Setup>(d, per_head);
        REQUIRE(z.st != nullptr);
        CHECK(cpu_select<confidence_weighted_aggregation>(*z.st, z.q, 2, weighted_sp, per_head,
                                                          &z.w) == z.expect);
        CHECK(cpu_select<softmax_mass_aggregation>(*z.st, z.q, 2, weighted_sp, per_head) !=
              z.expect);
      };
      check.template operator()<mass_setup>();
      check.template operator()<qmass_setup>();
    }
  }
}

namespace {

// The device counterpart of the host case above, over `Setup`'s summary (shared and per-KV-head
// tables, head_dim 64 and 128).
template <class Setup>
void weighted_device_case() {
  using agg = oc::selection_aggregation;
  for (const std::uint32_t d : {64u, 128u}) {
    for (const bool per_head : {false, true}) {
      CAPTURE(d);
      CAPTURE(per_head);
      CAPTURE(quantized<Setup>);
      {
        // Weighted: the CPU predictor's tables with confidence_weighted_aggregation.
        const auto x = make_weighted<Setup>(d, per_head);
        REQUIRE(x.st != nullptr);
        const auto ds = device_summary_of(*x.st);
        const auto weighted = make_selector(per_head, agg::confidence_weighted);
        const gpu_tables got = gpu_select(weighted, *x.st, ds, x.q, x.tokens, &x.w);
        check_tables(got, x.expect);

        // Weights all 1 give the bits of no weights, and of the unweighted softmax mass.
        const std::vector<float> ones(x.w.size(), 1.0f);
        const gpu_tables one = gpu_select(weighted, *x.st, ds, x.q, x.tokens, &ones);
        const gpu_tables none = gpu_select(weighted, *x.st, ds, x.q, x.tokens, nullptr);
        const gpu_tables mass = gpu_select(make_selector(per_head, agg::softmax_mass), *x.st, ds,
                                           x.q, x.tokens, nullptr);
        CHECK(one.refs == none.refs);
        CHECK(one.offsets == none.offsets);
        CHECK(none.refs == mass.refs);
        CHECK(none.offsets == mass.offsets);
        // Plain softmax mass reads no weights (as the host's softmax_mass_aggregation).
        const gpu_tables ignored =
            gpu_select(make_selector(per_head, agg::softmax_mass), *x.st, ds, x.q, x.tokens, &x.w);
        CHECK(ignored.refs == mass.refs);
      }
      {
        // A zero weight removes its token: the tables of the kept token alone, not those the
        // dropped token alone picks.
        const auto z = make_zero<Setup>(d, per_head);
        REQUIRE(z.st != nullptr);
        const auto ds = device_summary_of(*z.st);
        const auto weighted = make_selector(per_head, agg::confidence_weighted);
        const gpu_tables got = gpu_select(weighted, *z.st, ds, z.q, 2, &z.w);
        check_tables(got, z.expect);

        // Negative and non-finite weights count as 0, and check_status names the first.
        std::vector<float> bad = z.w;
        bad[0 * 2 + 1] = std::numeric_limits<float>::quiet_NaN();  // sequence 0 drops token 1
        bad[1 * 2 + 0] = -1.0f;                                    // sequence 1 drops token 0
        bad[2 * 2 + 1] = std::numeric_limits<float>::infinity();
        const gpu_tables zeroed = gpu_select(weighted, *z.st, ds, z.q, 2, &bad, false);
        check_tables(zeroed, z.expect);
        oasiskv::errc code{};
        const std::string what = error_of([&] { weighted.check_status(); }, code);
        CHECK(code == oasiskv::errc::invalid_argument);
        CHECK_MESSAGE(what.find("topk_request.weights[0][1]") != std::string::npos, what);
        code = oasiskv::errc{};
        CHECK(error_of([&] { weighted.check_status(); }, code).empty());  // cleared

        // Checked whatever the aggregation, as the host checks every query_view.
        const auto max_sel = make_selector(per_head, agg::max);
        (void)gpu_select(max_sel, *z.st, ds, z.q, 2, &bad, false);
        const std::string max_what = error_of([&] { max_sel.check_status(); }, code);
        CHECK(code == oasiskv::errc::invalid_argument);
        CHECK_MESSAGE(max_what.find("topk_request.weights[0][1]") != std::string::npos, max_what);
      }
    }
  }
}

}  // namespace

TEST_CASE("cuda::topk_selector confidence-weighted selects what the CPU predictor selects") {
  oasiskv::testing::require_cuda_device_or_skip();
  weighted_device_case<mass_setup>();
}

TEST_CASE("cuda::topk_selector confidence-weighted over int8 bounds: the CPU's selection") {
  oasiskv::testing::require_cuda_device_or_skip();
  weighted_device_case<qmass_setup>();
}
