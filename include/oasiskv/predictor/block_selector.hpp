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
#include "oasiskv/core/kept_window.hpp"
#include "oasiskv/core/selection.hpp"
#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/cpu/math.hpp"
#include "oasiskv/cpu/top_k.hpp"

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
  //!
  //! With `sp.target_mass > 0` the number of blocks is adaptive (`append_adaptive`);
  //! `logit_scale` then says what the scores are: 0, masses (a mass aggregation, the oracle);
  //! otherwise logits (`max_aggregation`), whose mass is a softmax over the blocks of
  //! `logit_scale * scores[i]`. With `target_mass == 0` `logit_scale` is unused and the
  //! selection is the fixed budget's.
  void append_table(const float* scores, std::uint32_t num_blocks, const selection_params& sp,
                    std::vector<std::uint32_t>& out, float logit_scale = 0.0f) {
    if (sp.target_mass != 0.0f) {
      append_adaptive(scores, num_blocks, sp, out, logit_scale);
      return;
    }
    const std::uint32_t n = num_blocks;
    if (sp.budget_blocks >= n) {
      for (std::uint32_t i = 0; i < n; ++i) {
        out.push_back(i);
      }
      return;
    }
    const block_window w = kept_window(n, sp);
    const std::uint32_t sinks = w.sinks, recent = w.recent();
    const std::uint32_t end = w.recent_from;  // candidates are [sinks, end)
    for (std::uint32_t i = 0; i < sinks; ++i) {
      out.push_back(i);
    }
    // budget >= sinks + recent (checked by the caller) and budget < n, so 0 <= k < candidates.
    const std::uint32_t k = sp.budget_blocks - sinks - recent;
    if (k > 0) {
      cpu::detail::keep_top(isa_, scores + sinks, end - sinks, k, sinks, ranked_, pool_, out);
    }
    for (std::uint32_t i = end; i < n; ++i) {
      out.push_back(i);
    }
  }

  //! @brief The adaptive table (`sp.target_mass > 0`): the sinks and the recent window, then the
  //! candidates in decreasing mass until the kept and taken mass reaches `target_mass` of the
  //! table's total (candidates of NaN or infinite mass come first and always count as needed;
  //! zero-mass ones are never needed), as `append_table` picks them (the same order). The
  //! count is bounded by the ledger: a table takes at most
  //! `min(block_cap(), budget_blocks + credit())` blocks (and at most the table's blocks, at
  //! least the kept ones); then `credit += budget_blocks - taken`, capped at
  //! `max_credit_budgets * budget_blocks`. So over any run of tables the blocks taken sum to at
  //! most `tables * budget_blocks` (exactly that minus the credit left and the credit lost to
  //! the cap): the mean stays within the fixed budget. The ledger belongs to this selector, so
  //! it spans every table, (sequence, layer) and KV head the owning predictor selects for, in
  //! call order: a peaked table leaves credit to the tables selected after it, whichever
  //! sequence they belong to. Steady state: no allocation; O(blocks + c log c) for the
  //! `c <= block_cap()` candidates ranked (`std::nth_element`, then a sort of that prefix).
  void append_adaptive(const float* scores, std::uint32_t num_blocks, const selection_params& sp,
                       std::vector<std::uint32_t>& out, float logit_scale) {
    const std::uint32_t n = num_blocks;
    const std::uint32_t budget = sp.budget_blocks;
    const block_window w = kept_window(n, sp);
    const std::uint32_t sinks = w.sinks;
    const std::uint32_t end = w.recent_from;  // candidates are [sinks, end)
    const std::uint32_t kept = w.kept();
    const std::uint64_t allowed =
        std::min<std::uint64_t>(sp.block_cap(), std::uint64_t{budget} + credit_);
    const std::uint32_t room =
        static_cast<std::uint32_t>(std::min<std::uint64_t>(allowed, n)) - kept;  // >= 0

    // Masses: NaN or +inf count as unknown (needed first); the rest summed in double.
    float top = -std::numeric_limits<float>::infinity();
    if (logit_scale > 0.0f) {
      for (std::uint32_t i = 0; i < n; ++i) {
        if (scores[i] < std::numeric_limits<float>::infinity() && scores[i] > top) {
          top = scores[i];
        }
      }
    }
    auto mass_of = [&](float s) -> float {
      if (!(s < std::numeric_limits<float>::infinity())) {
        return std::numeric_limits<float>::infinity();  // NaN, +inf
      }
      if (logit_scale > 0.0f) {
        return s == -std::numeric_limits<float>::infinity() ? 0.0f
                                                            : std::exp(logit_scale * (s - top));
      }
      return s > 0.0f ? s : 0.0f;
    };
    double kept_mass = 0.0, total = 0.0;
    for (std::uint32_t i = 0; i < n; ++i) {
      if (i == sinks && end > sinks) {
        i = end;  // the candidates are summed below
      }
      const float m = mass_of(scores[i]);
      kept_mass += std::isinf(m) ? 0.0 : m;
    }
    total = kept_mass;
    std::uint32_t unknown = 0;
    pool_.clear();
    for (std::uint32_t i = sinks; i < end; ++i) {
      const float m = mass_of(scores[i]);
      if (std::isinf(m)) {
        ++unknown;
      } else if (m > 0.0f) {
        pool_.push_back(m);
        total += m;
      }
    }
    const double goal = static_cast<double>(sp.target_mass) * total;
    std::uint32_t take = std::min(unknown, room);
    double covered = kept_mass;
    if (covered < goal && take < room && !pool_.empty()) {
      const std::size_t c = std::min<std::size_t>(room - take, pool_.size());
      const auto first = pool_.begin(), mid = first + static_cast<std::ptrdiff_t>(c);
      std::nth_element(first, mid - 1, pool_.end(), std::greater<float>{});
      std::sort(first, mid, std::greater<float>{});
      for (auto it = first; it != mid && covered < goal; ++it) {
        covered += *it;
        ++take;
      }
    }
    if (kept + take >= n) {
      for (std::uint32_t i = 0; i < n; ++i) {
        out.push_back(i);
      }
    } else {
      for (std::uint32_t i = 0; i < sinks; ++i) {
        out.push_back(i);
      }
      if (take > 0) {
        cpu::detail::keep_top(isa_, scores + sinks, end - sinks, take, sinks, ranked_, pool_, out);
      }
      for (std::uint32_t i = end; i < n; ++i) {
        out.push_back(i);
      }
    }
    const std::uint64_t taken = std::min(kept + take, n);
    const std::uint64_t bound = std::uint64_t{max_credit_budgets} * budget;
    credit_ = std::min(credit_ + budget - taken, bound);  // taken <= budget + credit_
  }

  //! @brief Blocks the ledger may still spend beyond the budget (0 after construction).
  std::uint64_t credit() const noexcept { return credit_; }
  //! @brief Empties the ledger: the next table takes at most `budget_blocks`.
  void reset_credit() noexcept { credit_ = 0; }
  //! @brief The ledger's bound, in budgets: credit beyond it is lost.
  static constexpr std::uint32_t max_credit_budgets = 4;

 private:
  cpu_isa isa_ = resolve_isa(cpu_isa::best);
  std::vector<float> ranked_;  // the candidates' scores, NaN as +inf (scalar path); reused
  std::vector<float> pool_;    // those at or above the lower bound of the threshold
  std::uint64_t credit_ = 0;   // the adaptive budget's ledger
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
  const std::uint64_t kept = min_budget_blocks(sp.sink_blocks, sp.recent_blocks);
  if (sp.budget_blocks < kept) [[unlikely]] {
    raise(errc::invalid_argument, "selection_params.budget_blocks = ", sp.budget_blocks,
          " is below sink_blocks = ", sp.sink_blocks, " + recent_blocks = ", sp.recent_blocks,
          " (at least 1: the block of the newest token)");
  }
  if (sp.target_mass != 0.0f && !(sp.target_mass > 0.0f && sp.target_mass <= 1.0f)) [[unlikely]] {
    raise(errc::invalid_argument, "selection_params.target_mass = ", sp.target_mass,
          " must be 0 (the fixed budget) or in (0, 1]");
  }
  if (sp.max_blocks != 0 && sp.max_blocks < sp.budget_blocks) [[unlikely]] {
    raise(errc::invalid_argument, "selection_params.max_blocks = ", sp.max_blocks,
          " is below budget_blocks = ", sp.budget_blocks);
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
