// SPDX-License-Identifier: Apache-2.0
// Synthetic KV and queries for the prefill/decode demo (`--synthetic`; model_run.hpp runs a model).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/layout.hpp"

namespace pd_demo {

//! A small Llama-like shape: 8 layers, 8 q / 2 kv heads, head_dim 64, f16, 16-token blocks
//! (8 KiB per block and layer, 4 KiB of KV per token).
inline const oasiskv::kv_layout layout{8, 8, 2, 64, 16, oasiskv::dtype::f16};

struct rng {
  std::uint64_t s;
  std::uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
  float uniform() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f; }
};

//! Keys with a per-block "topic" offset, so that some blocks matter more to a query than others
//! (what makes selection meaningful); values uniform.
inline void fill_block(std::byte* out, std::uint64_t seq, std::uint32_t layer,
                       std::uint32_t block) {
  const auto& l = layout;
  rng r{(seq * 1000003 + layer) * 7919 + block + 1};
  auto* e = reinterpret_cast<oasiskv::f16*>(out);
  const std::size_t head = std::size_t{l.tokens_per_block} * l.head_dim;
  for (std::uint32_t kv = 0; kv < 2; ++kv) {
    for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
      rng topic{(block * 31 + h) * 2654435761u + layer + 1};
      const float strength = (block % 17 == 3) ? 1.5f : 0.1f;  // a few salient blocks
      for (std::size_t i = 0; i < head; ++i) {
        const float base = kv == 0 ? strength * topic.uniform() : 0.0f;
        e[(std::size_t{kv} * l.num_kv_heads + h) * head + i] =
            oasiskv::f16::from_float(base + r.uniform());
      }
    }
  }
}

inline long rss_kib(const char* field) {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  char line[256];
  long v = -1;
  const std::size_t n = std::strlen(field);
  while (f != nullptr && std::fgets(line, sizeof line, f) != nullptr) {
    if (std::strncmp(line, field, n) == 0) {
      v = std::atol(line + n + 1);
    }
  }
  if (f != nullptr) {
    std::fclose(f);
  }
  return v;
}

}  // namespace pd_demo
