// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief What every device summary's fold kernel is told: which entry, which keys, and the
//! token count it leaves. `cuda::device_summary_store` fills it; each summary's kernel arguments
//! add its own arrays to it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace oasiskv::cuda::detail {

//! @brief One fold into entry `entry`: keys `(t, h, x)` at `keys[t * token_stride + h *
//! head_stride + x]` for `t < count`; `fresh` starts from the empty entry (the host's `reset`
//! then `update`), `clear` writes the empty entry and reads no keys. Passed by value.
struct summary_fold {
  std::uint16_t* tokens = nullptr;  // [capacity]
  std::uint32_t capacity = 0;
  std::uint32_t head_dim = 0;
  std::uint32_t num_kv_heads = 0;
  std::uint32_t entry = 0;
  const void* keys = nullptr;
  std::size_t token_stride = 0;  // elements
  std::size_t head_stride = 0;   // elements
  std::uint32_t count = 0;
  std::uint16_t new_tokens = 0;  // the entry's token count afterwards (known on the host)
  bool fresh = false;
  bool clear = false;
};
static_assert(std::is_trivially_copyable_v<summary_fold>);

}  // namespace oasiskv::cuda::detail
