// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `fmt::formatter` specialisations for OasisKV's vocabulary types (optional; needs fmt,
//! through the `oasiskv::fmt` target).
#pragma once

#include <fmt/format.h>

#include "oasiskv/concepts/tier_backend.hpp"
#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/layout.hpp"

// fmt specialisations (`fmt::format("{}", x)` works for these types); the reference leaves them
// out.
//! @cond
template <>
struct fmt::formatter<oasiskv::dtype> : fmt::formatter<std::string_view> {
  auto format(oasiskv::dtype t, fmt::format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(oasiskv::to_string(t), ctx);
  }
};

template <>
struct fmt::formatter<oasiskv::errc> : fmt::formatter<std::string_view> {
  auto format(oasiskv::errc e, fmt::format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(oasiskv::to_string(e), ctx);
  }
};

template <>
struct fmt::formatter<oasiskv::memory_kind> : fmt::formatter<std::string_view> {
  auto format(oasiskv::memory_kind k, fmt::format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(oasiskv::to_string(k), ctx);
  }
};

//! Prints `layers=30 q_heads=9 kv_heads=3 head_dim=64 block=16 dtype=f16`.
template <>
struct fmt::formatter<oasiskv::kv_layout> {
  constexpr auto parse(fmt::format_parse_context& ctx) { return ctx.begin(); }
  auto format(const oasiskv::kv_layout& l, fmt::format_context& ctx) const {
    return fmt::format_to(ctx.out(),
                          "layers={} q_heads={} kv_heads={} head_dim={} block={} dtype={}",
                          l.num_layers, l.num_q_heads, l.num_kv_heads, l.head_dim,
                          l.tokens_per_block, oasiskv::to_string(l.kv_dtype));
  }
};
//! @endcond
