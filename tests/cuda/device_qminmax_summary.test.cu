// SPDX-License-Identifier: Apache-2.0
// cuda::device_quantized_minmax_summary's device-side update, recompute and reset against the
// host quantized_minmax_summary fed the same keys: codes, scales, norms, the empty/overflow bias
// and token counts must be the same bits (f16, bf16 and f32 keys, with infinities and NaNs,
// partial and full blocks, several entries); upload copies the host's bits; bad input throws
// before any launch. (The same math runs on the host, without a device, in qminmax_math.test.cu.)
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda/cuda_support.cuh"
#include "oasiskv/cuda/cuda.cuh"

namespace {

using oasiskv::errc;
using oasiskv::testing::device_buffer;
namespace oc = oasiskv::cuda;
constexpr float inf = std::numeric_limits<float>::infinity();

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

// Keys in [-3, 3) with rule-stressing values: infinities (the entry scores +inf), NaN (ignored),
// large values (the scale grows; beyond f16's range an infinite f16 key), tiny values and
// subnormals, signed zeros.
float key_value(std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  std::uniform_int_distribution<int> pick(0, 299);
  switch (const int c = pick(rng)) {
    case 0:
      return inf;
    case 1:
      return std::numeric_limits<float>::quiet_NaN();
    case 2:
      return 1.0e5f;
    case 3:
      return -7.0e4f;
    case 4:
      return 3.0e-9f;
    case 5:
      return -2.0e-41f;
    case 6:
      return -0.0f;
    case 7:
      return 300.0f;
    default:
      return u(rng) * (c < 40 ? 1.0e-3f : 1.0f);
  }
}

std::uint32_t bits(float f) {
  return oasiskv::detail::bit_cast<std::uint32_t>(f);
}

// Every entry, device against host, bit for bit.
void check_same(const oc::device_quantized_minmax_summary& ds,
                const oasiskv::quantized_minmax_summary& hs) {
  const oasiskv::kv_layout& l = ds.layout();
  const std::uint32_t cap = ds.capacity(), pairs = l.head_dim / 2;
  const std::size_t slots = std::size_t{l.num_kv_heads} * cap;
  std::vector<std::uint32_t> codes(slots * pairs);
  std::vector<float> scales(slots), norms(slots), biases(cap);
  std::vector<std::uint16_t> tokens(cap);
  OASISKV_CUDA_CHECK(cudaDeviceSynchronize());
  OASISKV_CUDA_CHECK(
      cudaMemcpy(codes.data(), ds.codes(), codes.size() * 4, cudaMemcpyDeviceToHost));
  OASISKV_CUDA_CHECK(cudaMemcpy(scales.data(), ds.scales(), slots * 4, cudaMemcpyDeviceToHost));
  OASISKV_CUDA_CHECK(cudaMemcpy(norms.data(), ds.norms(), slots * 4, cudaMemcpyDeviceToHost));
  OASISKV_CUDA_CHECK(cudaMemcpy(biases.data(), ds.biases(), cap * 4, cudaMemcpyDeviceToHost));
  OASISKV_CUDA_CHECK(cudaMemcpy(tokens.data(), ds.tokens(), cap * 2, cudaMemcpyDeviceToHost));
  std::vector<std::uint32_t> words(pairs);
  for (std::uint32_t e = 0; e < cap; ++e) {
    CAPTURE(e);
    CHECK(tokens[e] == hs.tokens(e));
    CHECK(ds.tokens(e) == hs.tokens(e));
    const float want_bias = hs.overflowed(e) ? inf : hs.tokens(e) == 0 ? -inf : 0.0f;
    CHECK(bits(biases[e]) == bits(want_bias));
    for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
      CAPTURE(h);
      const std::size_t slot = std::size_t{h} * cap + e;
      const float s = hs.bound_words(h, e, words.data());
      CHECK(bits(scales[slot]) == bits(s));
      CHECK(bits(norms[slot]) == bits(hs.norm(h, e)));
      CHECK(std::equal(words.begin(), words.end(), codes.begin() + slot * pairs));
    }
  }
}

}  // namespace

