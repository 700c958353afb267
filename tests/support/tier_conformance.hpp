// SPDX-License-Identifier: Apache-2.0
//! The `tier_backend` contract, checked the same way for every tier (host_tier, file_tier,
//! composite_tier, and any tier an engine brings): geometry, byte-exact independent slots through
//! every access path the tier offers, out-of-range slots, batches checked before anything moves,
//! and read-only slots that refuse writes and keep their bytes. The model is a copy of what each
//! slot should hold.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "oasiskv/concepts/tier_backend.hpp"
#include "oasiskv/core/error.hpp"
#include "support/expect_error.hpp"

namespace oasiskv::testing {

namespace conformance_detail {

template <class T>
std::uint32_t read_only_slots_of(const T& t) {
  if constexpr (read_only_slot_tier<T>) {
    return t.read_only_slots();
  } else {
    return 0;
  }
}

template <class T>
void write_slot(T& t, slot_id s, const std::byte* in) {
  if constexpr (host_accessible_tier<T>) {
    std::memcpy(t.slot_data(s), in, t.layout().block_bytes());
  } else {
    t.write_block(s, in);
  }
}

template <class T>
void read_slot(const T& t, slot_id s, std::byte* out) {
  if constexpr (host_accessible_tier<T>) {
    std::memcpy(out, t.slot_data(s), t.layout().block_bytes());
  } else {
    t.read_block(s, out);
  }
}

}  // namespace conformance_detail

//! @brief Runs the contract against `t`, a freshly made tier whose read-only slots (if any) hold
//! whatever they were made with. Overwrites every writable slot.
template <class T>
void check_tier_conformance(T& t, std::uint64_t seed = 1) {
  namespace cd = conformance_detail;
  static_assert(tier_backend<T>, "check_tier_conformance: not a tier_backend");
  static_assert(host_accessible_tier<T> || block_io_tier<T>,
                "check_tier_conformance: a tier the CPU can neither address nor copy through");
  const T& ct = t;

  // Geometry: a valid layout, a stride that holds a block, a constant pool.
  const kv_layout layout = ct.layout();
  layout.validate();
  const std::size_t bb = layout.block_bytes();
  const std::uint32_t n = ct.num_slots();
  REQUIRE(n >= 1);
  CHECK(ct.slot_bytes() >= bb);
  const std::uint32_t ro = cd::read_only_slots_of(ct);
  REQUIRE(ro <= n);

  // The model: read-only slots keep what they hold; every other slot gets distinct random bytes.
  std::mt19937_64 rng(seed);
  std::vector<std::vector<std::byte>> model(n, std::vector<std::byte>(bb));
  for (slot_id s = 0; s < ro; ++s) {
    cd::read_slot(ct, s, model[s].data());
  }
  for (slot_id s = ro; s < n; ++s) {
    for (auto& b : model[s]) {
      b = static_cast<std::byte>(rng());
    }
    cd::write_slot(t, s, model[s].data());
  }
  std::vector<std::byte> out(bb);
  auto check_all = [&](const char* after) {
    for (slot_id s = 0; s < n; ++s) {
      cd::read_slot(ct, s, out.data());
      INFO(after << ": slot " << s);
      REQUIRE(out == model[s]);
    }
  };
  check_all("one write per slot");

  if constexpr (addressable_tier<T>) {
    // One address per slot, `slot_bytes()` apart, the same through const and the view.
    const block_pool_view v = ct.view();
    CHECK(v.num_slots == n);
    CHECK(v.slot_stride == ct.slot_bytes());
    CHECK(v.layout == layout);
    for (slot_id s = 0; s < n; ++s) {
      CHECK(t.slot_data(s) == ct.slot_data(s));
      CHECK(v.slot(s) == ct.slot_data(s));
    }
    expect_error([&] { (void)t.slot_data(n); }, errc::invalid_slot, std::to_string(n));
    expect_error([&] { (void)ct.slot_data(n); }, errc::invalid_slot, std::to_string(n));
  }

  if constexpr (block_io_tier<T>) {
    // Random single-block writes and reads in any order stay byte-exact and independent.
    std::vector<std::byte> in(bb);
    for (int i = 0; i < 4 * static_cast<int>(n); ++i) {
      if (ro == n) {
        break;
      }
      const slot_id s = ro + static_cast<slot_id>(rng() % (n - ro));
      for (auto& b : in) {
        b = static_cast<std::byte>(rng());
      }
      t.write_block(s, in.data());
      model[s] = in;
      const slot_id r = static_cast<slot_id>(rng() % n);
      ct.read_block(r, out.data());
      INFO("read of slot " << r << " after writing slot " << s);
      REQUIRE(out == model[r]);
    }
    check_all("random block writes");
    expect_error([&] { ct.read_block(n, out.data()); }, errc::invalid_slot, std::to_string(n));
    if (ro < n) {
      expect_error([&] { t.write_block(n, model[ro].data()); }, errc::invalid_slot,
                   std::to_string(n));
    }
  }

  if constexpr (batched_block_io_tier<T>) {
    // A batch reaches every slot it names, each once, in any order.
    std::vector<slot_id> order(n);
    for (slot_id s = 0; s < n; ++s) {
      order[s] = s;
    }
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<std::vector<std::byte>> fresh(n, std::vector<std::byte>(bb));
    std::vector<block_write> ws;
    for (const slot_id s : order) {
      if (s < ro) {
        continue;
      }
      for (auto& b : fresh[s]) {
        b = static_cast<std::byte>(rng());
      }
      ws.push_back({s, fresh[s].data()});
    }
    t.write_blocks(ws);
    for (const block_write& w : ws) {
      model[w.slot] = fresh[w.slot];
    }
    std::vector<std::vector<std::byte>> got(n, std::vector<std::byte>(bb));
    std::vector<block_read> rs;
    for (const slot_id s : order) {
      rs.push_back({s, got[s].data()});
    }
    ct.read_blocks(rs);
    for (slot_id s = 0; s < n; ++s) {
      INFO("batched read of slot " << s);
      REQUIRE(got[s] == model[s]);
    }
    // A batch naming a slot outside the pool moves nothing: the valid write beside it is not
    // done.
    if (ro < n) {
      std::vector<std::byte> other(bb, std::byte{0x5a});
      const std::vector<block_write> bad{{ro, other.data()}, {n, other.data()}};
      expect_error([&] { t.write_blocks(bad); }, errc::invalid_slot, std::to_string(n));
      cd::read_slot(ct, ro, out.data());
      CHECK(out == model[ro]);
    }
    const std::vector<block_read> bad_read{{0, out.data()}, {n + 7, out.data()}};
    expect_error([&] { ct.read_blocks(bad_read); }, errc::invalid_slot, std::to_string(n + 7));
  }

  if constexpr (read_only_slot_tier<T> && block_io_tier<T>) {
    // Read-only slots refuse writes, alone or in a batch, and keep their bytes.
    if (ro > 0) {
      std::vector<std::byte> other(bb, std::byte{0x33});
      expect_error([&] { t.write_block(ro - 1, other.data()); }, errc::unsupported,
                   std::to_string(ro - 1));
      if constexpr (batched_block_io_tier<T>) {
        if (ro < n) {
          const std::vector<block_write> mixed{{ro, other.data()}, {0, other.data()}};
          expect_error([&] { t.write_blocks(mixed); }, errc::unsupported, "slot 0");
        }
      }
    }
  }
  check_all("the whole contract");
}

}  // namespace oasiskv::testing
