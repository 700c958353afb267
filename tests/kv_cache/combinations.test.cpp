// SPDX-License-Identifier: Apache-2.0
// The facade combinations suite (combinations.hpp) in one translation unit: under the
// sanitizers most of a TU's compile time is the shared part (the kernels, the summaries), not
// the per-combination instantiations, so one TU builds faster than one per scheduler.
#include "kv_cache/combinations_all_resident.test.cpp"
#include "kv_cache/combinations_on_demand.test.cpp"
#include "kv_cache/combinations_prefetch_lru.test.cpp"
#include "kv_cache/combinations_prefetch_score.test.cpp"
