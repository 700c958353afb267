// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief What every predictor shares: checking its input, and turning one score per block into
//! a table that keeps the sinks, the recent window and the top blocks under the budget.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "oasiskv/core/decode_params.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/isa.hpp"
#include "oasiskv/core/selection.hpp"
#include "oasiskv/predictor/select_kernels.hpp"
#include "oasiskv/summary/cpu/simd_math.hpp"

namespace oasiskv {

//! @brief Picks, per table, the blocks a selection keeps. Owns its scratch, so that after the
//! first call at a given sequence length `append_table` does not allocate. `isa` picks the code
//! path (`cpu_isa::avx512`: the passes over the scores are vector compares and compress-stores;
//! otherwise scalar); every path selects the same blocks.
class block_selector {
 public:
  block_selector() = default;
  //! @throws error `errc::unsupported` if `isa` cannot run on this build or machine.
  explicit block_selector(cpu_isa isa) : isa_(resolve_isa(isa)) {}

  //! @brief The code path in use (never `best`).
  cpu_isa isa() const noexcept { return isa_; }

  //! @brief Appends to `out` the blocks of one table, ascending: blocks `[0, sinks)`, the last
  //! `max(recent, 1)` blocks (the last one holds the newest token and may be partial), and the
  //! highest `scores[i]` among the rest until `budget_blocks` are chosen, ties to the lower
  //! index. NaN scores count as `+inf`. O(num_blocks): `std::nth_element` over the candidates'
  //! scores (plain floats: cheaper to move and compare than (score, index) pairs; for a small
  //! budget only those above a cheap lower bound of the threshold) finds the k-th highest
  //! score, and one ascending pass keeps every block above it and the first ones equal to it.
  void append_table(const float* scores, std::uint32_t num_blocks, const selection_params& sp,
                    std::vector<std::uint32_t>& out) {
    const std::uint32_t n = num_blocks;
    if (sp.budget_blocks >= n) {
      for (std::uint32_t i = 0; i < n; ++i) {
        out.push_back(i);
      }
      return;
    }
    const std::uint32_t sinks = std::min(sp.sink_blocks, n);
    const std::uint32_t recent = std::min(std::max(sp.recent_blocks, 1u), n - sinks);
    const std::uint32_t end = n - recent;  // candidates are [sinks, end)
    for (std::uint32_t i = 0; i < sinks; ++i) {
      out.push_back(i);
    }
    // budget >= sinks + recent (checked by the caller) and budget < n, so 0 <= k < candidates.
    const std::uint32_t k = sp.budget_blocks - sinks - recent;
    if (k > 0) {
      detail::keep_top(isa_, scores + sinks, end - sinks, k, sinks, ranked_, pool_, out);
    }
    for (std::uint32_t i = end; i < n; ++i) {
      out.push_back(i);
    }
  }

 private:
  cpu_isa isa_ = resolve_isa(cpu_isa::best);
  std::vector<float> ranked_;  // the candidates' scores, NaN as +inf (scalar path); reused
  std::vector<float> pool_;    // those at or above the lower bound of the threshold
};

namespace detail {

//! @brief Checks what every predictor needs: a valid layout, a non-empty sequence and a budget
//! that holds the blocks always kept.
inline void check_prediction_basics(const kv_layout& layout, std::uint32_t seq_len,
                                    const selection_params& sp) {
  layout.validate();
  if (seq_len == 0) [[unlikely]] {
    raise(errc::invalid_argument, "prediction_input.seq_len is 0: nothing to select from");
  }
  const std::uint64_t kept = std::uint64_t{sp.sink_blocks} + std::max(sp.recent_blocks, 1u);
  if (sp.budget_blocks < kept) [[unlikely]] {
    raise(errc::invalid_argument, "selection_params.budget_blocks = ", sp.budget_blocks,
          " is below sink_blocks = ", sp.sink_blocks, " + recent_blocks = ", sp.recent_blocks,
          " (at least 1: the block of the newest token)");
  }
}

//! @brief Checks the queries' shape: `[num_tokens][num_q_heads][head_dim]`, 1..16 tokens, and
//! finite non-negative weights when given.
inline void check_queries(const query_view& q) {
  if (q.data == nullptr) [[unlikely]] {
    raise(errc::invalid_argument, "query_view.data is null");
  }
  if (q.num_tokens == 0 || q.num_tokens > max_query_tokens) [[unlikely]] {
    raise(errc::invalid_argument, "query_view.num_tokens = ", q.num_tokens, " must be in [1, ",
          max_query_tokens, "]");
  }
  if (q.weights != nullptr) {
    for (std::uint32_t t = 0; t < q.num_tokens; ++t) {
      if (!(q.weights[t] >= 0.0f) || !std::isfinite(q.weights[t])) [[unlikely]] {
        raise(errc::invalid_argument, "query_view.weights[", t, "] = ", q.weights[t],
              " must be finite and >= 0");
      }
    }
  }
}

//! @brief Copies the query rows of KV head `h`'s GQA group into `rows`, `[token][group][dim]`,
//! so a summary reads its entries once for all of them.
inline void gather_group_rows(const kv_layout& l, const query_view& q, std::uint32_t h,
                              std::vector<float>& rows) {
  const std::size_t g = l.group_size(), d = l.head_dim;
  rows.resize(q.num_tokens * g * d);
  for (std::uint32_t t = 0; t < q.num_tokens; ++t) {
    const float* src = q.data + (std::size_t{t} * l.num_q_heads + h * g) * d;
    std::copy(src, src + g * d, rows.data() + t * g * d);
  }
}

}  // namespace detail
}  // namespace oasiskv
