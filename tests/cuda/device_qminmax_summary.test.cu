// SPDX-License-Identifier: Apache-2.0
// cuda::device_quantized_minmax_summary's device-side update, recompute and reset against the
// host quantized_minmax_summary fed the same keys: codes, scales, norms, the empty/overflow bias
// and token counts must be the same bits (f16, bf16 and f32 keys, with infinities and NaNs,
// partial and full blocks, several entries); upload copies the host's bits; bad input throws
// before any launch. `grow` keeps every entry (new ones as a fresh summary's) and `load` gives the
// host `load`'s bits, as uploaded; their argument checks also run without a device (doctest suite
// "host", test_cuda_device_qminmax_summary_host). (The same math runs on the host, without a
// device, in qminmax_math.test.cu.)
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "cuda/cuda_support.cuh"
#include "oasiskv/cuda/cuda.cuh"

namespace {

using oasiskv::errc;
using oasiskv::testing::device_buffer;
using oasiskv::testing::error_code_of;
using oasiskv::testing::iota;
using oasiskv::testing::stream_guard;
namespace oc = oasiskv::cuda;
constexpr float inf = std::numeric_limits<float>::infinity();

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
  oasiskv::testing::copy_to_host(codes.data(), ds.codes(), codes.size() * 4);
  oasiskv::testing::copy_to_host(scales.data(), ds.scales(), slots * 4);
  oasiskv::testing::copy_to_host(norms.data(), ds.norms(), slots * 4);
  oasiskv::testing::copy_to_host(biases.data(), ds.biases(), cap * 4);
  oasiskv::testing::copy_to_host(tokens.data(), ds.tokens(), cap * 2);
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
  oasiskv::testing::fill_device(rows.get(), 0, rows.size() * sizeof(oasiskv::f16));
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
  oasiskv::testing::copy_to_host(tokens.data(), ds.tokens(), tokens.size() * sizeof(std::uint16_t));
  CHECK(tokens == std::vector<std::uint16_t>{0, 10, 0, 0});
}

namespace {

// The whole device state, as bits: codes `[kv heads][capacity][d / 2]`, scales and norms
// `[kv heads][capacity]`, biases and token counts `[capacity]`.
struct qstate {
  std::vector<std::uint32_t> codes, scales, norms, biases;
  std::vector<std::uint16_t> tokens;
  bool operator==(const qstate&) const = default;
};

qstate state_of(const oc::device_quantized_minmax_summary& ds) {
  const oasiskv::kv_layout& l = ds.layout();
  const std::uint32_t cap = ds.capacity();
  const std::size_t slots = std::size_t{l.num_kv_heads} * cap;
  qstate st;
  st.codes.resize(slots * (l.head_dim / 2));
  st.scales.resize(slots);
  st.norms.resize(slots);
  st.biases.resize(cap);
  st.tokens.resize(cap);
  OASISKV_CUDA_CHECK(cudaDeviceSynchronize());
  oasiskv::testing::copy_to_host(st.codes.data(), ds.codes(), st.codes.size() * 4);
  oasiskv::testing::copy_to_host(st.scales.data(), ds.scales(), slots * 4);
  oasiskv::testing::copy_to_host(st.norms.data(), ds.norms(), slots * 4);
  oasiskv::testing::copy_to_host(st.biases.data(), ds.biases(), cap * 4);
  oasiskv::testing::copy_to_host(st.tokens.data(), ds.tokens(), cap * 2);
  return st;
}

// Entry e of a state of capacity `cap`, every KV head: codes, scales, norms, bias, token count.
std::vector<std::uint32_t> entry_bits(const qstate& st, const oasiskv::kv_layout& l,
                                      std::uint32_t cap, std::uint32_t e) {
  const std::size_t pairs = l.head_dim / 2;
  std::vector<std::uint32_t> v;
  for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
    const std::size_t slot = std::size_t{h} * cap + e;
    v.insert(v.end(), st.codes.begin() + static_cast<std::ptrdiff_t>(slot * pairs),
             st.codes.begin() + static_cast<std::ptrdiff_t>((slot + 1) * pairs));
    v.push_back(st.scales[slot]);
    v.push_back(st.norms[slot]);
  }
  v.push_back(st.biases[e]);
  v.push_back(st.tokens[e]);
  return v;
}

