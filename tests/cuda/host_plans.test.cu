// SPDX-License-Identifier: Apache-2.0
// The host halves of the CUDA path that decide what the device does, run with no device:
// cuda::sparse_decode's splits from the table size, cuda::flashinfer_decode's split plan and the
// buffers it needs (a split plan without its workspace ran FlashInfer's unsplit kernel on the split
// grid, writing past its output), the CUDA benchmark's targets read back from its rows (the
// copy-engine ratio was read from a variable the loop never set), and the registration flags of
// cuda::pinned_host_tier (the gather kernels read it through the host pointer, so it must be
// mapped).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda_bench_report.hpp"
#include "oasiskv/attention/cuda/detail/decode_kernels.cuh"
#include "oasiskv/attention/cuda/detail/flashinfer_plan.cuh"
#include "oasiskv/tier/cuda/pinned_host_tier.cuh"

namespace {

namespace od = oasiskv::cuda::detail;
namespace ob = oasiskv::bench;

std::vector<std::int32_t> indptr_of(const std::vector<std::int32_t>& pages) {
  std::vector<std::int32_t> v{0};
  for (const std::int32_t p : pages) {
    v.push_back(v.back() + p);
  }
  return v;
}

// What every plan must be, split or not: each request's tiles in order, covering its pages in
// chunks; unsplit, one tile per request and no workspace (FlashInfer then runs its unsplit
// kernel, which writes output row `tile`); split, a workspace for every tile's partial output
// and log-sum-exp.
void check_plan(const od::flashinfer_split_plan& p, const std::vector<std::int32_t>& indptr,
                std::uint32_t heads, std::uint32_t dim) {
  const std::size_t requests = indptr.size() - 1;
  REQUIRE(p.o_indptr.size() == requests + 1);
  REQUIRE(p.request.size() == p.tile.size());
  CHECK(p.o_indptr.front() == 0);
  CHECK(static_cast<std::uint32_t>(p.o_indptr.back()) == p.tiles());
  for (std::size_t r = 0; r < requests; ++r) {
    CAPTURE(r);
    const std::int32_t pages = indptr[r + 1] - indptr[r];
    const std::int32_t first = p.o_indptr[r], last = p.o_indptr[r + 1];
    REQUIRE(last > first);  // every request has a tile, an empty one too (it writes its row)
    for (std::int32_t t = first; t < last; ++t) {
      CHECK(p.request[t] == static_cast<std::int32_t>(r));
      CHECK(p.tile[t] == t - first);
      if (p.split) {  // tile t covers pages [tile * chunk, ...): not past the request's end
        CHECK((pages == 0 || p.tile[t] * static_cast<std::int64_t>(p.chunk_pages) < pages));
      }
    }
    if (p.split) {
      const std::int64_t tiles = last - first;
      CHECK(tiles == std::max<std::int64_t>(1, (pages + p.chunk_pages - 1) / p.chunk_pages));
    }
  }
  const od::flashinfer_split_workspace w = od::split_workspace(p, heads, dim);
  if (!p.split) {
    CHECK(p.tiles() == requests);
    CHECK(w.bytes == 0);
  } else {
    CHECK(p.tiles() > requests);
    const std::size_t rows = std::size_t{p.tiles()} * heads;
    CHECK(w.lse_offset >= rows * dim * sizeof(float));  // partial outputs (as FlashInfer sizes)
    CHECK(w.lse_offset % 16 == 0);
    CHECK(w.bytes >= w.lse_offset + rows * sizeof(float));  // partial log-sum-exps
  }
}

// The least chunk of at least max(128 / page, 1) pages whose tiles x heads fit the grid, by
// trying every one: what FlashInfer's binary search finds.
std::uint32_t least_chunk(const std::vector<std::int32_t>& pages, std::uint32_t heads,
                          std::uint32_t grid, std::uint32_t page) {
  const std::int32_t most = *std::max_element(pages.begin(), pages.end());
  for (std::uint32_t c = std::max(128 / page, 1u); c < static_cast<std::uint32_t>(most); ++c) {
    std::uint64_t tiles = 0;
    for (const std::int32_t p : pages) {
      tiles += (static_cast<std::uint64_t>(p) + c - 1) / c;
    }
    if (tiles * heads <= grid) {
      return c;
    }
  }
  return static_cast<std::uint32_t>(std::max(most, static_cast<std::int32_t>(128 / page)));
}

}  // namespace

