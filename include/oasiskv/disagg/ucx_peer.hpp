// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `ucx_peer` (one exporter as a `ucx_engine` sees it) and `remote_block_source` (what the
//! engine needs of a remote tier).
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <concepts>
#include <cstdint>
#include <string>

#include "oasiskv/concepts/tier_backend.hpp"
#include "oasiskv/core/ids.hpp"

namespace oasiskv::disagg {

//! @brief One exporter as the engine sees it: an endpoint and the rkeys of its two regions.
//! READY until a failure or a deadline, then CLOSING until the forced close completes, then
//! DEAD: its batches fail, later submits to it are refused.
struct ucx_peer {
  enum class state : std::uint8_t { ready, closing, dead };
  std::string name;
  ucp_ep_h ep = nullptr;
  ucp_rkey_h arena_rkey = nullptr;
  ucp_rkey_h gen_rkey = nullptr;
  state st = state::ready;
  std::string failure;
  std::string pending_error;  // set by the UCX error callback, acted on by the progress loop
  void* close_request = nullptr;
  //! The tier that connected it is gone (`ucx_engine::disconnect`): closed and dropped once no
  //! batch reads from it.
  std::atomic<bool> released{false};
  //! `ucx_engine::close_peer` asked for its endpoint to be force-closed.
  std::atomic<bool> close_requested{false};
  std::string pending_close;  // its reason (under the engine's caller-side lock)
};

//! @brief What the engine needs of a remote source tier (`ucx_remote_tier` models it).
template <class T>
concept remote_block_source = tier_backend<T> && requires(const T& t, slot_id s) {
  { t.peer() } -> std::same_as<ucx_peer*>;
  { t.remote_address(s) } -> std::same_as<std::uint64_t>;
  { t.generation_address(s) } -> std::same_as<std::uint64_t>;
  { t.expected_generation(s) } -> std::same_as<std::uint64_t>;
};

}  // namespace oasiskv::disagg
