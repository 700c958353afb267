// SPDX-License-Identifier: Apache-2.0
// cuda::device_tier, cuda::pinned_host_tier and cuda::copy_engine: the concepts they model, and
// on a device, byte-exact scattered copies through both paths, the validation before any copy,
// and a gather captured in a CUDA graph.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/cuda_support.cuh"
#include "oasiskv/allocator/free_list_allocator.hpp"
#include "oasiskv/concepts/policy_bundle.hpp"
#include "oasiskv/cuda/cuda.cuh"
#include "oasiskv/predictor/lookahead_predictor.hpp"
#include "oasiskv/scheduler/staging_scheduler.hpp"

namespace {

using oasiskv::block_copy;
using oasiskv::errc;
using oasiskv::testing::error_code_of;
namespace oc = oasiskv::cuda;

struct cuda_policies {
  using allocator = oasiskv::free_list_allocator;
  using fast_tier = oc::device_tier;
  using slow_tier = oc::pinned_host_tier;
  using transfer = oc::copy_engine;
  using summary = oasiskv::minmax_summary<>;
  using predictor = oasiskv::lookahead_predictor<summary>;
  using scheduler = oasiskv::lookahead_prefetcher<oasiskv::lru_eviction>;
  using kernel = oc::sparse_decode;
};
static_assert(oasiskv::check_policy_bundle<cuda_policies>);
static_assert(oasiskv::transfer_engine<oc::copy_engine, oc::pinned_host_tier, oc::device_tier>);
static_assert(oasiskv::transfer_engine<oc::copy_engine, oasiskv::host_tier, oc::device_tier>);
static_assert(
    oasiskv::scheduler_policy<cuda_policies::scheduler, oc::device_tier, oc::pinned_host_tier,
                              oc::copy_engine, oasiskv::free_list_allocator>);
static_assert(oc::pinned_host_tier::memory == oasiskv::memory_kind::pinned_host);
static_assert(oc::device_tier::memory == oasiskv::memory_kind::device);

void fill_random(oc::pinned_host_tier& t, std::mt19937& rng) {
  for (oasiskv::slot_id s = 0; s < t.num_slots(); ++s) {
    auto* p = reinterpret_cast<std::uint32_t*>(t.slot_data(s));
    for (std::size_t i = 0; i < t.layout().block_bytes() / 4; ++i) {
      p[i] = static_cast<std::uint32_t>(rng());
    }
  }
}

// Copies the device tier back and checks every copied slot byte for byte, and that the slots
// no copy wrote still hold their poison.
void expect_copied(const oc::pinned_host_tier& src, const oc::device_tier& dst,
                   const std::vector<block_copy>& copies) {
  const std::size_t bb = src.layout().block_bytes();
  std::vector<std::byte> back(dst.bytes());
  oasiskv::testing::copy_to_host(back.data(), dst.slot_data(0), dst.bytes());
  std::vector<bool> written(dst.num_slots(), false);
  for (const block_copy& c : copies) {
    written[c.dst] = true;
    REQUIRE(std::memcmp(back.data() + std::size_t{c.dst} * dst.slot_bytes(), src.slot_data(c.src),
                        bb) == 0);
  }
  for (oasiskv::slot_id s = 0; s < dst.num_slots(); ++s) {
    if (!written[s]) {
      CHECK(back[std::size_t{s} * dst.slot_bytes()] == std::byte{0xa5});
    }
  }
}

std::vector<block_copy> scattered(std::uint32_t n, std::uint32_t src_slots, std::uint32_t dst_slots,
                                  std::mt19937& rng) {
  std::vector<std::uint32_t> s = oasiskv::testing::iota(src_slots),
                             d = oasiskv::testing::iota(dst_slots);
  std::shuffle(s.begin(), s.end(), rng);
  std::shuffle(d.begin(), d.end(), rng);
  std::vector<block_copy> c(n);
  for (std::uint32_t i = 0; i < n; ++i) {
    c[i] = {s[i], d[i]};
  }
  // A run of consecutive slots too, so the memcpy path coalesces across it.
  if (n >= 8) {
    for (std::uint32_t i = 0; i < 4; ++i) {
      c[i] = {src_slots - 4 + i, dst_slots - 4 + i};
    }
  }
  return c;
}

}  // namespace

