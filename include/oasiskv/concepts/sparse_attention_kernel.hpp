// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The `sparse_attention_kernel` concept.
#pragma once

#include <concepts>

#include "oasiskv/core/decode_params.hpp"

namespace oasiskv {

//! @brief Decode attention of 1-16 query tokens per sequence over a table of staged blocks.
//!
//! Required expression, for `k` a `K&` and `p` a `const decode_params&`:
//! - `k.decode(p)`: for every sequence, query token and q head, writes to `p.out` the softmax-
//!   weighted sum of the values of the tokens its table lists (GQA: q head `h` reads KV head
//!   `h / group_size()`; causal among the new tokens: see `decode_params`) and to `p.lse` the
//!   natural log of the softmax denominator, so partial results over disjoint block sets merge
//!   exactly. Bad parameters throw `oasiskv::error` before any output is written. Reads each
//!   listed K and V byte once per KV head group; O(total selected bytes).
//! The result must match `reference_decode` to f32 rounding (f32 KV) or to the precision of the
//! stored KV (f16, bf16).
template <class K>
concept sparse_attention_kernel = requires(K& k, const decode_params& p) {
  { k.decode(p) } -> std::same_as<void>;
};

//! @brief Optional hook: a kernel that reads device memory but takes block tables built on the
//! host (a CUDA kernel that uploads them).
//!
//! Additional expression, for `k` a `K&` and `p` a `const decode_params&`:
//! - `k.decode_host_tables(p)`: as `decode(p)`, except that `p`'s tables, offsets and lengths
//!   are host memory (the KV and queries are where the kernel reads them).
//! `tiered_kv_cache` builds its tables on the host, so it calls this where a kernel has it.
template <class K>
concept host_table_kernel = sparse_attention_kernel<K> && requires(K& k, const decode_params& p) {
  { k.decode_host_tables(p) } -> std::same_as<void>;
};

}  // namespace oasiskv