// Appends `n` random keys as tokens [first, first + n) of entry e: written into the host slot
// (`slots`, one block per entry), folded into the host summary and, from device rows, into the
// device summary on `stream`.
template <class T>
void append(oc::device_quantized_minmax_summary& ds, oasiskv::quantized_minmax_summary& hs,
            std::vector<std::byte>& slots, std::uint32_t e, std::uint32_t first, std::uint32_t n,
            std::mt19937& rng, cudaStream_t stream, float scale = 1.0f) {
  const oasiskv::kv_layout& l = ds.layout();
  const std::uint32_t d = l.head_dim;
  std::vector<T> rows(std::size_t{n} * l.num_kv_heads * d);
  std::byte* slot = slots.data() + std::size_t{e} * l.block_bytes();
  for (std::uint32_t t = 0; t < n; ++t) {
    for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
      T* key = reinterpret_cast<T*>(slot + l.key_offset(h)) + std::size_t{first + t} * d;
      for (std::uint32_t x = 0; x < d; ++x) {
        const T v = oasiskv::from_float<T>(key_value(rng) * scale);
        rows[(std::size_t{t} * l.num_kv_heads + h) * d + x] = v;
        key[x] = v;
      }
    }
  }
  device_buffer<T> drows(rows);
  ds.update(e, drows.get(), n, stream);
  OASISKV_CUDA_CHECK(cudaStreamSynchronize(stream));
  hs.update(e, slot, first, n);
}

// Shipped summaries of `n` blocks, `[n][kv heads][2 (max, min)][d]` f16, as
// `disagg::summarize_block` writes them: every finite maximum at or above its finite minimum,
// with infinities and NaN bounds now and then in entries 0, 3, 6, ... (the entry then scores
// +inf; the others are finite), signed zeros and subnormals. Entries whose index is odd are
// multiplied by `spread` (a larger scale).
std::vector<std::byte> wire_entries(const oasiskv::kv_layout& l, std::size_t n, std::mt19937& rng,
                                    float spread = 16.0f) {
  const std::uint32_t d = l.head_dim;
  std::vector<std::uint16_t> w(n * l.num_kv_heads * 2 * d);
  for (std::size_t i = 0; i < n; ++i) {
    for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
      for (std::uint32_t x = 0; x < d; ++x) {
        const float m = i % 2 == 1 ? spread : 1.0f;
        float a = key_value(rng) * m, b = key_value(rng) * m;
        if (i % 3 != 0) {  // finite in f16: the entry does not overflow
          a = std::isfinite(a) && std::abs(a) < 6.0e4f ? a : 1.5f;
          b = std::isfinite(b) && std::abs(b) < 6.0e4f ? b : -0.75f;
        }
        const std::size_t at = ((i * l.num_kv_heads + h) * 2) * d + x;
        w[at] = oasiskv::f16::from_float(a < b ? b : a).bits;
        w[at + d] = oasiskv::f16::from_float(a < b ? a : b).bits;
      }
    }
  }
  std::vector<std::byte> bytes(w.size() * 2);
  std::memcpy(bytes.data(), w.data(), bytes.size());
  return bytes;
}

void put_f16(std::vector<std::byte>& bytes, std::size_t at, float v) {
  const std::uint16_t b = oasiskv::f16::from_float(v).bits;
  std::memcpy(bytes.data() + at * 2, &b, 2);
}

}  // namespace

