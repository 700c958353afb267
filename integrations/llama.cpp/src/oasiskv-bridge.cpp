// SPDX-License-Identifier: Apache-2.0
// The C++20 side of llama.cpp's OasisKV memory: `tiered_kv_cache` over a host or file capacity
// tier and a host staging pool, with the block summary picked at run time, behind the virtual
// class of oasiskv-bridge.h. The instantiations are in oasiskv-bridge-{host,file}.cpp.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "oasiskv-bridge-impl.hpp"

namespace oasiskv_bridge {
namespace {

oasiskv::dtype to_dtype(kv_dtype t) {
  switch (t) {
    case kv_dtype::bf16:
      return oasiskv::dtype::bf16;
    case kv_dtype::f32:
      return oasiskv::dtype::f32;
    case kv_dtype::f16:
      break;
  }
  return oasiskv::dtype::f16;
}

}  // namespace

const char* cache::summary_names() {
  return "int2|cascade|minmax|qminmax|int8|int4";
}

std::unique_ptr<cache> cache::create(const cache_config& c) {
  const oasiskv::kv_layout l{c.layers,   c.q_heads,      c.kv_heads,
                             c.head_dim, c.block_tokens, to_dtype(c.dtype)};
  l.validate();
  if (c.max_tokens == 0 || c.max_sequences == 0) {
    throw std::invalid_argument(
        "oasiskv bridge: no room (max_tokens = " + std::to_string(c.max_tokens) +
        ", max_sequences = " + std::to_string(c.max_sequences) + ")");
  }
  if (!detail::with_summary(c.summary, [](auto) {})) {
    throw std::invalid_argument("unknown block summary '" + c.summary + "' (" + summary_names() +
                                ")");
  }
  const std::uint32_t blocks = l.blocks_for(c.max_tokens);
  // Every sequence at full length, each with its own copy of a partial block a fork shared.
  const std::uint64_t slow_slots = std::uint64_t{c.layers} * c.max_sequences * (blocks + 1);
  if (slow_slots >= oasiskv::null_slot) {
    throw std::invalid_argument("oasiskv bridge: " + std::to_string(slow_slots) +
                                " capacity blocks are more than a tier addresses");
  }
  oasiskv::cache_options o;
  o.max_tokens_per_sequence = c.max_tokens;
  o.budget_tokens = std::min(c.budget_tokens, blocks * c.block_tokens);
  const std::uint32_t budget_blocks = l.blocks_for(o.budget_tokens);
  // Per layer and sequence, the selection being attended and the next one being staged, plus
  // the kept blocks a lookahead adds (the mini-decoder's sizing, for each sequence held).
  const auto fast_slots = static_cast<std::uint32_t>(std::min<std::uint64_t>(
      slow_slots, std::uint64_t{c.layers} * (2 * budget_blocks + 4) * c.max_sequences));
  const auto slots = static_cast<std::uint32_t>(slow_slots);
  if (c.capacity == "host") {
    return detail::make_host_cache(c, l, slots, fast_slots, o);
  }
  if (c.capacity.rfind("file:", 0) == 0 && c.capacity.size() > 5) {
    return detail::make_file_cache(c, l, slots, fast_slots, o);
  }
  throw std::invalid_argument("unknown capacity tier '" + c.capacity + "' (host, or file:PATH)");
}

}  // namespace oasiskv_bridge
