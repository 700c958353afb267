// The facade with scheduler `all_resident` and every predictor and kernel (combinations.hpp).
#include "kv_cache/combinations.hpp"

using namespace oasiskv;
namespace c = oasiskv::testing::combinations;

TEST_CASE("all_resident x every predictor, both kernels: full budget equals dense") {
  c::run_scheduler_suite<all_resident>();
}