TEST_CASE("device_quantized_minmax_summary: load and grow arguments are checked on the host" *
          doctest::test_suite("host")) {
  using S = oc::device_quantized_minmax_summary;
  const oasiskv::kv_layout l{1, 8, 2, 64, 16, oasiskv::dtype::f16};
  const std::uint32_t d = l.head_dim;
  const std::size_t wire = S::wire_bytes_of(l);
  CHECK(wire == 512);
  CHECK(wire == oasiskv::quantized_minmax_summary(l, 1).wire_bytes());
  std::vector<std::byte> bytes(2 * wire);  // zero bounds: max == min, valid
  const std::vector<std::uint32_t> entries{1, 3};
  const std::vector<std::uint32_t> tokens{16, 1};
  CHECK_NOTHROW(S::check_load(l, 4, entries, bytes, tokens));
  CHECK_NOTHROW(S::check_load(l, 4, {}, {}, {}));
  std::string what;
  auto load_error = [&](std::vector<std::uint32_t> e, std::size_t nbytes,
                        std::vector<std::uint32_t> t) {
    return error_code_of([&] { S::check_load(l, 4, e, std::span(bytes).first(nbytes), t); }, &what);
  };
  CHECK(load_error({1, 4}, 2 * wire, {16, 1}) == errc::out_of_range);
  CHECK(what.find("load: entry 4 >= capacity = 4") != std::string::npos);
  CHECK(load_error({1, 3}, 2 * wire - 1, {16, 1}) == errc::invalid_argument);
  CHECK(what.find("got 1023 bytes for 2 entries, expected 2 x 512 = 1024") != std::string::npos);
  CHECK(load_error({1, 3}, 2 * wire, {16, 17}) == errc::out_of_range);
  CHECK(what.find("entry 3 of 17 tokens; a block holds 1 to 16") != std::string::npos);
  CHECK(load_error({1, 3}, 2 * wire, {0, 1}) == errc::out_of_range);
  CHECK(what.find("entry 1 of 0 tokens") != std::string::npos);
  CHECK(load_error({1, 3}, 2 * wire, {16}) == errc::invalid_argument);
  CHECK(what.find("2 entries but 1 token counts") != std::string::npos);

  // A maximum below its minimum, in the second shipped entry (entry 3), head 1, dimension 5.
  const std::size_t at = wire / 2 + (std::size_t{1} * 2 * d + 5);
  put_f16(bytes, at, -1.0f);
  put_f16(bytes, at + d, 2.0f);
  CHECK(load_error({1, 3}, 2 * wire, {16, 1}) == errc::invalid_argument);
  CHECK(what.find("entry 3, kv head 1, dimension 5: maximum -1 is below minimum 2") !=
        std::string::npos);
  // The host summary refuses the same bytes.
  oasiskv::quantized_minmax_summary hs(l, 4);
  CHECK(error_code_of([&] { hs.load(3, std::span(bytes).subspan(wire, wire), 1); }) ==
        errc::invalid_argument);
  // Non-finite bounds are no such conflict (the entry scores +inf): accepted, by both.
  put_f16(bytes, at, std::numeric_limits<float>::quiet_NaN());
  CHECK_NOTHROW(S::check_load(l, 4, entries, bytes, tokens));
  put_f16(bytes, at, -inf);
  CHECK_NOTHROW(S::check_load(l, 4, entries, bytes, tokens));
  CHECK_NOTHROW(hs.load(3, std::span(bytes).subspan(wire, wire), 1));
  CHECK(hs.overflowed(3));

  CHECK(error_code_of([] { S::check_grow(4, 3); }, &what) == errc::invalid_argument);
  CHECK(what.find("grow(3): below the current capacity 4") != std::string::npos);
  CHECK(error_code_of([&] { hs.grow(3); }) == errc::invalid_argument);
  CHECK_NOTHROW(S::check_grow(4, 4));
  CHECK_NOTHROW(S::check_grow(4, 9));
}