TEST_CASE("device_quantized_minmax_summary: device updates give the host summary's bits") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(2026);
  for (const auto dt : {oasiskv::dtype::f16, oasiskv::dtype::bf16, oasiskv::dtype::f32}) {
    for (const std::uint32_t d : {64u, 128u, 520u}) {
      CAPTURE(static_cast<int>(dt));
      CAPTURE(d);
      const oasiskv::kv_layout l{1, 8, 2, d, 16, dt};
      const std::vector<std::uint32_t> fill{16, 5, 1, 16, 11, 0, 9};
      const auto capacity = static_cast<std::uint32_t>(fill.size());
      oasiskv::quantized_minmax_summary hs(l, capacity);
      oc::device_quantized_minmax_summary ds(l, capacity);
      std::vector<std::byte> slots(std::size_t{capacity} * l.block_bytes());
      oasiskv::visit_dtype(dt, [&](auto elem) {
        using T = decltype(elem);
        for (std::uint32_t e = 0; e < capacity; ++e) {
          std::uniform_int_distribution<std::uint32_t> chunk(1, 5);
          float grow = 1.0f;  // later appends larger now and then: old codes get rescaled
          for (std::uint32_t first = 0; first < fill[e];) {
            const std::uint32_t n = std::min(chunk(rng), fill[e] - first);
            std::vector<T> rows(std::size_t{n} * l.num_kv_heads * d);  // [n][kv heads][d]
            std::byte* slot = slots.data() + std::size_t{e} * l.block_bytes();
            for (std::uint32_t t = 0; t < n; ++t) {
              for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
                T* key = reinterpret_cast<T*>(slot + l.key_offset(h)) + std::size_t{first + t} * d;
                for (std::uint32_t x = 0; x < d; ++x) {
                  const T v = oasiskv::from_float<T>(key_value(rng) * grow);
                  rows[(std::size_t{t} * l.num_kv_heads + h) * d + x] = v;
                  key[x] = v;
                }
              }
            }
            device_buffer<T> drows(rows);
            ds.update(e, drows.get(), n);
            hs.update(e, slot, first, n);
            first += n;
            grow = grow < 1024.0f ? grow * 4.0f : 1.0f;
          }
        }
      });
      check_same(ds, hs);

      // Recompute from the slots in device memory into a fresh pair: another block's keys
      // first, then the own (the old entry is dropped).
      device_buffer<std::byte> dslots(slots);
      oasiskv::quantized_minmax_summary hs2(l, capacity);
      oc::device_quantized_minmax_summary ds2(l, capacity);
      for (std::uint32_t e = 0; e < capacity; ++e) {
        const std::uint32_t from = (e * 3u) % capacity;
        hs2.update(e, slots.data() + std::size_t{from} * l.block_bytes(), 0, 16);
        ds2.recompute(e, dslots.get() + std::size_t{from} * l.block_bytes(), 16);
        hs2.reset(e);
        if (fill[e] > 0) {
          hs2.update(e, slots.data() + std::size_t{e} * l.block_bytes(), 0, fill[e]);
        }
        ds2.recompute(e, dslots.get() + std::size_t{e} * l.block_bytes(), fill[e]);
      }
      check_same(ds2, hs2);
      check_same(ds2, hs);  // one pass over a block gives the appends' bits

      // Reset empties an entry; appends then start afresh.
      hs.reset(3);
      ds.reset(3);
      check_same(ds, hs);
      hs.update(3, slots.data() + std::size_t{4} * l.block_bytes(), 0, 2);
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
      ds.update(3, drows.get(), 2);
      check_same(ds, hs);

      // Upload copies the host's entries as they are.
      oc::device_quantized_minmax_summary ds3(l, capacity);
      std::vector<std::uint32_t> all(capacity);
      for (std::uint32_t e = 0; e < capacity; ++e) {
        all[e] = e;
      }
      ds3.upload(hs, all);
      check_same(ds3, hs);
    }
  }
}

TEST_CASE(
    "device_quantized_minmax_summary: bad input throws, naming the values, before any launch") {
  oasiskv::testing::require_cuda_device_or_skip();
  const oasiskv::kv_layout l{1, 8, 2, 64, 16, oasiskv::dtype::f16};
  oc::device_quantized_minmax_summary ds(l, 4);
  device_buffer<oasiskv::f16> rows(std::size_t{17} * l.num_kv_heads * l.head_dim);
  OASISKV_CUDA_CHECK(cudaMemset(rows.get(), 0, rows.size() * sizeof(oasiskv::f16)));
  ds.update(1, rows.get(), 10);
  std::string what;
  CHECK(error_code_of([&] { ds.update(1, rows.get(), 7); }, &what) == errc::out_of_range);
  CHECK(what.find("holds 10 tokens; 7 more exceed tokens_per_block = 16") != std::string::npos);
  CHECK(ds.tokens(1) == 10);
  CHECK(error_code_of([&] { ds.update(4, rows.get(), 1); }, &what) == errc::out_of_range);
  CHECK(what.find("entry 4 >= capacity = 4") != std::string::npos);
  CHECK(error_code_of([&] { ds.update(0, nullptr, 1); }, &what) == errc::invalid_argument);
  CHECK(what.find("keys is null") != std::string::npos);
  std::vector<oasiskv::f16> host_rows(rows.size());
  CHECK(error_code_of([&] { ds.update(0, host_rows.data(), 1); }, &what) == errc::invalid_argument);
  CHECK(what.find("keys") != std::string::npos);
  CHECK(ds.tokens(0) == 0);
  CHECK(error_code_of([&] { ds.recompute(2, reinterpret_cast<const std::byte*>(rows.get()), 17); },
                      &what) == errc::out_of_range);
  CHECK(what.find("17 tokens") != std::string::npos);
  CHECK(error_code_of([&] { ds.reset(9); }, &what) == errc::out_of_range);
  CHECK(what.find("entry 9") != std::string::npos);
  oasiskv::quantized_minmax_summary other(l, 5);
  CHECK(error_code_of([&] { ds.upload(other, std::vector<std::uint32_t>{0}); }, &what) ==
        errc::layout_mismatch);
  CHECK(what.find("capacity 5 against 4") != std::string::npos);
  oasiskv::quantized_minmax_summary same(l, 4);
  CHECK(error_code_of(
            [&] {
              ds.upload(same, std::vector<std::uint32_t>{0, 6});
            },
            &what) == errc::out_of_range);
  CHECK(what.find("entry 6") != std::string::npos);
  OASISKV_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<std::uint16_t> tokens(4);
  OASISKV_CUDA_CHECK(cudaMemcpy(tokens.data(), ds.tokens(), tokens.size() * sizeof(std::uint16_t),
                                cudaMemcpyDeviceToHost));
  CHECK(tokens == std::vector<std::uint16_t>{0, 10, 0, 0});
}
