// SPDX-License-Identifier: Apache-2.0
// cuda::device_minmax_summary's device-side update, recompute and reset against the host
// minmax_summary<f16> fed the same keys: the bounds must be the same bits (f16 and bf16 keys,
// partial and full blocks, several entries), and bad input must throw before any launch. `grow`
// keeps every entry (new ones as a fresh summary's) and `load` gives the host `load`'s bits, as
// uploaded; their argument checks also run without a device (doctest suite "host",
// test_cuda_device_summary_host).
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
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
  oasiskv::testing::copy_to_host(all.data(), ds.bounds(), all.size() * sizeof(oasiskv::f16));
  std::vector<std::uint16_t> tokens(ds.capacity());
  oasiskv::testing::copy_to_host(tokens.data(), ds.tokens(), tokens.size() * sizeof(std::uint16_t));
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
  oasiskv::testing::fill_device(rows.get(), 0, rows.size() * sizeof(oasiskv::f16));
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
  oasiskv::testing::copy_to_host(tokens.data(), ds.tokens(), tokens.size() * sizeof(std::uint16_t));
  CHECK(tokens == std::vector<std::uint16_t>{0, 10, 0, 0});
}

namespace {

// The whole device state, as bits: bounds `[kv heads][capacity][2][d]` and token counts.
struct minmax_state {
  std::vector<std::uint16_t> bounds, tokens;
  bool operator==(const minmax_state&) const = default;
};

minmax_state state_of(const oc::device_minmax_summary& ds) {
  const oasiskv::kv_layout& l = ds.layout();
  minmax_state st;
  st.bounds.resize(std::size_t{l.num_kv_heads} * ds.capacity() * 2 * l.head_dim);
  st.tokens.resize(ds.capacity());
  OASISKV_CUDA_CHECK(cudaDeviceSynchronize());
  oasiskv::testing::copy_to_host(st.bounds.data(), ds.bounds(), st.bounds.size() * 2);
  oasiskv::testing::copy_to_host(st.tokens.data(), ds.tokens(), st.tokens.size() * 2);
  return st;
}

// Entry e of KV head h of a state of capacity `cap`: `[max (d)][min (d)]` bits.
std::vector<std::uint16_t> entry_bits(const minmax_state& st, const oasiskv::kv_layout& l,
                                      std::uint32_t cap, std::uint32_t h, std::uint32_t e) {
  const std::size_t w = 2 * std::size_t{l.head_dim};
  const auto at = static_cast<std::ptrdiff_t>((std::size_t{h} * cap + e) * w);
  return {st.bounds.begin() + at, st.bounds.begin() + at + static_cast<std::ptrdiff_t>(w)};
}

// Appends `n` random keys as tokens [first, first + n) of entry e: written into the host slot
// (`slots`, one block per entry), folded into the host summary and, from device rows, into the
// device summary on `stream`.
template <class T>
void append(oc::device_minmax_summary& ds, oasiskv::minmax_summary<oasiskv::f16>& hs,
            std::vector<std::byte>& slots, std::uint32_t e, std::uint32_t first, std::uint32_t n,
            std::mt19937& rng, cudaStream_t stream) {
  const oasiskv::kv_layout& l = ds.layout();
  const std::uint32_t d = l.head_dim;
  std::vector<T> rows(std::size_t{n} * l.num_kv_heads * d);
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
  ds.update(e, drows.get(), n, stream);
  OASISKV_CUDA_CHECK(cudaStreamSynchronize(stream));
  hs.update(e, slot, first, n);
}

// Shipped summaries of `n` blocks, `[n][kv heads][2 (max, min)][d]` f16, as
// `disagg::summarize_block` writes them: max >= min, with infinities, signed zeros, subnormals and
// (for the receiver to make infinite) NaN bounds, one in each entry at least.
std::vector<std::byte> wire_entries(const oasiskv::kv_layout& l, std::size_t n, std::mt19937& rng) {
  const std::uint32_t d = l.head_dim;
  std::vector<std::uint16_t> w(n * l.num_kv_heads * 2 * d);
  std::uniform_int_distribution<int> nan(0, 49);
  for (std::size_t i = 0; i < n; ++i) {
    for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
      for (std::uint32_t x = 0; x < d; ++x) {
        const float a = key_value(rng), b = key_value(rng);
        std::uint16_t hi = oasiskv::f16::from_float(a < b ? b : a).bits;
        std::uint16_t lo = oasiskv::f16::from_float(a < b ? a : b).bits;
        if (nan(rng) == 0 || (h == 0 && x == i % d)) {
          hi = 0x7e00;  // NaN maximum: unbounded above
        }
        if (nan(rng) == 0 || (h == 0 && x == (i + 1) % d)) {
          lo = 0xfe01;  // NaN minimum: unbounded below
        }
        const std::size_t at = ((i * l.num_kv_heads + h) * 2) * d + x;
        w[at] = hi;
        w[at + d] = lo;
      }
    }
  }
  std::vector<std::byte> bytes(w.size() * 2);
  std::memcpy(bytes.data(), w.data(), bytes.size());
  return bytes;
}

}  // namespace