TEST_CASE("flashinfer split plan: the test's 14-page requests split, with a workspace per tile") {
  // tests/cuda/flashinfer_decode.test.cu, q_len 1: three sequences of 2 sink, 4 recent and 8
  // middle blocks of 16 tokens, 2 KV heads; an H100 resides hundreds of FlashInfer's CTAs.
  const auto indptr = indptr_of({14, 14, 14});
  for (const std::uint32_t group : {1u, 4u, 8u}) {
    const od::flashinfer_split_plan p = od::plan_flashinfer_split(132 * 8, 2, indptr, 16, true);
    CHECK(p.split);
    CHECK(p.chunk_pages == 8);  // FlashInfer's least chunk: 128 / 16 pages
    CHECK(p.request == std::vector<std::int32_t>{0, 0, 1, 1, 2, 2});
    CHECK(p.tile == std::vector<std::int32_t>{0, 1, 0, 1, 0, 1});
    CHECK(p.o_indptr == std::vector<std::int32_t>{0, 2, 4, 6});
    check_plan(p, indptr, 2 * group, 128);
    // The buffers: six tiles x the query heads of partial outputs and log-sum-exps, and lists
    // with room for six tiles (the unsplit sizes would hold three).
    const od::flashinfer_list_layout at = od::make_list_layout(42, 3, p, 2 * group, 128);
    CHECK(at.split);
    CHECK(at.tiles == 6);
    CHECK(at.workspace.bytes == (std::size_t{6} * 2 * group * 128 * 4 + 15) / 16 * 16 +
                                    (6 * 2 * group * 4 + 15) / 16 * 16);
    CHECK(at.tile - at.request >= 6);
    CHECK(at.o_indptr - at.tile >= 6);
  }
  // q_len 3 with 7-token blocks: pages of 18 or more per chunk, 14 pages fit in one: no split.
  const od::flashinfer_split_plan q3 = od::plan_flashinfer_split(132 * 8, 2, indptr, 7, true);
  CHECK(!q3.split);
  check_plan(q3, indptr, 8, 64);
  // flashinfer_split::never: one tile per request whatever the grid.
  const od::flashinfer_split_plan never = od::plan_flashinfer_split(132 * 8, 2, indptr, 16, false);
  CHECK(!never.split);
  CHECK(never.request == std::vector<std::int32_t>{0, 1, 2});
  check_plan(never, indptr, 8, 128);
}

TEST_CASE("flashinfer split plan: the benchmark's batches split too (budget 2048 of 32k)") {
  // 128 pages of 16 tokens per request, 8 KV heads (Llama-3-8B).
  for (const std::uint32_t batch : {1u, 32u}) {
    CAPTURE(batch);
    const std::vector<std::int32_t> pages(batch, 128);
    const auto indptr = indptr_of(pages);
    const od::flashinfer_split_plan p = od::plan_flashinfer_split(132 * 8, 8, indptr, 16, true);
    CHECK(p.split);
    CHECK(p.chunk_pages == least_chunk(pages, 8, 132 * 8, 16));
    CHECK(p.chunk_pages == (batch == 1 ? 8u : 32u));
    CHECK(std::uint64_t{p.tiles()} * 8 <= 132 * 8);
    check_plan(p, indptr, 32, 128);
  }
  // Requests x KV heads that fill the grid on their own: never split.
  const auto full = indptr_of(std::vector<std::int32_t>(132, 128));
  const od::flashinfer_split_plan p = od::plan_flashinfer_split(132 * 8, 8, full, 16, true);
  CHECK(!p.split);
  check_plan(p, full, 32, 128);
}

