// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The `device_selector` concept: block selection on the GPU, from a device summary
//! into device block tables.
#pragma once

#include <concepts>
#include <cstdint>

#include "oasiskv/concepts/device_summary.hpp"
#include "oasiskv/core/layout.hpp"

namespace oasiskv {

//! @brief Scores every block of a batch of sequences on a `device_summary` `S` and writes each
//! table's selected blocks into device memory, with no host round trip: the GPU counterpart of
//! an `importance_predictor` (whose input and tables are host memory). The model is
//! `cuda::topk_selector` (`predictor/cuda/`), over both device summaries.
//!
//! Required expressions, for `p` a `const P&`, `s` a `const S&`, `r` a
//! `const typename P::request&` (the batch: device pointers to queries, lengths, each block's
//! summary entry and staging slot, the output tables; and the `selection_params`), `l` a
//! `const kv_layout&` and `n` a `std::uint32_t`:
//! - `p.select(s, r)`: enqueues the scoring and the selection on the selector's stream
//!   (asynchronous, capturable in a CUDA graph once reserved); a malformed request throws
//!   `oasiskv::error` before any launch.
//! - `p.reserve(l, n, n)`: allocates the workspace for up to `n` sequences of `n` blocks, so
//!   that a captured `select` allocates nothing.
//! - `p.check_status()`: synchronises and throws what only the device saw (a sequence past the
//!   request's block bound, a bad weight), then clears it.
template <class P, class S>
concept device_selector = device_summary<S> &&
    requires(const P& p, const S& s, const typename P::request& r, const kv_layout& l,
             std::uint32_t n) {
  { p.select(s, r) } -> std::same_as<void>;
  { p.reserve(l, n, n) } -> std::same_as<void>;
  { p.check_status() } -> std::same_as<void>;
};

}  // namespace oasiskv
