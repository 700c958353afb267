// SPDX-License-Identifier: Apache-2.0
// cuda::sparse_decode against reference_decode: dtypes, head dims, GQA groups, 1-16 causal query
// tokens, shared and per-head tables, one split and several; and the checks before any launch.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/cuda_support.cuh"
#include "oasiskv/attention/reference_decode.hpp"
#include "oasiskv/cuda/cuda.cuh"

namespace {

using oasiskv::block_ref;
using oasiskv::errc;
using oasiskv::testing::error_code_of;
namespace oc = oasiskv::cuda;

// A batch on the host (for the reference) and its copy on the device.
struct problem {
  oasiskv::kv_layout layout;
  std::uint32_t num_seqs, q_len, tables_per_seq;
  std::vector<std::byte> pool;  // [slots][block_bytes]
  std::uint32_t slots = 0;
  std::vector<float> q;
  std::vector<block_ref> refs;
  std::vector<std::uint32_t> offsets, lens;

  problem(const oasiskv::kv_layout& l, std::uint32_t seqs, std::uint32_t qlen, bool per_head,
          std::mt19937& rng)
      : layout(l), num_seqs(seqs), q_len(qlen), tables_per_seq(per_head ? l.num_kv_heads : 1) {
    std::uniform_int_distribution<std::uint32_t> len_dist(qlen, 40 * l.tokens_per_block);
    offsets.push_back(0);
    for (std::uint32_t s = 0; s < seqs; ++s) {
      const std::uint32_t len = len_dist(rng);
      lens.push_back(len);
      const std::uint32_t blocks = l.blocks_for(len);
      for (std::uint32_t t = 0; t < tables_per_seq; ++t) {
        // A random subset of the blocks, always with the last one (it holds the new tokens),
        // in a shuffled order: the kernel must not depend on ascending tables.
        std::vector<std::uint32_t> idx = oasiskv::testing::iota(blocks);
        std::shuffle(idx.begin(), idx.end() - 1, rng);
        const std::uint32_t keep = std::max(1u, blocks / 2);
        std::vector<std::uint32_t> chosen(idx.end() - keep, idx.end());
        std::shuffle(chosen.begin(), chosen.end(), rng);
        for (std::uint32_t b : chosen) {
          refs.push_back({slots++, b});
        }
        offsets.push_back(static_cast<std::uint32_t>(refs.size()));
      }
    }
    // Slots in a shuffled order across the pool: scattered reads.
    oasiskv::testing::scatter_and_fill_decode_batch(*this, rng);
  }

  oasiskv::decode_params host_params(float* out, float* lse) const {
    return oasiskv::testing::host_decode_params(*this, tables_per_seq, out, lse);
  }
};

using device_problem = oasiskv::testing::device_decode_problem<problem>;

void compare(const problem& h, const device_problem& d) {
  std::vector<float> ref_out(h.q.size()), ref_lse(h.q.size() / h.layout.head_dim);
  oasiskv::reference_decode{}.decode(h.host_params(ref_out.data(), ref_lse.data()));
  const auto out = d.out.download();
  const auto lse = d.lse.download();
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    REQUIRE(std::isfinite(out[i]));
    num += (double{out[i]} - ref_out[i]) * (double{out[i]} - ref_out[i]);
    den += double{ref_out[i]} * ref_out[i];
  }
  // f32 accumulation over exactly stored f16/bf16/f32 inputs: far under 1e-3.
  CHECK(std::sqrt(num / den) < 1e-4);
  for (std::size_t i = 0; i < lse.size(); ++i) {
    REQUIRE(std::isfinite(lse[i]));
    CHECK(std::abs(lse[i] - ref_lse[i]) < 1e-3f * std::max(1.0f, std::abs(ref_lse[i])));
  }
}

// The device outputs against the reference where tables may be empty: such rows must be exactly
// out 0 and lse -inf (the reference's), the others as `compare` requires.
void compare_with_empty(const problem& reference_input, const device_problem& d) {
  const problem& h = reference_input;
  std::vector<float> ref_out(h.q.size()), ref_lse(h.q.size() / h.layout.head_dim);
  oasiskv::reference_decode{}.decode(h.host_params(ref_out.data(), ref_lse.data()));
  const auto out = d.out.download();
  const auto lse = d.lse.download();
  const std::uint32_t dim = h.layout.head_dim;
  double num = 0.0, den = 0.0;
  for (std::size_t row = 0; row < lse.size(); ++row) {
    CAPTURE(row);
    if (std::isinf(ref_lse[row])) {
      CHECK(lse[row] == ref_lse[row]);
      for (std::uint32_t x = 0; x < dim; ++x) {
        REQUIRE(out[row * dim + x] == 0.0f);
      }
      continue;
    }
    REQUIRE(std::isfinite(lse[row]));
    CHECK(std::abs(lse[row] - ref_lse[row]) < 1e-3f * std::max(1.0f, std::abs(ref_lse[row])));
    for (std::uint32_t x = 0; x < dim; ++x) {
      const std::size_t i = row * dim + x;
      REQUIRE(std::isfinite(out[i]));
      num += (double{out[i]} - ref_out[i]) * (double{out[i]} - ref_out[i]);
      den += double{ref_out[i]} * ref_out[i];
    }
  }
  CHECK(std::sqrt(num / den) < 1e-4);
}

