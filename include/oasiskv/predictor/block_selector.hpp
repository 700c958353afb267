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
#include "oasiskv/core/selection.hpp"
#include "oasiskv/summary/score_kernels.hpp"

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
#if OASISKV_X86_KERNELS
      if (isa_ == cpu_isa::avx512) {
        keep_top_avx512(scores + sinks, end - sinks, k, sinks, out);
      } else {
        keep_top_scalar(scores + sinks, end - sinks, k, sinks, out);
      }
#else
      keep_top_scalar(scores + sinks, end - sinks, k, sinks, out);
#endif
    }
    for (std::uint32_t i = end; i < n; ++i) {
      out.push_back(i);
    }
  }

 private:
  static constexpr float inf = std::numeric_limits<float>::infinity();

  // Appends base + i for the k highest cand[i] (i < m, 0 < k < m), ascending, ties to the
  // lower index, NaN as +inf. Every loop is branch-free (selects and counters, no
  // data-dependent jumps), so a selection costs about the same whatever the scores.
  void keep_top_scalar(const float* cand, std::uint32_t m, std::uint32_t k, std::uint32_t base,
                       std::vector<std::uint32_t>& out) {
    ranked_.resize(m);
    float* ranked = ranked_.data();
    for (std::uint32_t i = 0; i < m; ++i) {
      const float s = cand[i];
      ranked[i] = s == s ? s : inf;
    }
    // When k is a small share of the candidates, the least of k chunk maxima is a cheap lower
    // bound of the k-th highest score (each chunk holds a score at least that high): only the
    // scores at or above it go to nth_element.
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
    for (std::uint32_t i = 0; i < m; ++i) {  // from `cand`: nth_element may reorder ranked
      const float v = cand[i];
      const float s = v == v ? v : inf;
      const std::uint32_t eq = s == threshold ? 1u : 0u;
      const std::uint32_t keep = (s > threshold ? 1u : 0u) | (eq & (ties > 0 ? 1u : 0u));
      ties -= eq & keep;
      dst[kept] = base + i;
      kept += keep;
    }
    out.resize(at + kept);
  }

#if OASISKV_X86_KERNELS
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push  // gcc 12's intrinsic headers trip these under -O2 (as in the kernels)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
  // 16 candidates from i (fewer at the tail: `valid`), NaN as +inf; lanes not valid are -inf.
  OASISKV_TARGET_AVX512 static __m512 load_ranked(const float* cand, std::uint32_t i,
                                                  __mmask16 valid) {
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-inf), valid, cand + i);
    return _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_ps(inf));
  }

  // keep_top_scalar with 16 candidates per step. The lower bound of the k-th highest score is
  // the least maximum of 16 x c disjoint groups (c chunks of s vectors; a group is one lane of
  // a chunk), c the fewest giving at least k groups. The pool is built by compress-stores and
  // the kept indices by compressing an index vector.
  OASISKV_TARGET_AVX512 void keep_top_avx512(const float* cand, std::uint32_t m, std::uint32_t k,
                                             std::uint32_t base, std::vector<std::uint32_t>& out) {
    __m512 lower = _mm512_set1_ps(-inf);
    if (std::uint64_t{k} * 8 <= m) {
      const std::uint32_t chunks = (k + 15) / 16;
      const std::uint32_t s = m / (16 * chunks);  // vectors per chunk
      if (s > 0) {
        __m512 least = _mm512_set1_ps(inf);
        for (std::uint32_t c = 0; c < chunks; ++c) {
          __m512 top = _mm512_set1_ps(-inf);
          for (std::uint32_t v = 0; v < s; ++v) {
            top = _mm512_max_ps(top, load_ranked(cand, (c * s + v) * 16, 0xffff));
          }
          least = _mm512_min_ps(least, top);
        }
        lower = _mm512_set1_ps(_mm512_reduce_min_ps(least));
      }
    }
    pool_.resize(std::size_t{m} + 16);  // a full vector may be stored at the last position
    float* pool = pool_.data();
    std::uint32_t pooled = 0;
    for (std::uint32_t i = 0; i < m; i += 16) {
      const __mmask16 valid = detail::tail16(i, m);
      const __m512 v = load_ranked(cand, i, valid);
      const __mmask16 in = _mm512_mask_cmp_ps_mask(valid, v, lower, _CMP_GE_OQ);
      _mm512_storeu_ps(pool + pooled, _mm512_maskz_compress_ps(in, v));
      pooled += static_cast<std::uint32_t>(__builtin_popcount(in));
    }
    std::nth_element(pool, pool + (k - 1), pool + pooled, std::greater<float>());
    const float threshold = pool[k - 1];
    const __m512 thr = _mm512_set1_ps(threshold);
    std::uint32_t above = 0;
    for (std::uint32_t i = 0; i + 1 < k; i += 16) {
      const __mmask16 valid = detail::tail16(i, k - 1);
      const __m512 v = _mm512_maskz_loadu_ps(valid, pool + i);
      above += static_cast<std::uint32_t>(
          __builtin_popcount(_mm512_mask_cmp_ps_mask(valid, v, thr, _CMP_GT_OQ)));
    }
    // Every block above the threshold, and the first `k - above` equal to it.
    std::uint32_t ties = k - above;
    const std::size_t at = out.size();
    out.resize(at + m + 16);  // room for any candidate and a full last vector; trimmed
    std::uint32_t* dst = out.data() + at;
    std::uint32_t kept = 0;
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (std::uint32_t i = 0; i < m; i += 16) {
      const __mmask16 valid = detail::tail16(i, m);
      const __m512 v = load_ranked(cand, i, valid);
      __mmask16 keep = _mm512_mask_cmp_ps_mask(valid, v, thr, _CMP_GT_OQ);
      unsigned eq = _mm512_mask_cmp_ps_mask(valid, v, thr, _CMP_EQ_OQ);
      while (eq != 0 && ties > 0) {  // the lowest lanes equal to the threshold, while any remain
        const unsigned lowest = eq & (0u - eq);
        keep = static_cast<__mmask16>(keep | lowest);
        eq ^= lowest;
        --ties;
      }
      const __m512i idx = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(base + i)));
      _mm512_storeu_si512(dst + kept, _mm512_maskz_compress_epi32(keep, idx));
      kept += static_cast<std::uint32_t>(__builtin_popcount(keep));
    }
    out.resize(at + kept);
  }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

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
