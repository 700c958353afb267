// SPDX-License-Identifier: Apache-2.0
// The core headers in device code: dtype conversions and pool views give on the GPU exactly what
// they give on the host. And the tests' own setup helpers (cuda_support.cuh): what they write is
// there for a kernel on a non-blocking stream, however busy the legacy stream is.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cuda/cuda_support.cuh"
#include "oasiskv/core/decode_params.hpp"
#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/views.hpp"

namespace {

__global__ void convert_all_halves(std::uint16_t* f16_roundtrip, std::uint16_t* bf16_roundtrip) {
  const std::uint32_t b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b > 0xffff) {
    return;
  }
  const auto h = oasiskv::f16{static_cast<std::uint16_t>(b)};
  f16_roundtrip[b] = oasiskv::f16::from_float(h.to_float() * 0.5f).bits;
  const auto v = oasiskv::bf16{static_cast<std::uint16_t>(b)};
  bf16_roundtrip[b] = oasiskv::bf16::from_float(v.to_float() * 3.0f).bits;
}

// Sums one head's keys of every slot through the view's accessors.
__global__ void sum_keys(oasiskv::block_pool_view pool, std::uint32_t head, float* sums) {
  const oasiskv::slot_id s = blockIdx.x;
  const oasiskv::f16* k = pool.keys<oasiskv::f16>(s, head);
  float acc = 0.0f;
  for (std::uint32_t i = 0; i < pool.layout.tokens_per_block * pool.layout.head_dim; ++i) {
    acc += oasiskv::to_float(k[i]);
  }
  sums[s] = acc;
}

__global__ void copy_words(const std::uint32_t* from, std::uint32_t* to, std::uint32_t n) {
  for (std::uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += gridDim.x * blockDim.x) {
    to[i] = from[i];
  }
}

}  // namespace

TEST_CASE("device: dtype conversions match the host bit for bit") {
  oasiskv::testing::require_cuda_device_or_skip();
  oasiskv::testing::device_buffer<std::uint16_t> d_f16(65536), d_bf16(65536);
  convert_all_halves<<<256, 256>>>(d_f16.get(), d_bf16.get());
  OASISKV_CUDA_CHECK(cudaGetLastError());
  const std::vector<std::uint16_t> f16s = d_f16.download(), bf16s = d_bf16.download();
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const auto h = oasiskv::f16{static_cast<std::uint16_t>(b)};
    const auto v = oasiskv::bf16{static_cast<std::uint16_t>(b)};
    REQUIRE(f16s[b] == oasiskv::f16::from_float(h.to_float() * 0.5f).bits);
    REQUIRE(bf16s[b] == oasiskv::bf16::from_float(v.to_float() * 3.0f).bits);
  }
}

TEST_CASE("device: block_pool_view addresses the same bytes as on the host") {
  oasiskv::testing::require_cuda_device_or_skip();
  const oasiskv::kv_layout l{1, 4, 2, 16, 4, oasiskv::dtype::f16};
  const std::uint32_t slots = 5;
  std::vector<oasiskv::f16> host(slots * l.block_bytes() / 2);
  for (std::size_t i = 0; i < host.size(); ++i) {
    host[i] = oasiskv::f16::from_float(static_cast<float>(i % 7) - 3.0f);
  }
  const oasiskv::testing::device_buffer<oasiskv::f16> d_pool(host);
  oasiskv::testing::device_buffer<float> d_sums(slots);
  const oasiskv::block_pool_view dev{reinterpret_cast<std::byte*>(d_pool.get()), l.block_bytes(),
                                     slots, l};
  sum_keys<<<slots, 1>>>(dev, 1, d_sums.get());
  const std::vector<float> sums = d_sums.download();
  const oasiskv::block_pool_view hv{reinterpret_cast<std::byte*>(host.data()), l.block_bytes(),
                                    slots, l};
  for (oasiskv::slot_id s = 0; s < slots; ++s) {
    float expect = 0.0f;
    const oasiskv::f16* k = hv.keys<oasiskv::f16>(s, 1);
    for (std::uint32_t i = 0; i < l.tokens_per_block * l.head_dim; ++i) {
      expect += k[i].to_float();
    }
    CHECK(sums[s] == expect);
  }
}

TEST_CASE("test setup: fills and uploads are complete before a non-blocking stream runs") {
  oasiskv::testing::require_cuda_device_or_skip();
  // A cudaMemset queued behind 200 ms of work on the legacy stream would still be pending when
  // a kernel on a non-blocking stream reads the buffer, unless the helper waits for it.
  constexpr std::uint32_t n = 1 << 16;
  oasiskv::testing::device_buffer<std::uint32_t> src(n), dst(n);
  src.fill(0);
  oasiskv::testing::stream_guard s;
  oasiskv::testing::busy_legacy_stream(200'000'000);
  src.fill(0x5a);
  copy_words<<<64, 256, 0, s>>>(src.get(), dst.get(), n);
  OASISKV_CUDA_CHECK(cudaGetLastError());
  OASISKV_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<std::uint32_t> got = dst.download();
  CHECK(std::count(got.begin(), got.end(), 0x5a5a5a5au) == n);
  // The same for an upload from pageable memory.
  oasiskv::testing::busy_legacy_stream(200'000'000);
  src.upload(std::vector<std::uint32_t>(n, 7u));
  copy_words<<<64, 256, 0, s>>>(src.get(), dst.get(), n);
  OASISKV_CUDA_CHECK(cudaStreamSynchronize(s));
  got = dst.download();
  CHECK(std::count(got.begin(), got.end(), 7u) == n);
  s.destroy();
}