TEST_CASE("cuda::copy_engine: scattered blocks arrive byte-exact through both paths") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(7);
  for (const auto layout :
       {oasiskv::kv_layout{1, 8, 2, 64, 16, oasiskv::dtype::f16},        // 8 KiB
        oasiskv::kv_layout{1, 32, 8, 128, 16, oasiskv::dtype::bf16}}) {  // 64 KiB
    for (const auto path :
         {oc::copy_engine::copy_path::gather_kernel, oc::copy_engine::copy_path::batch_memcpy,
          oc::copy_engine::copy_path::automatic}) {
      CAPTURE(layout.block_bytes());
      CAPTURE(static_cast<int>(path));
      oc::pinned_host_tier_options po;
      po.register_chunk_bytes = layout.block_bytes() * 7;  // several registrations
      oc::pinned_host_tier src(layout, 64, po);
      CHECK(src.registrations() == (64 + 6) / 7);
      fill_random(src, rng);
      oc::device_tier dst(layout, 48);
      oasiskv::testing::fill_device(dst.slot_data(0), 0xa5, dst.bytes());
      oc::copy_engine::options o;
      o.path = path;
      oc::copy_engine engine(o);
      const auto copies = scattered(40, src.num_slots(), dst.num_slots(), rng);
      const auto t = engine.submit(src, dst, copies);
      engine.wait(t);
      CHECK(engine.test(t));
      expect_copied(src, dst, copies);
      const auto st = engine.stats();
      CHECK(st.blocks == copies.size());
      CHECK(st.bytes == copies.size() * layout.block_bytes());
      CHECK(st.failed_batches == 0);
    }
  }
}

TEST_CASE("cuda::copy_engine: a bad batch throws before anything moves") {
  oasiskv::testing::require_cuda_device_or_skip();
  const oasiskv::kv_layout l{1, 4, 2, 64, 16, oasiskv::dtype::f16};
  oc::pinned_host_tier src(l, 8);
  oc::device_tier dst(l, 8);
  oc::copy_engine engine;
  const std::vector<block_copy> bad_src{{8, 0}};
  const std::vector<block_copy> bad_dst{{0, 8}};
  const std::vector<block_copy> twice{{0, 1}, {2, 1}};
  CHECK(error_code_of([&] { engine.submit(src, dst, bad_src); }) == errc::invalid_slot);
  CHECK(error_code_of([&] { engine.submit(src, dst, bad_dst); }) == errc::invalid_slot);
  CHECK(error_code_of([&] { engine.submit(src, dst, twice); }) == errc::invalid_argument);
  oc::device_tier other(oasiskv::kv_layout{1, 4, 2, 128, 16, oasiskv::dtype::f16}, 8);
  const std::vector<block_copy> one{{0, 0}};
  CHECK(error_code_of([&] { engine.submit(src, other, one); }) == errc::layout_mismatch);
  CHECK(error_code_of([&] { engine.wait(oc::copy_engine::ticket{99}); }) == errc::unknown_ticket);
  // Pageable host memory: the device cannot read it asynchronously.
  oasiskv::host_tier pageable(l, 8);
  CHECK(error_code_of([&] { engine.submit(pageable, dst, one); }) == errc::unsupported);
  // A host_tier pinned through its hook is accepted.
  oasiskv::host_tier_options ho;
  ho.pin = [](void* p, std::size_t n) {
    OASISKV_CUDA_CHECK(cudaHostRegister(p, n, cudaHostRegisterMapped));
  };
  ho.unpin = [](void* p, std::size_t) {
    (void)cudaHostUnregister(p);
  };
  oasiskv::host_tier pinned(l, 8, ho);
  std::memset(pinned.slot_data(3), 0x3c, l.block_bytes());
  const std::vector<block_copy> c{{3, 5}};
  engine.wait(engine.submit(pinned, dst, c));
  std::vector<std::byte> back(l.block_bytes());
  oasiskv::testing::copy_to_host(back.data(), dst.slot_data(5), back.size());
  CHECK(std::memcmp(back.data(), pinned.slot_data(3), back.size()) == 0);
  CHECK(engine.stats().batches == 1);
}

