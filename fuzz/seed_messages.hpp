// SPDX-License-Identifier: Apache-2.0
// One valid message of each type of the control protocol, the fuzz targets' starting points.
#pragma once

#include <cstddef>
#include <vector>

#include "oasiskv/disagg/protocol.hpp"

namespace fuzz {

inline const oasiskv::kv_layout seed_layout{2, 4, 2, 64, 16, oasiskv::dtype::f16};

//! A session that `seed_opened()` fits: 4 slots of the seed layout.
inline oasiskv::disagg::hello_ack_msg seed_ack() {
  using namespace oasiskv::disagg;
  const oasiskv::kv_layout& l = seed_layout;
  hello_ack_msg a;
  a.session = 1;
  a.lease_ms = 100;
  a.layout = l;
  a.num_slots = 4;
  a.slot_bytes = l.block_bytes();
  a.arena = {4096, 4 * l.block_bytes(), std::vector<std::byte>(24, std::byte{1})};
  a.generations = {8192, 32, std::vector<std::byte>(24, std::byte{2})};
  a.worker_address.assign(30, std::byte{3});
  return a;
}

inline oasiskv::disagg::opened_msg seed_opened() {
  oasiskv::disagg::opened_msg o;
  o.seq = 1;
  o.tokens = 20;
  o.num_layers = 2;
  o.blocks_per_layer = 2;
  o.blocks = {{0, 1}, {1, 1}, {2, 1}, {3, 1}};
  o.summary_bytes = 512;  // the seed layout's: 2 x 2 KV heads x 64 x 2 bytes
  return o;
}

inline std::vector<oasiskv::disagg::message> seed_messages() {
  using namespace oasiskv::disagg;
  summary_chunk_msg sc{1, 0, std::vector<std::byte>(32, std::byte{7})};
  return {hello_msg{{}, "d", 0},
          seed_ack(),
          open_msg{1, 1},
          seed_opened(),
          heartbeat_msg{{1, 2}},
          heartbeat_ack_msg{1, 1, 0},
          release_msg{1},
          released_msg{1},
          error_msg{3, "x"},
          challenge_msg{},
          auth_msg{},
          sc};
}

}  // namespace fuzz
