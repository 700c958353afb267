// SPDX-License-Identifier: Apache-2.0
#include <doctest/doctest.h>

#include "support/expect_error.hpp"

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "oasiskv/allocator/free_list_allocator.hpp"
#include "oasiskv/allocator/refcounted_allocator.hpp"

using oasiskv::errc;
using oasiskv::free_list_allocator;
using oasiskv::refcounted_allocator;
using oasiskv::slot_id;

namespace {
using oasiskv::testing::expect_error;
}  // namespace

// Every allocator model goes through the same block_allocator cases.
TEST_CASE_TEMPLATE("block_allocator: exhaust, refill, reject foreign and double frees", A,
                   free_list_allocator, refcounted_allocator<free_list_allocator>) {
  A a(8);
  CHECK(a.capacity() == 8);
  CHECK(a.available() == 8);
  std::set<slot_id> got;
  for (int i = 0; i < 8; ++i) {
    auto s = a.allocate();
    REQUIRE(s.has_value());
    CHECK(*s < 8);
    CHECK(got.insert(*s).second);  // never the same slot twice
  }
  CHECK(a.available() == 0);
  CHECK_FALSE(a.allocate().has_value());  // full is not an error

  a.deallocate(3);
  CHECK(a.available() == 1);
  expect_error([&] { a.deallocate(3); }, errc::double_free, "slot 3");
  expect_error([&] { a.deallocate(8); }, errc::invalid_slot, "slot 8");
  expect_error([&] { a.deallocate(oasiskv::null_slot); }, errc::invalid_slot, "4294967295");
  CHECK(a.available() == 1);  // failed calls changed nothing
  CHECK(a.allocate() == std::optional<slot_id>{3});
}

TEST_CASE_TEMPLATE("block_allocator: 100k random operations keep every invariant", A,
                   free_list_allocator, refcounted_allocator<free_list_allocator>) {
  constexpr std::size_t capacity = 97;
  A a(capacity);
  std::vector<bool> held(capacity, false);  // the model: which slots are handed out
  std::size_t held_count = 0;
  std::mt19937 rng(1234);
  for (int op = 0; op < 100000; ++op) {
    const unsigned r = rng() % 10;
    if (r < 5) {
      auto s = a.allocate();
      if (held_count == capacity) {
        REQUIRE_FALSE(s.has_value());
      } else {
        REQUIRE(s.has_value());
        REQUIRE(*s < capacity);
        REQUIRE_FALSE(held[*s]);
        held[*s] = true;
        ++held_count;
      }
    } else if (r < 9) {
      const slot_id s = static_cast<slot_id>(rng() % capacity);
      if (held[s]) {
        a.deallocate(s);
        held[s] = false;
        --held_count;
      } else {
        REQUIRE_THROWS_AS(a.deallocate(s), oasiskv::error);
      }
    } else {
      REQUIRE_THROWS_AS(a.deallocate(static_cast<slot_id>(capacity + rng() % 1000)),
                        oasiskv::error);
    }
    REQUIRE(a.available() == capacity - held_count);
  }
}

TEST_CASE("free_list_allocator: bad capacities and the O(1) reuse order") {
  expect_error([] { free_list_allocator a(0); }, errc::invalid_argument, "capacity = 0");
  expect_error([] { free_list_allocator a(std::size_t{1} << 33); }, errc::invalid_argument,
               "capacity = 8589934592");
  free_list_allocator a(4);
  CHECK(a.allocate() == std::optional<slot_id>{0});
  CHECK(a.allocate() == std::optional<slot_id>{1});
  a.deallocate(0);
  CHECK(a.allocate() == std::optional<slot_id>{0});  // most recently freed first
  CHECK(a.is_allocated(1));
  CHECK_FALSE(a.is_allocated(2));
  CHECK_FALSE(a.is_allocated(99));
}

