// SPDX-License-Identifier: Apache-2.0
#include <doctest/doctest.h>

#include <string>

#include "oasiskv/core/layout.hpp"
#include "oasiskv/core/views.hpp"

using oasiskv::dtype;
using oasiskv::errc;
using oasiskv::kv_layout;

namespace {
kv_layout smollm2() {
  return {30, 9, 3, 64, 16, dtype::f16};
}

// Checks that `l.validate()` throws `invalid_layout` with a message containing `needle`.
void check_rejected(const kv_layout& l, const std::string& needle) {
  try {
    l.validate();
    FAIL("validate() accepted a bad layout; expected a message naming: " << needle);
  } catch (const oasiskv::error& e) {
    CHECK(e.code() == errc::invalid_layout);
    const std::string what = e.what();
    INFO(what);
    CHECK(what.find(needle) != std::string::npos);
  }
}
}  // namespace

TEST_CASE("kv_layout: sizes and offsets of one block") {
  const kv_layout l = smollm2();
  REQUIRE_NOTHROW(l.validate());
  CHECK(l.group_size() == 3);
  CHECK(l.row_bytes() == 128);
  CHECK(l.head_bytes() == 16 * 128);
  CHECK(l.block_bytes() == 2 * 3 * 16 * 128);
  CHECK(l.key_offset(0) == 0);
  CHECK(l.key_offset(2) == 2 * l.head_bytes());
  CHECK(l.value_offset(0) == 3 * l.head_bytes());
  CHECK(l.value_offset(2) == 5 * l.head_bytes());
  CHECK(l.blocks_for(0) == 0);
  CHECK(l.blocks_for(1) == 1);
  CHECK(l.blocks_for(16) == 1);
  CHECK(l.blocks_for(17) == 2);
  CHECK(l.bytes_per_token() == 2 * 30 * 3 * 128);
  const kv_layout f32{32, 32, 8, 128, 16, dtype::f32};
  CHECK(f32.block_bytes() == 2 * 8 * 16 * 128 * 4);
}

TEST_CASE("kv_layout::validate names the bad field and value") {
  kv_layout l = smollm2();
  l.num_layers = 0;
  check_rejected(l, "num_layers = 0");
  l = smollm2();
  l.num_layers = 100000;
  check_rejected(l, "num_layers = 100000");
  l = smollm2();
  l.num_q_heads = 0;
  check_rejected(l, "num_q_heads = 0");
  l = smollm2();
  l.num_kv_heads = 0;
  check_rejected(l, "num_kv_heads = 0");
  l = smollm2();
  l.num_kv_heads = 4;  // 9 q heads do not split into groups of 4 kv heads
  check_rejected(l, "num_q_heads = 9 is not a multiple of num_kv_heads = 4");
  l = smollm2();
  l.num_kv_heads = 18;
  check_rejected(l, "num_kv_heads = 18");
  l = smollm2();
  l.head_dim = 0;
  check_rejected(l, "head_dim = 0");
  l = smollm2();
  l.head_dim = 60;
  check_rejected(l, "head_dim = 60: must be a multiple of 8");
  l = smollm2();
  l.head_dim = 4096;
  check_rejected(l, "head_dim = 4096");
  l = smollm2();
  l.tokens_per_block = 0;
  check_rejected(l, "tokens_per_block = 0");
  l = smollm2();
  l.tokens_per_block = 1u << 20;
  check_rejected(l, "tokens_per_block = 1048576");
  l = smollm2();
  l.kv_dtype = static_cast<dtype>(7);
  check_rejected(l, "kv_dtype = 7");
  // Every field legal on its own, but one layer's block would be 4 GiB.
  check_rejected({1, 1024, 1024, 1024, 1024, dtype::f32}, "block_bytes() = 8589934592");
}

TEST_CASE("block_pool_view::validate rejects null, misaligned and short strides") {
  alignas(64) static std::byte storage[4 * 6144 + 64];
  const kv_layout l = smollm2();
  oasiskv::block_pool_view v{storage, l.block_bytes(), 4, l};
  REQUIRE_NOTHROW(v.validate());
  CHECK(v.slot(2) == storage + 2 * l.block_bytes());
  CHECK(reinterpret_cast<const std::byte*>(v.values<oasiskv::f16>(1, 2)) ==
        storage + l.block_bytes() + l.value_offset(2));

  auto expect = [](const oasiskv::block_pool_view& bad, errc code, const char* needle) {
    try {
      bad.validate();
      FAIL("accepted a bad view");
    } catch (const oasiskv::error& e) {
      CHECK(e.code() == code);
      CHECK(std::string(e.what()).find(needle) != std::string::npos);
    }
  };
  auto bad = v;
  bad.base = nullptr;
  expect(bad, errc::invalid_argument, "base is null");
  bad = v;
  bad.base = storage + 4;
  expect(bad, errc::misaligned, "is not 16-byte aligned");
  bad = v;
  bad.slot_stride = l.block_bytes() - 16;
  expect(bad, errc::layout_mismatch, "slot_stride = 12272");
  bad = v;
  bad.num_slots = 0;
  expect(bad, errc::invalid_argument, "num_slots is 0");
}
