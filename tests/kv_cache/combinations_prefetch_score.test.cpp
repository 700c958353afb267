// SPDX-License-Identifier: Apache-2.0
// The facade with scheduler `lookahead_prefetcher<score_eviction>`, predictors x kernels
// (combinations.hpp).
#include "kv_cache/combinations.hpp"

using namespace oasiskv;
namespace c = oasiskv::testing::combinations;

TEST_CASE(
    "lookahead_prefetcher<score_eviction>: predictors x kernels, full budget == dense, small == "
    "reference over selection") {
  c::run_scheduler_suite<lookahead_prefetcher<score_eviction>>();
}

TEST_CASE(
    "lookahead_prefetcher<score_eviction>: oracle + fetch-on-miss equals sparse attention over its "
    "selection") {
  if constexpr (c::full_cross) {  // the subset: the sparse kernel only
    c::oracle_equals_sparse_over_its_selection<lookahead_prefetcher<score_eviction>,
                                               reference_decode>();
  }
  c::oracle_equals_sparse_over_its_selection<lookahead_prefetcher<score_eviction>,
                                             cpu::sparse_decode>();
}