TEST_CASE("refcounted_allocator: shared blocks live until the last holder lets go") {
  refcounted_allocator<free_list_allocator> a(2);
  const slot_id s = *a.allocate();
  a.retain(s);
  a.retain(s);
  CHECK(a.use_count(s) == 3);
  a.deallocate(s);
  a.deallocate(s);
  CHECK(a.available() == 1);  // still held once
  CHECK(a.base().is_allocated(s));
  a.deallocate(s);
  CHECK(a.available() == 2);
  CHECK(a.use_count(s) == 0);
  expect_error([&] { a.retain(s); }, errc::double_free, "retain(slot 0)");
  expect_error([&] { a.retain(5); }, errc::invalid_slot, "retain(slot 5)");
}

TEST_CASE("refcounted_allocator: copy-on-write gives the writer a private slot") {
  refcounted_allocator<free_list_allocator> a(3);
  const slot_id shared = *a.allocate();
  // Sole holder: writes in place.
  auto w = a.prepare_write(shared);
  REQUIRE(w.has_value());
  CHECK(w->slot == shared);
  CHECK_FALSE(w->copied);
  // A fork shares it; the fork's write moves it to a fresh slot, the original keeps `shared`.
  a.retain(shared);
  w = a.prepare_write(shared);
  REQUIRE(w.has_value());
  CHECK(w->copied);
  CHECK(w->slot != shared);
  CHECK(a.use_count(shared) == 1);
  CHECK(a.use_count(w->slot) == 1);
  // Pool exhausted while a copy is needed: nullopt, nothing changes.
  a.retain(shared);
  (void)a.allocate();
  CHECK(a.available() == 0);
  CHECK_FALSE(a.prepare_write(shared).has_value());
  CHECK(a.use_count(shared) == 2);
}

TEST_CASE("refcounted_allocator: 100k random fork/write/release operations") {
  constexpr std::size_t capacity = 64;
  refcounted_allocator<free_list_allocator> a(capacity);
  std::map<slot_id, std::uint32_t> model;  // slot -> holders
  std::mt19937 rng(99);
  auto random_held = [&]() {
    auto it = model.begin();
    std::advance(it, static_cast<long>(rng() % model.size()));
    return it->first;
  };
  for (int op = 0; op < 100000; ++op) {
    const unsigned r = rng() % 4;
    if (r == 0 || model.empty()) {
      auto s = a.allocate();
      REQUIRE(s.has_value() == (model.size() < capacity));
      if (s) {
        REQUIRE_FALSE(model.contains(*s));
        model[*s] = 1;
      }
    } else if (r == 1) {
      const slot_id s = random_held();
      a.retain(s);
      ++model[s];
    } else if (r == 2) {
      const slot_id s = random_held();
      a.deallocate(s);
      if (--model[s] == 0) {
        model.erase(s);
      }
    } else {
      const slot_id s = random_held();
      const bool shared = model[s] > 1;
      auto w = a.prepare_write(s);
      if (!shared) {
        REQUIRE((w && w->slot == s && !w->copied));
      } else if (model.size() == capacity) {
        REQUIRE_FALSE(w.has_value());
      } else {
        REQUIRE((w && w->copied && !model.contains(w->slot)));
        --model[s];
        model[w->slot] = 1;
      }
    }
    REQUIRE(a.available() == capacity - model.size());
    if (op % 997 == 0) {
      for (auto [s, n] : model) {
        REQUIRE(a.use_count(s) == n);
      }
    }
  }
}

TEST_CASE("free_list_allocator: take hands out one particular slot") {
  free_list_allocator a(4);
  a.take(2);
  CHECK(a.is_allocated(2));
  CHECK(a.available() == 3);
  expect_error([&] { a.take(2); }, errc::invalid_argument, "take(slot 2)");
  expect_error([&] { a.take(4); }, errc::invalid_slot, "take(slot 4)");
  CHECK(a.available() == 3);
  std::set<slot_id> rest;
  while (auto s = a.allocate()) {
    rest.insert(*s);
  }
  CHECK(rest == std::set<slot_id>{0, 1, 3});
  a.deallocate(2);
  a.take(2);  // a freed slot can be taken again
  CHECK(a.available() == 0);
}

