// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The engine's threads: one pool that the products and the attention kernel share.
#pragma once

#include <memory>

namespace oasiskv::cpu {
class thread_pool;
}

namespace mini_decoder {

//! Threads of the engine's pool (`engine_pool`) and of OpenBLAS (prefill's sgemm); 1 at start.
void set_num_threads(int n);
int num_threads();
//! The engine's one thread pool: the products run on it, and the KV backends hand it to the
//! attention kernel, so products and attention never have two pools contending for the cores.
//! `set_num_threads` replaces it; holders of `shared_engine_pool` keep the one they got.
oasiskv::cpu::thread_pool& engine_pool();
std::shared_ptr<oasiskv::cpu::thread_pool> shared_engine_pool();

}  // namespace mini_decoder
