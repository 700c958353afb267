// SPDX-License-Identifier: Apache-2.0
// The facade assembled from CUDA policies, end to end on the GPU: blocks staged from pinned host
// memory into device memory by cuda::copy_engine, appended tokens written through to staged
// copies and the audit read back by cuda::device_tier's write_slot / read_slot, attention by
// cuda::sparse_decode over tables the cache builds on the host (queries and outputs in device
// memory). Every step's output is checked against reference_decode over the capacity tier's
// copies of the blocks it attended, with a budget covering the context (then: all of them) and
// with one far smaller than it; a fork's copy-on-write and the audit likewise.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/cuda_support.cuh"
#include "oasiskv/allocator/free_list_allocator.hpp"
#include "oasiskv/attention/reference_decode.hpp"
#include "oasiskv/cuda/cuda.cuh"
#include "support/expect_error.hpp"
#include "support/kv_fixture.hpp"
// The predictor's host scoring loops carry `#pragma GCC unroll`, unknown to nvcc's front end.
#pragma nv_diag_suppress 1675
#include "oasiskv/kv_cache.hpp"
#include "oasiskv/predictor/lookahead_predictor.hpp"
#include "oasiskv/summary/minmax_summary.hpp"
#pragma nv_diag_default 1675

namespace {

using namespace oasiskv;
using oasiskv::testing::device_buffer;
using oasiskv::testing::expect_error;
using oasiskv::testing::max_rel_error;

struct gpu_policies {
  using allocator = free_list_allocator;
  using fast_tier = oasiskv::cuda::device_tier;
  using slow_tier = oasiskv::cuda::pinned_host_tier;
  using transfer = oasiskv::cuda::copy_engine;
  using predictor = lookahead_predictor<minmax_summary<>>;
  using scheduler = lookahead_prefetcher<lru_eviction>;
  using kernel = oasiskv::cuda::sparse_decode;
};
static_assert(check_policy_bundle<gpu_policies>);
static_assert(tiered_kv_cache<gpu_policies>::host_table_kernel);
static_assert(slot_io_tier<oasiskv::cuda::device_tier>);

using gpu_cache = tiered_kv_cache<gpu_policies>;

const kv_layout layout{2, 8, 2, 64, 16, dtype::bf16};
constexpr float scale = 0.125f;
constexpr double tolerance = 2e-3;  // bf16 KV: f32 accumulation in another order than the CPU's

std::vector<bf16> random_rows(std::uint32_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<bf16> rows(std::size_t{n} * layout.num_kv_heads * layout.head_dim);
  for (bf16& x : rows) {
    x = bf16::from_float(u(rng));
  }
  return rows;
}

void append_random(gpu_cache& c, sequence_id s, std::uint32_t n, std::mt19937& rng) {
  for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
    auto k = random_rows(n, rng), v = random_rows(n, rng);
    c.append(s, l, k.data(), v.data(), n);
  }
}

// reference_decode over the capacity tier's copies (pinned host memory, the authoritative ones)
// of the blocks `attended` names.
void reference(gpu_cache& c, sequence_id s, std::uint32_t l, const attended_blocks& attended,
               const std::vector<float>& q, std::vector<float>& out, std::vector<float>& lse) {
  const auto slots = c.block_slots(s, l);
  std::vector<block_ref> refs;
  for (std::uint32_t b : attended.blocks) {
    refs.push_back({slots[b], b});
  }
  const std::uint32_t len = c.length(s, l);
  out.assign(q.size(), 0.0f);
  lse.assign(layout.num_q_heads, 0.0f);
  reference_decode{}.decode({q.data(),
                             c.capacity_tier().view(),
                             {refs.data(), attended.offsets.data(), 1, attended.tables_per_seq},
                             &len,
                             out.data(),
                             lse.data(),
                             1,
                             1,
                             scale});
}

attended_blocks all_blocks(std::size_t n) {
  attended_blocks a;
  for (std::uint32_t b = 0; b < n; ++b) {
    a.blocks.push_back(b);
  }
  a.offsets = {0, static_cast<std::uint32_t>(n)};
  a.tables_per_seq = 1;
  return a;
}