TEST_CASE("device_minmax_summary: load and grow arguments are checked on the host" *
          doctest::test_suite("host")) {
  using S = oc::device_minmax_summary;
  const oasiskv::kv_layout l{1, 8, 2, 64, 16, oasiskv::dtype::f16};
  const std::size_t wire = S::wire_bytes_of(l);
  CHECK(wire == 512);
  CHECK(wire == oasiskv::minmax_summary<oasiskv::f16>(l, 1).wire_bytes());
  const std::vector<std::byte> bytes(2 * wire);
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
  CHECK(load_error({1}, 2 * wire, {16}) == errc::invalid_argument);
  CHECK(what.find("got 1024 bytes for 1 entries, expected 1 x 512 = 512") != std::string::npos);
  CHECK(load_error({1, 3}, 2 * wire, {16, 17}) == errc::out_of_range);
  CHECK(what.find("entry 3 of 17 tokens; a block holds 1 to 16") != std::string::npos);
  CHECK(load_error({1, 3}, 2 * wire, {0, 1}) == errc::out_of_range);
  CHECK(what.find("entry 1 of 0 tokens") != std::string::npos);
  CHECK(load_error({1, 3}, 2 * wire, {16}) == errc::invalid_argument);
  CHECK(what.find("2 entries but 1 token counts") != std::string::npos);
  // The host summary refuses the same token counts.
  oasiskv::minmax_summary<oasiskv::f16> hs(l, 4);
  CHECK(error_code_of([&] { hs.load(3, std::span(bytes).first(wire), 17); }) == errc::out_of_range);
  CHECK(error_code_of([&] { hs.load(3, std::span(bytes).first(wire), 0); }) == errc::out_of_range);

  CHECK(error_code_of([] { S::check_grow(4, 3); }, &what) == errc::invalid_argument);
  CHECK(what.find("grow(3): below the current capacity 4") != std::string::npos);
  CHECK(error_code_of([&] { hs.grow(3); }) == errc::invalid_argument);
  CHECK_NOTHROW(S::check_grow(4, 4));
  CHECK_NOTHROW(S::check_grow(4, 9));
}