// `h` without its null_slot entries (which the kernels skip and the reference refuses).
problem without_null_slots(const problem& h) {
  problem w = h;
  w.refs.clear();
  w.offsets.assign(1, 0);
  for (std::size_t t = 0; t + 1 < h.offsets.size(); ++t) {
    for (std::uint32_t i = h.offsets[t]; i < h.offsets[t + 1]; ++i) {
      if (h.refs[i].slot != oasiskv::null_slot) {
        w.refs.push_back(h.refs[i]);
      }
    }
    w.offsets.push_back(static_cast<std::uint32_t>(w.refs.size()));
  }
  return w;
}

}  // namespace

TEST_CASE("cuda::sparse_decode matches reference_decode") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(2024);
  for (const auto dt : {oasiskv::dtype::bf16, oasiskv::dtype::f16, oasiskv::dtype::f32}) {
    for (const std::uint32_t d : {64u, 128u}) {
      for (const std::uint32_t group : {1u, 4u, 5u}) {
        for (const std::uint32_t q_len : {1u, 3u, 16u}) {
          for (const bool per_head : {false, true}) {
            for (const std::uint32_t splits : {1u, 3u}) {
              const std::uint32_t tpb = q_len == 3 ? 7 : 16;  // partial blocks of odd sizes too
              const oasiskv::kv_layout l{1, 2 * group, 2, d, tpb, dt};
              CAPTURE(oasiskv::to_string(dt));
              CAPTURE(d);
              CAPTURE(group);
              CAPTURE(q_len);
              CAPTURE(per_head);
              CAPTURE(splits);
              const problem h(l, 3, q_len, per_head, rng);
              device_problem dev(h);
              for (const bool pipelined : {false, true}) {  // direct loads, cp.async pipeline
                CAPTURE(pipelined);
                dev.out.fill(0xff);
                dev.lse.fill(0xff);
                oc::sparse_decode_options o;
                o.num_splits = splits;
                o.check_tables = true;
                o.pipelined = pipelined;
                oc::sparse_decode k(o);
                k.decode(dev.p);
                compare(h, dev);
              }
            }
          }
        }
      }
    }
  }
}

TEST_CASE("cuda::sparse_decode: automatic splits and asynchronous mode on a larger batch") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(99);
  const oasiskv::kv_layout l{1, 32, 8, 128, 16, oasiskv::dtype::bf16};
  const problem h(l, 4, 1, false, rng);
  device_problem dev(h);
  for (const bool pipelined : {false, true}) {
    CAPTURE(pipelined);
    dev.out.fill(0xff);
    oc::sparse_decode_options o;
    o.asynchronous = true;
    o.pipelined = pipelined;
    oc::sparse_decode k(o);
    CHECK(k.splits_for(4, 1, l) > 1);
    k.decode(dev.p);
    k.check_device_status();
    compare(h, dev);
  }
}