TEST_CASE("flashinfer split plan: random batches, empty requests, every page size") {
  std::mt19937 rng(45);
  for (int trial = 0; trial < 2000; ++trial) {
    std::uniform_int_distribution<std::int32_t> n(1, 40), len(0, 300);
    std::vector<std::int32_t> pages(static_cast<std::size_t>(n(rng)));
    for (std::int32_t& p : pages) {
      p = trial % 7 == 0 ? 0 : len(rng);  // all empty sometimes
    }
    const std::uint32_t heads = 1u << (trial % 4);
    const std::uint32_t page = 1u + static_cast<std::uint32_t>(trial % 32);
    const std::uint32_t grid = 16u * (1u + static_cast<std::uint32_t>(trial % 200));
    const auto indptr = indptr_of(pages);
    CAPTURE(trial);
    const od::flashinfer_split_plan p = od::plan_flashinfer_split(grid, heads, indptr, page, true);
    check_plan(p, indptr, heads * 4, 64);
    if (p.split) {
      CHECK(p.chunk_pages == least_chunk(pages, heads, grid, page));
    }
    const od::flashinfer_list_layout at =
        od::make_list_layout(static_cast<std::size_t>(indptr.back()), pages.size(), p, heads, 64);
    // The arrays follow each other, 16-byte aligned, each with its room.
    const std::size_t offs[] = {at.indices, at.indptr,   at.last_page_len, at.request,
                                at.tile,    at.o_indptr, at.chunk,         at.total};
    const std::size_t sizes[] = {static_cast<std::size_t>(indptr.back()),
                                 pages.size() + 1,
                                 pages.size(),
                                 p.tiles(),
                                 p.tiles(),
                                 pages.size() + 1,
                                 1};
    for (std::size_t i = 0; i + 1 < std::size(offs); ++i) {
      CHECK(offs[i] % 4 == 0);
      CHECK(offs[i + 1] >= offs[i] + sizes[i]);
    }
    CHECK(at.workspace.bytes == od::split_workspace(p, heads, 64).bytes);
  }
}

TEST_CASE("sparse_decode's splits: the multiprocessors, and the table size when known") {
  // An H100: 132 SMs. Llama-3-8B's shape (8 KV heads, one row chunk at q_len 1), budget 2048
  // tokens = 128 blocks.
  const std::uint32_t sms = 132;
  // Batch 1: 8 CTAs before splitting; about 4 per SM wanted, at most 32 splits of 4 blocks.
  CHECK(od::choose_decode_splits(sms, 8, 128, 0, 32) == 32);
  CHECK(od::choose_decode_splits(sms, 8, 0, 0, 32) == 32);
  // Batch 32: 256 CTAs fill most of the machine already.
  CHECK(od::choose_decode_splits(sms, 256, 128, 0, 32) == 3);
  // A small selection caps the splits: 16 blocks give at most 4 splits of 4 blocks.
  CHECK(od::choose_decode_splits(sms, 8, 16, 0, 32) == 4);
  CHECK(od::choose_decode_splits(sms, 8, 3, 0, 32) == 1);  // under one split's worth: one
  // A fixed count wins, within [1, max_splits].
  CHECK(od::choose_decode_splits(sms, 8, 16, 7, 32) == 7);
  CHECK(od::choose_decode_splits(sms, 8, 16, 64, 32) == 32);
  // Never zero, whatever the inputs.
  CHECK(od::choose_decode_splits(0, 0, 0, 0, 0) == 1);
  for (std::uint32_t expected = 1; expected < 300; ++expected) {
    for (const std::uint64_t ctas : {1ull, 8ull, 64ull, 512ull, 4096ull}) {
      const std::uint32_t s = od::choose_decode_splits(sms, ctas, expected, 0, 32);
      CHECK(s >= 1);
      CHECK(s <= 32);
      CHECK((s == 1 || s * od::min_blocks_per_split <= expected));
      CHECK((s == 32 || s * ctas >= 4 * sms || s * od::min_blocks_per_split + 4 > expected));
    }
  }
}

TEST_CASE("pinned_host_tier registers its memory mapped, for the kernels that read it") {
  static_assert((oasiskv::cuda::pinned_host_tier::register_flags & cudaHostRegisterMapped) != 0);
  static_assert((oasiskv::cuda::pinned_host_tier::register_flags & cudaHostRegisterPortable) != 0);
  CHECK((oasiskv::cuda::pinned_host_tier::register_flags & cudaHostRegisterMapped) != 0);
}

namespace {

ob::row decode_row(double seqs, double q_len, double ratio) {
  ob::row r{"sparse_decode", {}};
  r.num("num_seqs", seqs)
      .num("q_len", q_len)
      .num("budget_tokens", 2048)
      .num("context", 32768)
      .num("ratio_to_read_probe", ratio);
  return r;
}

const ob::target& find(const std::vector<ob::target>& ts, const std::string& name) {
  const auto it =
      std::find_if(ts.begin(), ts.end(), [&](const ob::target& t) { return t.name == name; });
  REQUIRE(it != ts.end());
  return *it;
}

// Braces and brackets balance outside strings, and no NaN or inf appears: what a JSON parser
// needs of the benchmark's output.
bool json_balanced(const std::string& s) {
  std::vector<char> stack;
  bool in_string = false;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      stack.push_back(c);
    } else if (c == '}' || c == ']') {
      if (stack.empty() || stack.back() != (c == '}' ? '{' : '[')) {
        return false;
      }
      stack.pop_back();
    }
  }
  for (const char* bad : {": nan", ": -nan", ": inf", ": -inf"}) {
    if (s.find(bad) != std::string::npos) {
      return false;
    }
  }
  return stack.empty() && !in_string;
}

}  // namespace