TEST_CASE("device_minmax_summary: grow keeps every entry, the new ones empty") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(77);
  stream_guard sg;
  for (const auto dt : {oasiskv::dtype::f16, oasiskv::dtype::bf16}) {
    for (const std::uint32_t d : {64u, 128u}) {
      CAPTURE(static_cast<int>(dt));
      CAPTURE(d);
      const oasiskv::kv_layout l{1, 8, 2, d, 16, dt};
      oasiskv::visit_dtype(dt, [&](auto elem) {
        using T = decltype(elem);
        const std::vector<std::uint32_t> fill{16, 5, 1, 0, 9, 16, 3};
        const auto cap = static_cast<std::uint32_t>(fill.size());
        std::vector<std::byte> slots(std::size_t{40} * l.block_bytes());
        oasiskv::minmax_summary<oasiskv::f16> hs(l, cap);
        oc::device_minmax_summary ds(l, cap);
        for (std::uint32_t e = 0; e < cap; ++e) {
          if (fill[e] > 0) {
            append<T>(ds, hs, slots, e, 0, fill[e], rng, sg.s);
          }
        }
        check_same(ds, hs);
        const minmax_state before = state_of(ds);
        const oasiskv::f16* old_bounds = ds.bounds();
        ds.grow(cap, sg.s);  // equal: nothing changes
        CHECK(ds.capacity() == cap);
        CHECK(ds.bounds() == old_bounds);
        CHECK(state_of(ds) == before);

        ds.grow(23, sg.s);
        hs.grow(23);
        REQUIRE(ds.capacity() == 23);
        check_same(ds, hs);
        const minmax_state after = state_of(ds);
        const minmax_state fresh = state_of(oc::device_minmax_summary(l, 23));
        for (std::uint32_t e = 0; e < 23; ++e) {
          CAPTURE(e);
          const minmax_state& want = e < cap ? before : fresh;
          CHECK(after.tokens[e] == want.tokens[e]);
          CHECK(ds.tokens(e) == want.tokens[e]);
          for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
            CHECK(entry_bits(after, l, 23, h, e) == entry_bits(want, l, e < cap ? cap : 23, h, e));
          }
        }

        // Updates after grow, into new, partial and empty old entries: the host's bits.
        append<T>(ds, hs, slots, 20, 0, 6, rng, sg.s);
        append<T>(ds, hs, slots, 1, 5, 4, rng, sg.s);
        append<T>(ds, hs, slots, 3, 0, 2, rng, sg.s);
        append<T>(ds, hs, slots, 22, 0, 16, rng, sg.s);
        check_same(ds, hs);
        ds.grow(40, sg.s);
        hs.grow(40);
        append<T>(ds, hs, slots, 39, 0, 3, rng, sg.s);
        append<T>(ds, hs, slots, 20, 6, 1, rng, sg.s);
        check_same(ds, hs);
        oc::device_minmax_summary up(l, 40);
        up.upload(hs, iota(40));
        CHECK(state_of(up) == state_of(ds));
      });
    }
  }
}

TEST_CASE("device_minmax_summary: load equals the host summary's load, uploaded") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(78);
  stream_guard sg;
  for (const std::uint32_t d : {64u, 128u}) {
    CAPTURE(d);
    const oasiskv::kv_layout l{1, 8, 2, d, 16, oasiskv::dtype::f16};
    const std::uint32_t cap = 9;
    std::vector<std::byte> slots(std::size_t{cap} * l.block_bytes());
    oasiskv::minmax_summary<oasiskv::f16> hs(l, cap);
    oc::device_minmax_summary ds(l, cap);
    // Entries holding bounds already: a load replaces them.
    append<oasiskv::f16>(ds, hs, slots, 2, 0, 11, rng, sg.s);
    append<oasiskv::f16>(ds, hs, slots, 4, 0, 16, rng, sg.s);
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
    oc::device_minmax_summary up(l, cap);
    up.upload(hs, iota(cap));
    CHECK(state_of(up) == state_of(ds));
    // NaN bounds arrive infinite: entry 0 (bytes 1) has a NaN maximum in dimension 1, head 0.
    const minmax_state st = state_of(ds);
    CHECK(entry_bits(st, l, cap, 0, 0)[1] == 0x7c00);
    CHECK(entry_bits(st, l, cap, 0, 0)[d + 2] == 0xfc00);

    // Appends fold into loaded entries as into any: the host's bits.
    append<oasiskv::f16>(ds, hs, slots, 4, 5, 3, rng, sg.s);
    append<oasiskv::f16>(ds, hs, slots, 8, 7, 9, rng, sg.s);
    append<oasiskv::f16>(ds, hs, slots, 7, 1, 2, rng, sg.s);
    check_same(ds, hs);
    // One entry, the host's argument shape.
    ds.load(5, std::span(bytes).first(wire), 2, sg.s);
    hs.load(5, std::span(bytes).first(wire), 2);
    check_same(ds, hs);
    // Load after grow, into a new entry.
    ds.grow(30, sg.s);
    hs.grow(30);
    ds.load(29, std::span(bytes).subspan(2 * wire, wire), 16, sg.s);
    hs.load(29, std::span(bytes).subspan(2 * wire, wire), 16);
    check_same(ds, hs);
  }
}

