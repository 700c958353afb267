// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/ops/threads.hpp>

#include <mini_decoder/io/error.hpp>

#include "oasiskv/cpu/thread_pool.hpp"

extern "C" void openblas_set_num_threads(int);  // OpenBLAS's own; not in cblas.h everywhere

namespace mini_decoder {

namespace {

std::shared_ptr<oasiskv::cpu::thread_pool>& pool_slot() {
  static std::shared_ptr<oasiskv::cpu::thread_pool> p =
      std::make_shared<oasiskv::cpu::thread_pool>(1);
  return p;
}

}  // namespace

void set_num_threads(int n) {
  if (n < 1) {
    fail("--threads = ", n, " must be at least 1");
  }
  if (engine_pool().size() != static_cast<unsigned>(n)) {
    pool_slot() = std::make_shared<oasiskv::cpu::thread_pool>(static_cast<unsigned>(n));
  }
  openblas_set_num_threads(n);
}

int num_threads() {
  return static_cast<int>(engine_pool().size());
}

oasiskv::cpu::thread_pool& engine_pool() {
  return *pool_slot();
}

std::shared_ptr<oasiskv::cpu::thread_pool> shared_engine_pool() {
  return pool_slot();
}

}  // namespace mini_decoder