TEST_CASE("device_quantized_minmax_summary: grow keeps every entry, the new ones empty") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(87);
  stream_guard sg;
  for (const auto dt : {oasiskv::dtype::f16, oasiskv::dtype::bf16, oasiskv::dtype::f32}) {
    for (const std::uint32_t d : {64u, 128u}) {
      CAPTURE(static_cast<int>(dt));
      CAPTURE(d);
      const oasiskv::kv_layout l{1, 8, 2, d, 16, dt};
      oasiskv::visit_dtype(dt, [&](auto elem) {
        using T = decltype(elem);
        const std::vector<std::uint32_t> fill{16, 5, 1, 0, 9, 16, 3};
        const auto cap = static_cast<std::uint32_t>(fill.size());
        std::vector<std::byte> slots(std::size_t{40} * l.block_bytes());
        oasiskv::quantized_minmax_summary hs(l, cap);
        oc::device_quantized_minmax_summary ds(l, cap);
        for (std::uint32_t e = 0; e < cap; ++e) {
          if (fill[e] > 0) {
            append<T>(ds, hs, slots, e, 0, fill[e], rng, sg.s);
          }
        }
        check_same(ds, hs);
        const qstate before = state_of(ds);
        const std::uint32_t* old_codes = ds.codes();
        ds.grow(cap, sg.s);  // equal: nothing changes
        CHECK(ds.capacity() == cap);
        CHECK(ds.codes() == old_codes);
        CHECK(state_of(ds) == before);

        ds.grow(23, sg.s);
        hs.grow(23);
        REQUIRE(ds.capacity() == 23);
        check_same(ds, hs);
        const qstate after = state_of(ds);
        const qstate fresh = state_of(oc::device_quantized_minmax_summary(l, 23));
        for (std::uint32_t e = 0; e < 23; ++e) {
          CAPTURE(e);
          CHECK(entry_bits(after, l, 23, e) ==
                (e < cap ? entry_bits(before, l, cap, e) : entry_bits(fresh, l, 23, e)));
          CHECK(ds.tokens(e) == (e < cap ? fill[e] : 0u));
        }

        // Updates after grow, into new, partial and empty old entries (one with keys that grow
        // the scale): the host's bits.
        append<T>(ds, hs, slots, 20, 0, 6, rng, sg.s);
        append<T>(ds, hs, slots, 1, 5, 4, rng, sg.s, 64.0f);
        append<T>(ds, hs, slots, 3, 0, 2, rng, sg.s);
        append<T>(ds, hs, slots, 22, 0, 16, rng, sg.s);
        check_same(ds, hs);
        ds.grow(40, sg.s);
        hs.grow(40);
        append<T>(ds, hs, slots, 39, 0, 3, rng, sg.s);
        append<T>(ds, hs, slots, 20, 6, 1, rng, sg.s, 256.0f);
        check_same(ds, hs);
        oc::device_quantized_minmax_summary up(l, 40);
        up.upload(hs, iota(40));
        CHECK(state_of(up) == state_of(ds));
      });
    }
  }
}

TEST_CASE("device_quantized_minmax_summary: load equals the host summary's load, uploaded") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(88);
  stream_guard sg;
  for (const std::uint32_t d : {64u, 128u, 520u}) {
    CAPTURE(d);
    const oasiskv::kv_layout l{1, 8, 2, d, 16, oasiskv::dtype::f16};
    const std::uint32_t cap = 9;
    std::vector<std::byte> slots(std::size_t{cap} * l.block_bytes());
    oasiskv::quantized_minmax_summary hs(l, cap);
    oc::device_quantized_minmax_summary ds(l, cap);
    // Entries holding codes already: a load replaces them.
    append<oasiskv::f16>(ds, hs, slots, 2, 0, 11, rng, sg.s);
    append<oasiskv::f16>(ds, hs, slots, 4, 0, 16, rng, sg.s, 8.0f);
    append<oasiskv::f16>(ds, hs, slots, 6, 0, 3, rng, sg.s);
    const std::vector<std::uint32_t> entries{4, 0, 7, 2, 8, 4};  // 4 twice: the last wins
    const std::vector<std::uint32_t> tokens{3, 16, 1, 16, 7, 5};
    const std::vector<std::byte> bytes = wire_entries(l, entries.size(), rng);
    const std::size_t wire = ds.wire_bytes();
    REQUIRE(wire == hs.wire_bytes());
    ds.load(entries, bytes, tokens, sg.s);
    for (std::size_t i = 0; i < entries.size(); ++i) {
      hs.load(entries[i], std::span(bytes).subspan(i * wire, wire), tokens[i]);
    }
    check_same(ds, hs);
    CHECK(ds.tokens(4) == 5);
    oc::device_quantized_minmax_summary up(l, cap);
    up.upload(hs, iota(cap));
    CHECK(state_of(up) == state_of(ds));

    // Appends fold into loaded entries as into any (scales may grow): the host's bits.
    append<oasiskv::f16>(ds, hs, slots, 4, 5, 3, rng, sg.s, 32.0f);
    append<oasiskv::f16>(ds, hs, slots, 8, 7, 9, rng, sg.s);
    append<oasiskv::f16>(ds, hs, slots, 7, 1, 2, rng, sg.s);
    check_same(ds, hs);
    // One entry, the host's argument shape; then into a new entry after grow.
    ds.load(5, std::span(bytes).first(wire), 2, sg.s);
    hs.load(5, std::span(bytes).first(wire), 2);
    check_same(ds, hs);
    ds.grow(30, sg.s);
    hs.grow(30);
    ds.load(29, std::span(bytes).subspan(3 * wire, wire), 16, sg.s);
    hs.load(29, std::span(bytes).subspan(3 * wire, wire), 16);
    check_same(ds, hs);
  }
}

