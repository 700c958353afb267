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
using oasiskv::testing::device_buffer;
namespace oc = oasiskv::cuda;

template <class E>
errc error_code_of(E&& f) {
  try {
    f();
  } catch (const oasiskv::error& e) {
    return e.code();
  }
  return errc{};
}

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
        std::vector<std::uint32_t> idx(blocks);
        std::iota(idx.begin(), idx.end(), 0u);
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
    std::vector<std::uint32_t> perm(slots);
    std::iota(perm.begin(), perm.end(), 0u);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (block_ref& r : refs) {
      r.slot = perm[r.slot];
    }
    const auto elems = std::size_t{slots} * l.block_bytes() / l.elem_bytes();
    pool.resize(std::size_t{slots} * l.block_bytes());
    const auto values = oasiskv::testing::random_floats(elems, rng, -2.0f, 2.0f);
    oasiskv::visit_dtype(l.kv_dtype, [&](auto e) {
      using T = decltype(e);
      auto* p = reinterpret_cast<T*>(pool.data());
      for (std::size_t i = 0; i < elems; ++i) {
        p[i] = oasiskv::from_float<T>(values[i]);
      }
    });
    q = oasiskv::testing::random_floats(std::size_t{seqs} * qlen * l.num_q_heads * l.head_dim, rng);
  }

  oasiskv::decode_params host_params(float* out, float* lse) const {
    oasiskv::decode_params p;
    p.q = q.data();
    p.pool = {const_cast<std::byte*>(pool.data()), layout.block_bytes(), slots, layout};
    p.table = {refs.data(), offsets.data(), num_seqs, tables_per_seq};
    p.seq_lens = lens.data();
    p.out = out;
    p.lse = lse;
    p.num_seqs = num_seqs;
    p.q_len = q_len;
    p.scale = 1.0f / std::sqrt(static_cast<float>(layout.head_dim));
    return p;
  }
};

struct device_problem {
  device_buffer<std::byte> pool;
  device_buffer<float> q, out, lse;
  device_buffer<block_ref> refs;
  device_buffer<std::uint32_t> offsets, lens;
  oasiskv::decode_params p;

  explicit device_problem(const problem& h)
      : pool(h.pool),
        q(h.q),
        out(h.q.size()),
        lse(h.q.size() / h.layout.head_dim),
        refs(h.refs),
        offsets(h.offsets),
        lens(h.lens) {
    p = h.host_params(out.get(), lse.get());
    p.q = q.get();
    p.pool.base = pool.get();
    p.table.refs = refs.get();
    p.table.offsets = offsets.get();
    p.seq_lens = lens.get();
    // Poison: every element must be written.
    OASISKV_CUDA_CHECK(cudaMemset(out.get(), 0xff, out.size() * sizeof(float)));
    OASISKV_CUDA_CHECK(cudaMemset(lse.get(), 0xff, lse.size() * sizeof(float)));
  }
};

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
              oc::sparse_decode_options o;
              o.num_splits = splits;
              o.check_tables = true;
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

TEST_CASE("cuda::sparse_decode: automatic splits and asynchronous mode on a larger batch") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(99);
  const oasiskv::kv_layout l{1, 32, 8, 128, 16, oasiskv::dtype::bf16};
  const problem h(l, 4, 1, false, rng);
  device_problem dev(h);
  oc::sparse_decode_options o;
  o.asynchronous = true;
  oc::sparse_decode k(o);
  CHECK(k.splits_for(4, 1, l) > 1);
  k.decode(dev.p);
  k.check_device_status();
  compare(h, dev);
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
