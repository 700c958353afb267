// SPDX-License-Identifier: Apache-2.0
// The facade with scheduler `all_resident`, predictors x kernels (combinations.hpp).
#include "kv_cache/combinations.hpp"

using namespace oasiskv;
namespace c = oasiskv::testing::combinations;

TEST_CASE(
    "all_resident: predictors x kernels (combinations.hpp), full budget == dense, small == "
    "reference over selection") {
  c::run_scheduler_suite<all_resident>();
}