TEST_CASE("refcounted_allocator: adopt and reserve") {
  refcounted_allocator<free_list_allocator> a(6);
  // A free pool slot is adopted: taken out of the pool with one holder.
  a.adopt(4);
  CHECK(a.use_count(4) == 1);
  CHECK(a.available() == 5);
  expect_error([&] { a.adopt(4); }, errc::invalid_argument,
               "adopt(slot 4): slot is already in use");
  expect_error([&] { a.adopt(6); }, errc::invalid_slot, "adopt(slot 6)");
  a.retain(4);
  expect_error([&] { a.adopt(4); }, errc::invalid_argument, "(2 holders)");
  a.deallocate(4);
  a.deallocate(4);
  CHECK(a.available() == 6);  // back to the pool
  // Reserved slots are never allocated; adopted, they return to the reserve.
  a.reserve(0);
  a.reserve(1);
  expect_error([&] { a.reserve(1); }, errc::invalid_argument,
               "reserve(slot 1): slot is already reserved");
  expect_error([&] { a.reserve(9); }, errc::invalid_slot, "reserve(slot 9)");
  const slot_id held = *a.allocate();
  expect_error([&] { a.reserve(held); }, errc::invalid_argument, "in use");
  a.deallocate(held);
  CHECK(a.available() == 4);
  std::set<slot_id> got;
  while (auto s = a.allocate()) {
    got.insert(*s);
  }
  CHECK(got == std::set<slot_id>{2, 3, 4, 5});
  a.adopt(1);
  CHECK(a.use_count(1) == 1);
  a.retain(1);
  auto w = a.prepare_write(1);  // shared: copy-on-write needs a free slot, none left
  CHECK_FALSE(w.has_value());
  a.deallocate(1);
  a.deallocate(1);
  CHECK(a.use_count(1) == 0);
  CHECK(a.is_reserved(1));
  CHECK(a.available() == 0);  // not in the pool
  expect_error([&] { a.deallocate(1); }, errc::double_free, "deallocate(slot 1)");
  a.adopt(1);  // and can be adopted again
  CHECK(a.use_count(1) == 1);
}

TEST_CASE("refcounted_allocator: 50k random operations with adopted and reserved slots") {
  constexpr std::size_t capacity = 48;
  constexpr slot_id reserved = 16;  // slots [0, 16) are adopt-only
  refcounted_allocator<free_list_allocator> a(capacity);
  for (slot_id s = 0; s < reserved; ++s) {
    a.reserve(s);
  }
  std::map<slot_id, std::uint32_t> model;
  std::mt19937 rng(7);
  for (int op = 0; op < 50000; ++op) {
    const unsigned r = rng() % 5;
    if (r == 0) {
      auto s = a.allocate();
      std::size_t pool_held = 0;
      for (auto [slot, n] : model) {
        pool_held += slot >= reserved;
      }
      REQUIRE(s.has_value() == (pool_held < capacity - reserved));
      if (s) {
        REQUIRE(*s >= reserved);
        REQUIRE_FALSE(model.contains(*s));
        model[*s] = 1;
      }
    } else if (r == 1) {
      const auto s = static_cast<slot_id>(rng() % (capacity + 2));
      if (s >= capacity) {
        expect_error([&] { a.adopt(s); }, errc::invalid_slot, "adopt(slot " + std::to_string(s));
      } else if (model.contains(s)) {
        expect_error([&] { a.adopt(s); }, errc::invalid_argument, "already in use");
      } else {
        a.adopt(s);
        model[s] = 1;
      }
    } else if (!model.empty()) {
      auto it = model.begin();
      std::advance(it, static_cast<long>(rng() % model.size()));
      const slot_id s = it->first;
      if (r == 2) {
        a.retain(s);
        ++it->second;
      } else {
        a.deallocate(s);
        if (--it->second == 0) {
          model.erase(it);
        }
      }
    }
    std::size_t pool_held = 0;
    for (auto [slot, n] : model) {
      pool_held += slot >= reserved;
    }
    REQUIRE(a.available() == capacity - reserved - pool_held);
  }
  for (auto [s, n] : model) {
    CHECK(a.use_count(s) == n);
    CHECK(a.is_reserved(s) == (s < reserved));
  }
}