TEST_CASE("cuda::sparse_decode: bad input raises before any launch") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(5);
  const oasiskv::kv_layout l{1, 8, 2, 64, 16, oasiskv::dtype::f16};
  problem h(l, 2, 1, false, rng);
  device_problem dev(h);
  oc::sparse_decode k;
  auto with = [&](auto change) {
    oasiskv::decode_params p = dev.p;
    change(p);
    return error_code_of([&] { k.decode(p); });
  };
  std::vector<float> host_out(h.q.size());
  CHECK(with([&](auto& p) { p.q = h.q.data(); }) == errc::invalid_argument);  // host pointer
  CHECK(with([&](auto& p) { p.out = host_out.data(); }) == errc::invalid_argument);
  CHECK(with([&](auto& p) { p.table.refs = h.refs.data(); }) == errc::invalid_argument);
  CHECK(with([&](auto& p) { p.seq_lens = h.lens.data(); }) == errc::invalid_argument);
  CHECK(with([&](auto& p) { p.pool.base = const_cast<std::byte*>(h.pool.data()); }) ==
        errc::invalid_argument);
  CHECK(with([&](auto& p) { p.q_len = 17; }) == errc::invalid_argument);
  CHECK(with([&](auto& p) { p.table.num_seqs = 3; }) == errc::invalid_argument);
  CHECK(with([&](auto& p) { p.table.tables_per_seq = 3; }) == errc::invalid_argument);
  CHECK(with([&](auto& p) { p.pool.layout.head_dim = 96; }) == errc::layout_mismatch);
  CHECK(with([&](auto& p) { p.pool.slot_stride = 8; }) == errc::layout_mismatch);
  CHECK(with([&](auto& p) { p.q = p.q + 1; }) == errc::misaligned);
  // A table entry outside the pool: caught by check_tables before the launch, or by the kernel.
  std::vector<block_ref> bad = h.refs;
  bad[0].slot = h.slots + 3;
  dev.refs.upload(bad);
  oc::sparse_decode_options checked;
  checked.check_tables = true;
  CHECK(error_code_of([&] { oc::sparse_decode(checked).decode(dev.p); }) == errc::invalid_slot);
  CHECK(error_code_of([&] { k.decode(dev.p); }) == errc::invalid_slot);
  dev.refs.upload(h.refs);
  k.decode(dev.p);  // the status was cleared: a good table runs again
  compare(h, dev);
}

TEST_CASE("cuda::sparse_decode: the first call's status clear is done before its kernel runs") {
  oasiskv::testing::require_cuda_device_or_skip();
  // A fresh kernel object clears its device status word; queued behind the legacy stream's work
  // while the decode runs on a non-blocking stream, the clear would erase the bad entry the
  // kernel reports.
  std::mt19937 rng(8);
  const oasiskv::kv_layout l{1, 8, 2, 64, 16, oasiskv::dtype::f16};
  problem h(l, 2, 1, false, rng);
  h.refs[0].slot = h.slots + 3;  // outside the pool: the kernel skips it and reports it
  device_problem dev(h);
  oasiskv::testing::stream_guard s;
  for (const bool pipelined : {false, true}) {  // both kernels report the bad entry
    CAPTURE(pipelined);
    oc::sparse_decode_options o;
    o.stream = s;
    o.asynchronous = true;
    o.pipelined = pipelined;
    oc::sparse_decode k(o);
    oasiskv::testing::busy_legacy_stream(200'000'000);
    k.decode(dev.p);
    OASISKV_CUDA_CHECK(cudaDeviceSynchronize());
    CHECK(error_code_of([&] { k.check_device_status(); }) == errc::invalid_slot);
  }
  s.destroy();
}

TEST_CASE("cuda::sparse_decode: q_len 16 with GQA group 8 (16 row chunks of 8 rows)") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(1608);
  for (const auto dt : {oasiskv::dtype::bf16, oasiskv::dtype::f16}) {
    for (const bool per_head : {false, true}) {
      for (const std::uint32_t splits : {1u, 3u}) {
        CAPTURE(oasiskv::to_string(dt));
        CAPTURE(per_head);
        CAPTURE(splits);
        const oasiskv::kv_layout l{1, 16, 2, 128, 16, dt};
        const problem h(l, 3, 16, per_head, rng);
        device_problem dev(h);
        for (const bool pipelined : {false, true}) {
          CAPTURE(pipelined);
          dev.out.fill(0xff);
          oc::sparse_decode_options o;
          o.num_splits = splits;
          o.check_tables = true;
          o.pipelined = pipelined;
          oc::sparse_decode(o).decode(dev.p);
          compare(h, dev);
        }
      }
    }
  }
}