TEST_CASE("cuda::enqueue_gather: captured in a CUDA graph, replayed with device-written lists") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(11);
  const oasiskv::kv_layout l{1, 8, 2, 64, 16, oasiskv::dtype::bf16};
  oc::pinned_host_tier src(l, 32);
  fill_random(src, rng);
  oc::device_tier dst(l, 32);
  constexpr std::uint32_t max_count = 16;
  oasiskv::testing::device_buffer<uint2> pairs(max_count);
  oasiskv::testing::device_buffer<std::uint32_t> count(1);
  oasiskv::testing::stream_guard s;
  oc::gather_args a;
  a.src = src.view().base;
  a.src_stride = src.slot_bytes();
  a.dst = dst.view().base;
  a.dst_stride = dst.slot_bytes();
  a.block_bytes = l.block_bytes();
  a.pairs = pairs.get();
  a.count = count.get();
  a.max_count = max_count;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  OASISKV_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  oc::enqueue_gather(a, 4, s);
  OASISKV_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  OASISKV_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (std::uint32_t n : {5u, 16u, 0u, 9u}) {
    oasiskv::testing::fill_device(dst.slot_data(0), 0xa5, dst.bytes());
    const auto copies = scattered(n, src.num_slots(), dst.num_slots(), rng);
    std::vector<uint2> list(max_count, make_uint2(0, 0));
    for (std::uint32_t i = 0; i < n; ++i) {
      list[i] = make_uint2(copies[i].src, copies[i].dst);
    }
    pairs.upload(list);
    count.upload({n});
    OASISKV_CUDA_CHECK(cudaGraphLaunch(exec, s));
    OASISKV_CUDA_CHECK(cudaStreamSynchronize(s));
    expect_copied(src, dst, copies);
  }
  // cudaMemcpyBatchAsync cannot be captured: the engine says so instead of dropping the copies.
  oc::copy_engine::options o;
  o.path = oc::copy_engine::copy_path::batch_memcpy;
  oc::copy_engine engine(o);
  cudaGraph_t g2 = nullptr;
  OASISKV_CUDA_CHECK(cudaStreamBeginCapture(engine.stream(), cudaStreamCaptureModeRelaxed));
  const std::vector<block_copy> one{{1, 2}};
  const errc e = error_code_of([&] { engine.submit(src, dst, one); });
  (void)cudaStreamEndCapture(engine.stream(), &g2);
  (void)cudaGetLastError();
  CHECK(e == errc::unsupported);
  if (g2 != nullptr) {
    (void)cudaGraphDestroy(g2);
  }
  OASISKV_CUDA_CHECK(cudaGraphExecDestroy(exec));
  OASISKV_CUDA_CHECK(cudaGraphDestroy(graph));
  s.destroy();
}

TEST_CASE("cuda tiers: slots, views and bad arguments") {
  oasiskv::testing::require_cuda_device_or_skip();
  const oasiskv::kv_layout l{2, 4, 2, 64, 16, oasiskv::dtype::f16};
  oc::device_tier d(l, 10);
  CHECK(d.slot_bytes() % 128 == 0);
  CHECK(d.slot_bytes() >= l.block_bytes());
  CHECK(d.view().num_slots == 10);
  CHECK(d.slot_data(9) == d.view().base + 9 * d.slot_bytes());
  CHECK(error_code_of([&] { (void)d.slot_data(10); }) == errc::invalid_slot);
  CHECK(error_code_of([&] { oc::device_tier z(l, 0); }) == errc::invalid_argument);
  oc::device_tier moved = std::move(d);
  CHECK(moved.num_slots() == 10);
  oc::pinned_host_tier p(l, 10);
  CHECK(p.registrations() == 1);
  p.slot_data(9)[0] = std::byte{1};  // host-accessible
  CHECK(oasiskv::cuda::detail::query_pointer(p.slot_data(0)).kind ==
        oasiskv::cuda::detail::pointer_kind::pinned_host);
  // The allocation hook (e.g. a cuda::mr resource behind a lambda) replaces cudaMalloc.
  int allocations = 0;
  oc::device_tier_options o;
  o.allocate = [&](std::size_t n) {
    ++allocations;
    void* m = nullptr;
    OASISKV_CUDA_CHECK(cudaMalloc(&m, n));
    return m;
  };
  o.deallocate = [&](void* m, std::size_t) {
    --allocations;
    (void)cudaFree(m);
  };
  {
    oc::device_tier h(l, 4, o);
    CHECK(allocations == 1);
  }
  CHECK(allocations == 0);
}

TEST_CASE("cuda::pinned_host_tier: every registration is mapped at the host's addresses") {
  oasiskv::testing::require_cuda_device_or_skip();
  // The gather kernels read the capacity tier through its host pointers: each registration must
  // be mapped into the device's address space (cudaHostRegisterMapped), at the same address
  // where the device says it can use host pointers.
  const oasiskv::kv_layout l{1, 8, 2, 64, 16, oasiskv::dtype::f16};
  oc::pinned_host_tier_options po;
  po.register_chunk_bytes = l.block_bytes() * 5;
  oc::pinned_host_tier t(l, 12, po);
  REQUIRE(t.registrations() == 3);
  int device = 0, same_address = 0;
  OASISKV_CUDA_CHECK(cudaGetDevice(&device));
  OASISKV_CUDA_CHECK(
      cudaDeviceGetAttribute(&same_address, cudaDevAttrCanUseHostPointerForRegisteredMem, device));
  for (oasiskv::slot_id s = 0; s < t.num_slots(); s += t.slots_per_chunk()) {
    CAPTURE(s);
    void* host = t.slot_data(s);
    void* dev = nullptr;
    OASISKV_CUDA_CHECK(cudaHostGetDevicePointer(&dev, host, 0));
    if (same_address != 0) {
      CHECK(dev == host);
      CHECK(oc::detail::query_pointer(host).device_address == host);
    }
  }
}