// One decode step of (s, l) on the GPU: lookahead (host queries), attend (device queries and
// outputs), and the outputs against the reference. Returns the blocks the tables read.
std::size_t step(gpu_cache& c, sequence_id s, std::uint32_t l, bool dense, std::mt19937& rng) {
  const std::size_t row = std::size_t{layout.num_q_heads} * layout.head_dim;
  const std::vector<float> draft = oasiskv::testing::random_floats(row, rng, -2.0f, 2.0f);
  c.lookahead(s, l, {draft.data(), nullptr, 1});
  const std::vector<float> q = oasiskv::testing::random_floats(row, rng, -2.0f, 2.0f);
  device_buffer<float> dq(q), dout(row), dlse(layout.num_q_heads);
  attended_blocks attended;
  const sequence_id seqs[1] = {s};
  c.attend(seqs, l, dq.get(), 1, dout.get(), dlse.get(), &attended);
  const std::vector<float> out = dout.download(), lse = dlse.download();
  std::vector<float> ref, ref_lse;
  reference(c, s, l, attended, q, ref, ref_lse);
  CHECK(max_rel_error(out, ref) <= tolerance);
  CHECK(max_rel_error(lse, ref_lse) <= tolerance);
  const std::size_t blocks = c.block_slots(s, l).size();
  if (dense) {
    CHECK(attended.blocks.size() == blocks);
    reference(c, s, l, all_blocks(blocks), q, ref, ref_lse);
    CHECK(max_rel_error(out, ref) <= tolerance);
  } else {
    CHECK(attended.blocks.size() < blocks);
  }
  return attended.blocks.size();
}

void run(std::uint32_t budget_tokens, bool dense) {
  std::mt19937 rng(9);
  gpu_cache cache(oasiskv::cuda::pinned_host_tier(layout, 256),
                  oasiskv::cuda::device_tier(layout, 96),
                  {.budget_tokens = budget_tokens, .scale = scale});
  const sequence_id s = cache.add_sequence();
  append_random(cache, s, 300, rng);  // 19 blocks, the last one partial
  for (int i = 0; i < 3; ++i) {
    append_random(cache, s, 1, rng);  // written through to the staged partial block
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      step(cache, s, l, dense, rng);
    }
  }
  CHECK(cache.stats().sequence_steps == 3 * layout.num_layers);

  // Copy-on-write of the shared partial block (303 tokens: 15 in the last one) for the child.
  const sequence_id child = cache.fork(s);
  const std::size_t last = cache.block_slots(s, 0).size() - 1;
  append_random(cache, child, 3, rng);
  CHECK(cache.block_slots(child, 0)[last - 1] == cache.block_slots(s, 0)[last - 1]);  // shared
  CHECK(cache.block_slots(child, 0)[last] != cache.block_slots(s, 0)[last]);          // copied
  for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
    step(cache, child, l, dense, rng);
    step(cache, s, l, dense, rng);
  }

  // The audit reads the staged copies back from the device and compares them...
  const std::size_t compared = cache.audit();
  CHECK(compared > 0);
  // ... for real: one corrupted byte of a staged copy is found.
  slot_id x = null_slot, f = null_slot;
  for (slot_id b : cache.block_slots(s, 0)) {
    if (cache.scheduler().is_ready(b)) {
      x = b;
      f = *cache.scheduler().resident_slot(b);
      break;
    }
  }
  REQUIRE(x != null_slot);
  std::byte* byte = cache.fast_tier().slot_data(f) + 5;  // device memory: the test's back door
  std::byte saved{};
  oasiskv::testing::copy_to_host(&saved, byte, 1);
  const std::byte flipped = ~saved;
  oasiskv::testing::copy_to_device(byte, &flipped, 1);
  expect_error([&] { cache.audit(); }, errc::invalid_argument,
               "staged copy of capacity slot " + std::to_string(x));
  oasiskv::testing::copy_to_device(byte, &saved, 1);
  CHECK(cache.audit() == compared);
}

}  // namespace

TEST_CASE("tiered_kv_cache on the GPU: a budget covering the context equals dense attention") {
  oasiskv::testing::require_cuda_device_or_skip();
  run(1024, true);
}

TEST_CASE("tiered_kv_cache on the GPU: a budget smaller than the context equals the reference") {
  oasiskv::testing::require_cuda_device_or_skip();
  run(64, false);
}

