// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cpu::loop_runner`: the threads a predictor spreads its scoring over, whoever owns
//! them: OasisKV's own `cpu::thread_pool`, or an engine's threads lent for one operation (an
//! engine that runs attention inside its own thread pool's operation, as llama.cpp's ggml does).
#pragma once

#include <cstddef>
#include <memory>
#include <type_traits>

namespace oasiskv::cpu {

//! @brief Runs parallel loops on a set of threads, the calling thread among them.
class loop_runner {
 public:
  //! @brief Threads that run a loop, the caller included.
  virtual unsigned size() const noexcept = 0;
  //! @brief Runs `fn(ctx, i)` for every `i` in `[0, n)`; returns when all have finished and
  //! rethrows the first exception one of them threw (every index still runs).
  virtual void run(std::size_t n, void (*fn)(void* ctx, std::size_t i), void* ctx) = 0;

  //! @brief `run` for a callable: `f(i)` for every `i` in `[0, n)`.
  template <class F>
  void parallel_for(std::size_t n, F&& f) {
    using fn_type = std::remove_reference_t<F>;
    run(
        n, [](void* ctx, std::size_t i) { (*static_cast<fn_type*>(ctx))(i); },
        const_cast<void*>(static_cast<const void*>(std::addressof(f))));
  }

 protected:
  ~loop_runner() = default;
};

}  // namespace oasiskv::cpu