TEST_CASE("CUDA benchmark report: each target is read from the row that measured it") {
  std::vector<ob::row> rows;
  rows.push_back(decode_row(1, 4, 0.10));
  rows.push_back(decode_row(1, 1, 0.65));
  rows.push_back(decode_row(32, 4, 0.20));
  rows.push_back(decode_row(32, 1, 0.82));
  // The copy engine's rows: every path at 64 KiB and 8 KiB blocks. The target is the automatic
  // path at 64 KiB, whichever order the rows came in.
  for (const double bytes : {65536.0, 8192.0}) {
    for (const char* path : {"automatic", "gather_kernel", "batch_memcpy"}) {
      ob::row r{"copy_engine", {}};
      r.str("path", path)
          .num("block_bytes", bytes)
          .num("ratio_to_pinned_memcpy",
               bytes == 65536.0 && std::string(path) == "automatic" ? 0.91 : 0.5);
      rows.push_back(r);
    }
  }
  ob::row sel{"selection", {}};
  sel.num("num_seqs", 32).str("summary", "f16").num("over_sparse_decode", 0.5);
  rows.push_back(sel);
  ob::row qsel{"selection", {}};
  qsel.num("num_seqs", 32).str("summary", "int8").num("over_sparse_decode", 0.25);
  rows.push_back(qsel);
  ob::row facade{"facade_step", {}};
  facade.num("num_seqs", 8).num("ratio", 1.10);
  rows.push_back(facade);

  const std::vector<ob::target> ts = ob::evaluate(rows, ob::cuda_bench_rules());
  const ob::target& copy = find(ts, "copy_engine_over_pinned_memcpy");
  CHECK(copy.measured);
  CHECK(copy.value == 0.91);
  CHECK(copy.pass());
  CHECK(find(ts, "sparse_decode_batch32_over_read_probe").value == 0.82);
  CHECK(find(ts, "sparse_decode_batch32_over_read_probe").pass());
  CHECK(find(ts, "sparse_decode_batch1_over_read_probe").value == 0.65);
  CHECK(find(ts, "sparse_decode_batch1_over_read_probe").pass());
  CHECK(find(ts, "selection_over_sparse_decode").value == 0.25);
  CHECK(find(ts, "selection_over_sparse_decode").pass());
  const ob::target& f = find(ts, "facade_step_tiered_over_resident");
  CHECK(f.measured);
  CHECK(!f.pass());  // 1.10 > 1.05
  const ob::target& fi = find(ts, "sparse_decode_over_flashinfer");
  CHECK(!fi.measured);  // no FlashInfer row: not measured, and not a pass
  CHECK(!fi.pass());

  const std::string json = ob::report_json(rows, ts);
  CHECK(json_balanced(json));
  CHECK(json.find("\"targets_met\": 4") != std::string::npos);
  CHECK(json.find("\"targets_measured\": 5") != std::string::npos);
  CHECK(json.find("\"name\": \"sparse_decode_over_flashinfer\"") != std::string::npos);
  CHECK(json.find("\"pass\": null") != std::string::npos);
}

TEST_CASE("CUDA benchmark report: JSON of awkward figures and names") {
  ob::row r{"odd \"row\"\n", {}};
  r.num("nan", std::numeric_limits<double>::quiet_NaN())
      .num("inf", std::numeric_limits<double>::infinity())
      .str("gpu", "NVIDIA H100 80GB HBM3")
      .flag("gated", false);
  const std::string s = ob::to_json(r);
  CHECK(s ==
        "{\"name\": \"odd \\\"row\\\"\\u000a\", \"nan\": null, \"inf\": null, \"gpu\": \"NVIDIA "
        "H100 80GB HBM3\", \"gated\": false}");
  // A target whose row holds no finite figure is not measured.
  ob::row facade{"facade_step", {}};
  facade.num("num_seqs", 8).num("ratio", std::numeric_limits<double>::quiet_NaN());
  const auto ts = ob::evaluate({facade}, ob::cuda_bench_rules());
  CHECK(!find(ts, "facade_step_tiered_over_resident").measured);
}
