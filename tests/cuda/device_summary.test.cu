// SPDX-License-Identifier: Apache-2.0
// cuda::device_minmax_summary's device-side update, recompute and reset against the host
// minmax_summary<f16> fed the same keys: the bounds must be the same bits (f16 and bf16 keys,
// partial and full blocks, several entries), and bad input must throw before any launch.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/cuda_support.cuh"
#include "oasiskv/cuda/cuda.cuh"

namespace {

using oasiskv::errc;
using oasiskv::testing::device_buffer;
namespace oc = oasiskv::cuda;

template <class E>
errc error_code_of(E&& f, std::string* what = nullptr) {
  try {
    f();
  } catch (const oasiskv::error& e) {
    if (what != nullptr) {
      *what = e.what();
    }
    return e.code();
  }
  return errc{};
}

// Random keys in [-3, 3), with values that exercise the outward rounding of bf16 keys into f16
// bounds: beyond the f16 range (infinite bounds), below its subnormals, and signed zeros.
float key_value(std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  std::uniform_int_distribution<int> pick(0, 39);
  switch (pick(rng)) {
    case 0:
      return 1.0e5f;
    case 1:
      return -7.0e4f;
    case 2:
      return 3.0e-9f;
    case 3:
      return -2.0e-8f;
    case 4:
      return -0.0f;
    case 5:
      return 0.0f;
    default:
      return u(rng) * (pick(rng) < 4 ? 1.0e-3f : 1.0f);
  }
}

// The device bounds of entry e, KV head h, as f16 bits [max (d)][min (d)].
std::vector<std::uint16_t> device_bounds(const std::vector<oasiskv::f16>& all,
                                         const oasiskv::kv_layout& l, std::uint32_t capacity,
                                         std::uint32_t h, std::uint32_t e) {
  std::vector<std::uint16_t> v(2 * std::size_t{l.head_dim});
  const std::size_t at = (std::size_t{h} * capacity + e) * 2 * l.head_dim;
  for (std::size_t x = 0; x < v.size(); ++x) {
    v[x] = all[at + x].bits;
  }
  return v;
}

std::vector<std::uint16_t> host_bounds(const oasiskv::minmax_summary<oasiskv::f16>& s,
                                       std::uint32_t h, std::uint32_t e) {
  const auto b = s.bounds(h, e);
  std::vector<std::uint16_t> v(b.size());
  for (std::size_t x = 0; x < b.size(); ++x) {
    v[x] = b[x].bits;
  }
  return v;
}

// Every entry's bounds and token count, device against host, bit for bit.
void check_same(const oc::device_minmax_summary& ds,
                const oasiskv::minmax_summary<oasiskv::f16>& hs) {
  const oasiskv::kv_layout& l = ds.layout();
  std::vector<oasiskv::f16> all(std::size_t{l.num_kv_heads} * ds.capacity() * 2 * l.head_dim);
  OASISKV_CUDA_CHECK(cudaDeviceSynchronize());
  OASISKV_CUDA_CHECK(cudaMemcpy(all.data(), ds.bounds(), all.size() * sizeof(oasiskv::f16),
                                cudaMemcpyDeviceToHost));
  std::vector<std::uint16_t> tokens(ds.capacity());
  OASISKV_CUDA_CHECK(cudaMemcpy(tokens.data(), ds.tokens(), tokens.size() * sizeof(std::uint16_t),
                                cudaMemcpyDeviceToHost));
  for (std::uint32_t e = 0; e < ds.capacity(); ++e) {
    CAPTURE(e);
    CHECK(tokens[e] == hs.tokens(e));
    CHECK(ds.tokens(e) == hs.tokens(e));
    for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
      CAPTURE(h);
      CHECK(device_bounds(all, l, ds.capacity(), h, e) == host_bounds(hs, h, e));
    }
  }
}

}  // namespace

