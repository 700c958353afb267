// SPDX-License-Identifier: Apache-2.0
// The facade with scheduler `lookahead_prefetcher<lru_eviction>`, predictors x kernels
// (combinations.hpp).
#include "kv_cache/combinations.hpp"

using namespace oasiskv;
namespace c = oasiskv::testing::combinations;

TEST_CASE(
    "lookahead_prefetcher<lru_eviction> x every predictor, both kernels: full budget == dense, "
    "small == reference over selection") {
  c::run_scheduler_suite<lookahead_prefetcher<lru_eviction>, true>();  // every predictor, always
}

TEST_CASE(
    "lookahead_prefetcher<lru_eviction>: oracle + fetch-on-miss equals sparse attention over its "
    "selection") {
  if constexpr (c::full_cross) {  // the subset: the sparse kernel only
    c::oracle_equals_sparse_over_its_selection<lookahead_prefetcher<lru_eviction>,
                                               reference_decode>();
  }
  c::oracle_equals_sparse_over_its_selection<lookahead_prefetcher<lru_eviction>,
                                             cpu::sparse_decode>();
}