TEST_CASE("cuda::sparse_decode: empty tables and null slots give the reference's rows") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(404);
  for (const bool per_head : {false, true}) {
    for (const std::uint32_t splits : {1u, 4u}) {
      const bool pipelined = splits == 4;  // each path over empty and null entries
      CAPTURE(per_head);
      CAPTURE(splits);
      CAPTURE(pipelined);
      const oasiskv::kv_layout l{1, 8, 2, 64, 16, oasiskv::dtype::bf16};
      problem h(l, 4, 2, per_head, rng);
      // Sequence 0: every table empty. Sequence 1: every entry a null slot (dropped blocks).
      // Sequence 2: every other entry a null slot. Sequence 3 as drawn.
      const std::uint32_t tps = h.tables_per_seq;
      std::vector<block_ref> refs;
      std::vector<std::uint32_t> offsets{0};
      for (std::uint32_t t = 0; t < 4 * tps; ++t) {
        const std::uint32_t s = t / tps;
        for (std::uint32_t i = h.offsets[t]; i < h.offsets[t + 1]; ++i) {
          block_ref r = h.refs[i];
          if (s == 0) {
            continue;
          }
          if (s == 1 || (s == 2 && i % 2 == 0)) {
            r.slot = oasiskv::null_slot;
          }
          refs.push_back(r);
        }
        offsets.push_back(static_cast<std::uint32_t>(refs.size()));
      }
      h.refs = refs;
      h.offsets = offsets;
      device_problem dev(h);
      oc::sparse_decode_options o;
      o.num_splits = splits;
      o.pipelined = pipelined;
      oc::sparse_decode k(o);
      k.decode(dev.p);  // synchronous: a skipped entry other than a null slot would throw
      compare_with_empty(without_null_slots(h), dev);
      // The same through decode_host_tables (host tables uploaded by the kernel).
      dev.out.fill(0xff);
      dev.lse.fill(0xff);
      oasiskv::decode_params hp = dev.p;
      hp.table.refs = h.refs.data();
      hp.table.offsets = h.offsets.data();
      hp.seq_lens = h.lens.data();
      k.decode_host_tables(hp);
      compare_with_empty(without_null_slots(h), dev);
    }
  }
}

namespace {

// Llama-3-8B's attention shape over a 32k context, `seqs` sequences each selecting `budget`
// blocks: 2 sinks, the 4 last blocks, the rest random; the values drawn cheaply (a hash).
problem long_context(std::uint32_t seqs, std::uint32_t q_len, std::uint32_t budget,
                     std::mt19937& rng) {
  const oasiskv::kv_layout l{1, 32, 8, 128, 16, oasiskv::dtype::bf16};
  problem h(l, 1, q_len, false, rng);  // shapes only: everything is redrawn below
  h.num_seqs = seqs;
  h.refs.clear();
  h.offsets.assign(1, 0);
  h.lens.clear();
  const std::uint32_t blocks = 32768 / l.tokens_per_block;
  h.slots = seqs * budget;
  std::vector<std::uint32_t> perm = oasiskv::testing::iota(h.slots);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (std::uint32_t s = 0; s < seqs; ++s) {
    h.lens.push_back(32768 - s % 5);  // partial last blocks too
    std::vector<std::uint32_t> mid(blocks - 6);
    std::iota(mid.begin(), mid.end(), 2u);
    std::shuffle(mid.begin(), mid.end(), rng);
    std::vector<std::uint32_t> chosen{0, 1, blocks - 4, blocks - 3, blocks - 2, blocks - 1};
    chosen.insert(chosen.end(), mid.begin(), mid.begin() + (budget - 6));
    std::shuffle(chosen.begin(), chosen.end(), rng);
    for (const std::uint32_t b : chosen) {
      h.refs.push_back({perm[h.refs.size()], b});
    }
    h.offsets.push_back(static_cast<std::uint32_t>(h.refs.size()));
  }
  h.pool.assign(std::size_t{h.slots} * l.block_bytes(), std::byte{0});
  auto* p = reinterpret_cast<oasiskv::bf16*>(h.pool.data());
  const std::size_t n = h.pool.size() / sizeof(oasiskv::bf16);
  std::uint64_t x = rng();
  for (std::size_t i = 0; i < n; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    p[i] = oasiskv::bf16::from_float(static_cast<float>((x >> 40) & 0xffff) / 16384.0f - 2.0f);
  }
  h.q =
      oasiskv::testing::random_floats(std::size_t{seqs} * q_len * l.num_q_heads * l.head_dim, rng);
  return h;
}

}  // namespace

TEST_CASE("cuda::sparse_decode: 32 sequences of a 32k context, budget 2048 (the benchmark's)") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(32768);
  for (const std::uint32_t q_len : {1u, 4u}) {
    CAPTURE(q_len);
    const problem h = long_context(32, q_len, 128, rng);
    device_problem dev(h);
    for (const bool pipelined : {false, true}) {
      CAPTURE(pipelined);
      dev.out.fill(0xff);
      oc::sparse_decode_options o;
      o.asynchronous = true;  // as the benchmark runs it: automatic splits, no host wait
      o.check_pointers = false;
      o.expected_blocks = 128;
      o.pipelined = pipelined;
      oc::sparse_decode k(o);
      k.decode(dev.p);
      k.check_device_status();
      compare(h, dev);
    }
  }
}