TEST_CASE("device_quantized_minmax_summary: bad grow and load throw before any device work") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(89);
  stream_guard sg;
  const oasiskv::kv_layout l{1, 8, 2, 64, 16, oasiskv::dtype::f16};
  const std::uint32_t d = l.head_dim;
  std::vector<std::byte> slots(std::size_t{4} * l.block_bytes());
  oasiskv::quantized_minmax_summary hs(l, 4);
  oc::device_quantized_minmax_summary ds(l, 4);
  append<oasiskv::f16>(ds, hs, slots, 1, 0, 10, rng, sg.s);
  append<oasiskv::f16>(ds, hs, slots, 3, 0, 16, rng, sg.s);
  const qstate before = state_of(ds);
  const std::uint32_t* old_codes = ds.codes();
  std::vector<std::byte> bytes = wire_entries(l, 2, rng);
  const std::size_t wire = ds.wire_bytes();
  // Each refused call enqueues nothing: made inside a capture of the test's own, whose graph
  // must stay empty.
  auto nothing_enqueued = [&](auto f, errc code, const std::string& text) {
    CAPTURE(text);
    OASISKV_CUDA_CHECK(cudaStreamBeginCapture(sg.s, cudaStreamCaptureModeThreadLocal));
    std::string what;
    CHECK(error_code_of(f, &what) == code);
    CHECK(what.find(text) != std::string::npos);
    cudaGraph_t g = nullptr;
    OASISKV_CUDA_CHECK(cudaStreamEndCapture(sg.s, &g));
    std::size_t nodes = 1;
    OASISKV_CUDA_CHECK(cudaGraphGetNodes(g, nullptr, &nodes));
    CHECK(nodes == 0);
    OASISKV_CUDA_CHECK(cudaGraphDestroy(g));
  };
  using V = std::vector<std::uint32_t>;
  nothing_enqueued([&] { ds.grow(3, sg.s); }, errc::invalid_argument,
                   "grow(3): below the current capacity 4");
  nothing_enqueued(
      [&] {
        ds.load(V{1, 4}, bytes, V{3, 3}, sg.s);
      },
      errc::out_of_range, "entry 4 >= capacity = 4");
  nothing_enqueued([&] { ds.load(V{1}, std::span(bytes).first(wire - 2), V{3}, sg.s); },
                   errc::invalid_argument, "got 510 bytes for 1 entries, expected 1 x 512");
  nothing_enqueued(
      [&] {
        ds.load(V{0, 2}, bytes, V{3, 17}, sg.s);
      },
      errc::out_of_range, "entry 2 of 17 tokens");
  nothing_enqueued([&] { ds.load(0, std::span(bytes).first(wire), 0, sg.s); }, errc::out_of_range,
                   "entry 0 of 0 tokens");
  nothing_enqueued(
      [&] {
        ds.load(V{0, 2}, bytes, V{3}, sg.s);
      },
      errc::invalid_argument, "2 entries but 1 token counts");
  // A maximum below its minimum in the second entry: nothing of the first is copied either.
  const std::size_t at = wire / 2 + 7;
  put_f16(bytes, at, -0.5f);
  put_f16(bytes, at + d, 0.25f);
  nothing_enqueued(
      [&] {
        ds.load(V{0, 2}, bytes, V{3, 3}, sg.s);
      },
      errc::invalid_argument,
      "entry 2, kv head 0, dimension 7: maximum -0.5 is below minimum 0.25");
  // No device holds 2^32 - 1 entries of 2 x 64 + 8 bytes per head: out of memory, the old
  // buffers kept.
  std::string what;
  CHECK(error_code_of([&] { ds.grow(0xffffffffu, sg.s); }, &what) == errc::out_of_memory);
  CHECK(ds.capacity() == 4);
  CHECK(ds.codes() == old_codes);
  CHECK(ds.tokens(1) == 10);
  CHECK(ds.tokens(3) == 16);
  CHECK(state_of(ds) == before);
  check_same(ds, hs);
  // Still usable after the refusals.
  append<oasiskv::f16>(ds, hs, slots, 1, 10, 2, rng, sg.s);
  ds.grow(5, sg.s);
  hs.grow(5);
  check_same(ds, hs);
}

