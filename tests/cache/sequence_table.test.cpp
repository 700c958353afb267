// SPDX-License-Identifier: Apache-2.0
// cache::sequence_table: ids, lookups that name what a call got wrong, and the layers of an
// adopted sequence laid out from its slots.
#include <doctest/doctest.h>

#include <vector>

#include "oasiskv/cache/sequence_table.hpp"
#include "support/expect_error.hpp"

using namespace oasiskv;
using oasiskv::testing::expect_error;

TEST_CASE("cache::sequence_table: lookups and their errors") {
  cache::sequence_table t(3);
  const sequence_id a = t.insert_empty();
  const sequence_id b = t.insert_empty();
  CHECK(a != b);
  CHECK(t.size() == 2);
  t.at(a, 2, "append").tokens = 5;
  CHECK(t.layers(a, "length")[2].tokens == 5);
  CHECK(t.at(b, 2, "length").tokens == 0);
  expect_error([&] { t.at(a, 3, "attend"); }, errc::out_of_range,
               "attend: layer 3 is outside the model's 3 layers");
  expect_error([&] { t.layers(sequence_id{99}, "fork"); }, errc::unknown_sequence,
               "fork: sequence 99 is not in the cache");

  std::vector<cache::layer_state*> got;
  const std::vector<sequence_id> both{b, a};
  t.gather(both, 1, "lookahead", got);
  REQUIRE(got.size() == 2);
  CHECK(got[0] == &t.at(b, 1, "x"));
  CHECK(got[1] == &t.at(a, 1, "x"));
  const std::vector<sequence_id> twice{a, b, a};
  expect_error([&] { t.gather(twice, 0, "append", got); }, errc::invalid_argument,
               "append: sequence " + std::to_string(static_cast<std::uint64_t>(a)) +
                   " appears more than once");
  t.erase(a);
  CHECK(t.size() == 1);
  expect_error([&] { t.at(a, 0, "remove"); }, errc::unknown_sequence, "is not in the cache");
  const sequence_id c = t.insert_empty();
  CHECK(c != a);  // ids are never reused

  std::size_t visited = 0;
  t.for_each_layer([&](cache::layer_state&) { ++visited; });
  CHECK(visited == 2 * 3);
}

TEST_CASE("cache::sequence_table: an adopted sequence's layers, layer-major") {
  cache::sequence_table t(2);
  const std::vector<slot_id> slots{10, 11, 12, 20, 21, 22};
  const std::vector<cache::layer_state> layers = t.adopted(9, slots, 3);
  REQUIRE(layers.size() == 2);
  CHECK(layers[0].tokens == 9);
  CHECK(layers[0].blocks == std::vector<slot_id>{10, 11, 12});
  CHECK(layers[1].blocks == std::vector<slot_id>{20, 21, 22});
  CHECK_FALSE(layers[1].pending.has_value());
}
