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
#include "oasiskv/core/selection.hpp"

namespace oasiskv {

//! @brief Picks, per table, the blocks a selection keeps. Owns its scratch, so that after the
//! first call at a given sequence length `append_table` does not allocate.
class block_selector {
 public:
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
      // Every loop below is branch-free (selects and counters, no data-dependent jumps), so a
      // selection costs about the same whatever the scores, and the copies vectorise.
      constexpr float inf = std::numeric_limits<float>::infinity();
      const std::uint32_t m = end - sinks;
      ranked_.resize(m);
      float* ranked = ranked_.data();
      for (std::uint32_t i = 0; i < m; ++i) {
        const float s = scores[sinks + i];
        ranked[i] = s == s ? s : inf;
      }
      // When k is a small share of the candidates, the least of k chunk maxima is a cheap
      // lower bound of the k-th highest score (each chunk holds a score at least that high):
      // only the scores at or above it go to nth_element.
      float* pool = ranked;
      std::uint32_t pooled = m;
      if (std::uint64_t{k} * 8 <= m) {
        const std::uint32_t chunk = m / k;
        float lower = inf;
        for (std::uint32_t c = 0; c < k; ++c) {
          float top = -inf;
          for (std::uint32_t i = c * chunk; i < (c + 1) * chunk; ++i) {
            top = ranked[i] > top ? ranked[i] : top;
          }
          lower = top < lower ? top : lower;
        }
        pool_.resize(m);  // allocates only when the sequence has grown
        pool = pool_.data();
        pooled = 0;
        for (std::uint32_t i = 0; i < m; ++i) {
          pool[pooled] = ranked[i];
          pooled += ranked[i] >= lower ? 1u : 0u;
        }
      }
      std::nth_element(pool, pool + (k - 1), pool + pooled, std::greater<float>());
      const float threshold = pool[k - 1];
      std::uint32_t above = 0;
      for (std::uint32_t i = 0; i < k - 1; ++i) {
        above += pool[i] > threshold ? 1u : 0u;
      }
      // Every block above the threshold, and the first `k - above` equal to it.
      std::uint32_t ties = k - above;
      const std::size_t at = out.size();
      out.resize(at + m);  // room for any candidate; trimmed to the k kept
      std::uint32_t* dst = out.data() + at;
      std::uint32_t kept = 0;
      for (std::uint32_t i = 0; i < m; ++i) {  // from `scores`: nth_element may reorder ranked
        const float v = scores[sinks + i];
        const float s = v == v ? v : inf;
        const std::uint32_t eq = s == threshold ? 1u : 0u;
        const std::uint32_t keep = (s > threshold ? 1u : 0u) | (eq & (ties > 0 ? 1u : 0u));
        ties -= eq & keep;
        dst[kept] = sinks + i;
        kept += keep;
      }
      out.resize(at + kept);
    }
    for (std::uint32_t i = end; i < n; ++i) {
      out.push_back(i);
    }
  }

 private:
  std::vector<float> ranked_;  // the candidates' scores, NaN as +inf; reused across calls
  std::vector<float> pool_;    // those at or above the chunk-maxima floor
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