TEST_CASE("device_minmax_summary: bad grow and load throw before any device work") {
  oasiskv::testing::require_cuda_device_or_skip();
  std::mt19937 rng(79);
  stream_guard sg;
  const oasiskv::kv_layout l{1, 8, 2, 64, 16, oasiskv::dtype::f16};
  std::vector<std::byte> slots(std::size_t{4} * l.block_bytes());
  oasiskv::minmax_summary<oasiskv::f16> hs(l, 4);
  oc::device_minmax_summary ds(l, 4);
  append<oasiskv::f16>(ds, hs, slots, 1, 0, 10, rng, sg.s);
  append<oasiskv::f16>(ds, hs, slots, 3, 0, 16, rng, sg.s);
  const minmax_state before = state_of(ds);
  const oasiskv::f16* old_bounds = ds.bounds();
  const std::vector<std::byte> bytes = wire_entries(l, 2, rng);
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
  // No device holds 2^32 - 1 entries of 512 bytes: out of memory, the old buffers kept.
  std::string what;
  CHECK(error_code_of([&] { ds.grow(0xffffffffu, sg.s); }, &what) == errc::out_of_memory);
  CHECK(what.find("grow") != std::string::npos);
  CHECK(ds.capacity() == 4);
  CHECK(ds.bounds() == old_bounds);
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

TEST_CASE("device_minmax_summary: stage_load gives the host load's bounds" *
          doctest::test_suite("host")) {
  std::mt19937 rng(80);
  for (const std::uint32_t d : {64u, 128u}) {
    CAPTURE(d);
    const oasiskv::kv_layout l{1, 12, 3, d, 16, oasiskv::dtype::f16};
    const std::size_t n = 5, wire = oc::device_minmax_summary::wire_bytes_of(l);
    const std::vector<std::byte> bytes = wire_entries(l, n, rng);
    const std::vector<std::uint16_t> staged = oc::device_minmax_summary::stage_load(l, bytes);
    REQUIRE(staged.size() == n * l.num_kv_heads * 2 * d);
    oasiskv::minmax_summary<oasiskv::f16> hs(l, 8);
    std::size_t nans = 0;
    for (std::uint32_t i = 0; i < n; ++i) {
      const std::uint32_t e = 7 - i;
      hs.load(e, std::span(bytes).subspan(i * wire, wire), i + 1);
      for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
        CAPTURE(i);
        CAPTURE(h);
        const auto at = static_cast<std::ptrdiff_t>((std::size_t{i} * l.num_kv_heads + h) * 2 * d);
        CHECK(std::vector<std::uint16_t>(staged.begin() + at,
                                         staged.begin() + at + 2 * std::ptrdiff_t{d}) ==
              host_bounds(hs, h, e));
        for (std::uint32_t x = 0; x < 2 * d; ++x) {
          std::uint16_t w = 0;
          std::memcpy(&w, bytes.data() + (static_cast<std::size_t>(at) + x) * 2, 2);
          nans += (w & 0x7fffu) > 0x7c00u ? 1 : 0;
        }
      }
    }
    CHECK(nans >= 2 * n);  // the NaN rule was exercised, maxima and minima
  }
}