TEST_CASE("device_minmax_summary: device updates give the host summary's bits") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(2025);
  for (const auto dt : {oasiskv::dtype::f16, oasiskv::dtype::bf16}) {
    for (const std::uint32_t d : {64u, 128u}) {
      CAPTURE(static_cast<int>(dt));
      CAPTURE(d);
      const oasiskv::kv_layout l{1, 8, 2, d, 16, dt};
      // Full, partial, one-token and empty entries.
      const std::vector<std::uint32_t> fill{16, 5, 1, 16, 11, 0, 9};
      const auto capacity = static_cast<std::uint32_t>(fill.size());
      oasiskv::minmax_summary<oasiskv::f16> hs(l, capacity);
      oc::device_minmax_summary ds(l, capacity);
      // The blocks as fast-tier slots (host copy), written as the appends arrive.
      std::vector<std::byte> slots(std::size_t{capacity} * l.block_bytes());
      oasiskv::visit_dtype(dt, [&](auto elem) {
        using T = decltype(elem);
        for (std::uint32_t e = 0; e < capacity; ++e) {
          std::uniform_int_distribution<std::uint32_t> chunk(1, 5);
          for (std::uint32_t first = 0; first < fill[e];) {
            const std::uint32_t n = std::min(chunk(rng), fill[e] - first);
            std::vector<T> rows(std::size_t{n} * l.num_kv_heads * d);  // [n][kv heads][d]
            std::byte* slot = slots.data() + std::size_t{e} * l.block_bytes();
            for (std::uint32_t t = 0; t < n; ++t) {
              for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
                T* key = reinterpret_cast<T*>(slot + l.key_offset(h)) + std::size_t{first + t} * d;
                for (std::uint32_t x = 0; x < d; ++x) {
                  const T v = oasiskv::from_float<T>(key_value(rng));
                  rows[(std::size_t{t} * l.num_kv_heads + h) * d + x] = v;
                  key[x] = v;
                }
              }
            }
            device_buffer<T> drows(rows);
            ds.update(e, drows.get(), n);
            hs.update(e, slot, first, n);
            first += n;
          }
        }
      });
      check_same(ds, hs);

      // Recompute from the slots in device memory, into a fresh pair of summaries.
      device_buffer<std::byte> dslots(slots);
      oasiskv::minmax_summary<oasiskv::f16> hs2(l, capacity);
      oc::device_minmax_summary ds2(l, capacity);
      for (std::uint32_t e = 0; e < capacity; ++e) {
        const std::uint32_t from = (e * 3u) % capacity;  // another block's keys, then the own
        hs2.update(e, slots.data() + std::size_t{from} * l.block_bytes(), 0, 16);
        ds2.recompute(e, dslots.get() + std::size_t{from} * l.block_bytes(), 16);
        hs2.reset(e);
        if (fill[e] > 0) {
          hs2.update(e, slots.data() + std::size_t{e} * l.block_bytes(), 0, fill[e]);
        }
        ds2.recompute(e, dslots.get() + std::size_t{e} * l.block_bytes(), fill[e]);
      }
      check_same(ds2, hs2);
      check_same(ds2, hs);

      // Reset empties an entry (zero bounds, no tokens); appends then start afresh.
      hs.reset(3);
      ds.reset(3);
      hs.reset(0);
      ds.reset(0);
      hs.update(0, slots.data() + std::size_t{4} * l.block_bytes(), 0, 2);
      // Rows of tokens 0 and 1 of block 4, [token][kv head][d], gathered from the slot.
      std::vector<std::byte> rows(2 * std::size_t{l.num_kv_heads} * l.row_bytes());
      for (std::uint32_t t = 0; t < 2; ++t) {
        for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
          std::memcpy(
              rows.data() + (std::size_t{t} * l.num_kv_heads + h) * l.row_bytes(),
              slots.data() + std::size_t{4} * l.block_bytes() + l.key_offset(h) + t * l.row_bytes(),
              l.row_bytes());
        }
      }
      device_buffer<std::byte> drows(rows);
      ds.update(0, drows.get(), 2);
      check_same(ds, hs);
    }
  }
}

TEST_CASE("device_minmax_summary: bad input throws, naming the values, before any launch") {
  oasiskv::testing::require_cuda_device_or_skip();
  const oasiskv::kv_layout l{1, 8, 2, 64, 16, oasiskv::dtype::f16};
  oc::device_minmax_summary ds(l, 4);
  device_buffer<oasiskv::f16> rows(std::size_t{17} * l.num_kv_heads * l.head_dim);
  OASISKV_CUDA_CHECK(cudaMemset(rows.get(), 0, rows.size() * sizeof(oasiskv::f16)));
  ds.update(1, rows.get(), 10);
  std::string what;
  CHECK(error_code_of([&] { ds.update(1, rows.get(), 7); }, &what) == errc::out_of_range);
  CHECK(what.find("holds 10 tokens; 7 more exceed tokens_per_block = 16") != std::string::npos);
  CHECK(ds.tokens(1) == 10);  // unchanged
  CHECK(error_code_of([&] { ds.update(4, rows.get(), 1); }, &what) == errc::out_of_range);
  CHECK(what.find("entry 4 >= capacity = 4") != std::string::npos);
  CHECK(error_code_of([&] { ds.update(0, nullptr, 1); }) == errc::invalid_argument);
  std::vector<oasiskv::f16> host_rows(rows.size());
  CHECK(error_code_of([&] { ds.update(0, host_rows.data(), 1); }, &what) == errc::invalid_argument);
  CHECK(what.find("keys") != std::string::npos);
  CHECK(ds.tokens(0) == 0);
  CHECK(error_code_of([&] { ds.recompute(2, reinterpret_cast<const std::byte*>(rows.get()), 17); },
                      &what) == errc::out_of_range);
  CHECK(what.find("17 tokens") != std::string::npos);
  CHECK(error_code_of([&] { ds.reset(9); }) == errc::out_of_range);
  OASISKV_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<std::uint16_t> tokens(4);
  OASISKV_CUDA_CHECK(cudaMemcpy(tokens.data(), ds.tokens(), tokens.size() * sizeof(std::uint16_t),
                                cudaMemcpyDeviceToHost));
  CHECK(tokens == std::vector<std::uint16_t>{0, 10, 0, 0});
}