TEST_CASE("device_quantized_minmax_summary: stage_load gives the host load's entries" *
          doctest::test_suite("host")) {
  using S = oc::device_quantized_minmax_summary;
  std::mt19937 rng(90);
  for (const std::uint32_t d : {64u, 128u, 520u}) {
    CAPTURE(d);
    const oasiskv::kv_layout l{1, 12, 3, d, 16, oasiskv::dtype::f16};
    const std::size_t n = 6, wire = S::wire_bytes_of(l), pairs = d / 2;
    const std::vector<std::byte> bytes = wire_entries(l, n, rng);
    const std::vector<std::uint32_t> tokens{1, 16, 7, 3, 16, 9};
    const S::staged_entries st = S::stage_load(l, bytes, tokens);
    REQUIRE(st.words.size() == n * l.num_kv_heads * pairs);
    REQUIRE(st.scales.size() == n * l.num_kv_heads);
    REQUIRE(st.norms.size() == n * l.num_kv_heads);
    REQUIRE(st.biases.size() == n);
    REQUIRE(st.tokens.size() == n);
    oasiskv::quantized_minmax_summary hs(l, 20);
    std::vector<std::uint32_t> words(pairs);
    std::size_t overflowed = 0;
    for (std::uint32_t i = 0; i < n; ++i) {
      CAPTURE(i);
      const std::uint32_t e = 19 - 3 * i;  // other entries than the scratch summary's
      hs.load(e, std::span(bytes).subspan(i * wire, wire), tokens[i]);
      CHECK(st.tokens[i] == hs.tokens(e));
      CHECK(bits(st.biases[i]) == bits(hs.overflowed(e) ? inf : 0.0f));
      overflowed += hs.overflowed(e) ? 1 : 0;
      for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
        CAPTURE(h);
        const float s = hs.bound_words(h, e, words.data());
        CHECK(s > 0.0f);
        CHECK(bits(st.scales[i * l.num_kv_heads + h]) == bits(s));
        CHECK(bits(st.norms[i * l.num_kv_heads + h]) == bits(hs.norm(h, e)));
        CHECK(std::equal(
            words.begin(), words.end(),
            st.words.begin() + static_cast<std::ptrdiff_t>((i * l.num_kv_heads + h) * pairs)));
      }
    }
    CHECK(S::stage_load(l, {}, {}).words.empty());
    CHECK(overflowed > 0);  // entries with a non-finite bound and entries without
    CHECK(overflowed < n);
  }
}