TEST_CASE("tiered_kv_cache on the GPU: a batched append queues the write-through, waits once") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(10);
  gpu_cache cache(oasiskv::cuda::pinned_host_tier(layout, 256),
                  oasiskv::cuda::device_tier(layout, 160), {.budget_tokens = 32, .scale = scale});
  std::vector<sequence_id> ids;
  for (int i = 0; i < 3; ++i) {
    ids.push_back(cache.add_sequence());
    append_random(cache, ids.back(), 40 + 7 * static_cast<std::uint32_t>(i), rng);
  }
  for (int i = 0; i < 20; ++i) {  // across block boundaries: new blocks staged on the way
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      const auto k = random_rows(static_cast<std::uint32_t>(ids.size()), rng);
      const auto v = random_rows(static_cast<std::uint32_t>(ids.size()), rng);
      cache.append(ids, l, k.data(), v.data(), 1);
    }
  }
  for (std::size_t i = 0; i < ids.size(); ++i) {
    CHECK(cache.length(ids[i], 0) == 60 + 7 * i);
    for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
      step(cache, ids[i], l, false, rng);  // against the reference over the capacity tier
    }
  }
  CHECK(cache.audit() > 0);  // every staged copy, written through in batches, is exact
}

TEST_CASE("cuda::device_tier: write_slot and read_slot copy part of a slot, checked") {
  oasiskv::testing::require_cuda_device_or_skip();
  const std::size_t bb = layout.block_bytes();
  auto check_tier = [&](oasiskv::cuda::device_tier& t) {
    std::vector<std::byte> in(bb), out(bb), zeros(bb);
    for (std::size_t i = 0; i < bb; ++i) {
      in[i] = static_cast<std::byte>(i * 7 + 1);
    }
    t.write_slot(1, 0, in.data(), bb);
    t.write_slot(1, 100, in.data(), 50);
    std::vector<std::byte> want = in;
    std::memcpy(want.data() + 100, in.data(), 50);
    t.read_slot(1, 0, out.data(), bb);
    CHECK(out == want);
    std::vector<std::byte> part(10);
    t.read_slot(1, 105, part.data(), part.size());
    CHECK(std::memcmp(part.data(), want.data() + 105, part.size()) == 0);
    for (slot_id s : {0u, 2u}) {  // the neighbours stay zero
      t.read_slot(s, 0, out.data(), bb);
      CHECK(out == zeros);
    }
    expect_error([&] { t.write_slot(3, 0, in.data(), 1); }, errc::invalid_slot, "slot 3");
    expect_error([&] { t.write_slot(0, bb - 1, in.data(), 2); }, errc::out_of_range,
                 "pass the block's " + std::to_string(bb));
    expect_error([&] { t.read_slot(0, bb + 1, out.data(), 0); }, errc::out_of_range,
                 "bytes [" + std::to_string(bb + 1));
    expect_error([&] { t.write_slot(0, 0, nullptr, 1); }, errc::invalid_argument,
                 "null host buffer");
  };
  oasiskv::cuda::device_tier own(layout, 3, {.zero = true});
  CHECK(own.stream() != nullptr);
  check_tier(own);
  oasiskv::testing::stream_guard stream;
  {
    oasiskv::cuda::device_tier given(layout, 3, {.zero = true, .stream = stream});
    CHECK(given.stream() == stream);
    check_tier(given);
    oasiskv::cuda::device_tier moved(std::move(given));  // the stream goes with the slots
    CHECK(moved.stream() == stream);
  }
  stream.destroy();  // the tier did not own it
}

TEST_CASE("cuda::device_tier: zeroing at construction is finished before the tier's first write") {
  oasiskv::testing::require_cuda_device_or_skip();
  // The zeroing must not wait behind the legacy stream's work and land after a write on the
  // tier's own (non-blocking) stream.
  const std::size_t bb = layout.block_bytes();
  oasiskv::testing::busy_legacy_stream(200'000'000);
  oasiskv::cuda::device_tier t(layout, 2, {.zero = true});
  const std::vector<std::byte> in(bb, std::byte{0x11});
  t.write_slot(1, 0, in.data(), bb);
  OASISKV_CUDA_CHECK(cudaDeviceSynchronize());  // the legacy stream's work is done too
  std::vector<std::byte> out(bb);
  t.read_slot(1, 0, out.data(), bb);
  CHECK(out == in);
  t.read_slot(0, 0, out.data(), bb);
  CHECK(out == std::vector<std::byte>(bb));
}
