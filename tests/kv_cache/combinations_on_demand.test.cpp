// SPDX-License-Identifier: Apache-2.0
// The facade with scheduler `on_demand_fetcher<>`, predictors x kernels
// (combinations.hpp).
#include "kv_cache/combinations.hpp"

using namespace oasiskv;
namespace c = oasiskv::testing::combinations;

TEST_CASE(
    "on_demand_fetcher<>: predictors x kernels (combinations.hpp), full budget == dense, small == "
    "reference over selection") {
  c::run_scheduler_suite<on_demand_fetcher<>>();
}

TEST_CASE(
    "on_demand_fetcher<>: oracle + fetch-on-miss equals sparse attention over its selection") {
  if constexpr (c::full_cross) {  // the subset: the sparse kernel only
    c::oracle_equals_sparse_over_its_selection<on_demand_fetcher<>, reference_decode>();
  }
  c::oracle_equals_sparse_over_its_selection<on_demand_fetcher<>, cpu::sparse_decode>();
}
