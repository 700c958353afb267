// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief KL divergence between two next-token distributions given as logits, and its summary
//! over positions: a finer measure than argmax agreement, which moves only where a near-tie
//! flips (docs/accuracy.md, "End to end"). Header-only so that a unit test checks it without
//! the model.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <vector>

namespace accuracy {

//! log(sum(exp(x))) in double, shifted by the maximum so that no exponential overflows. NaN
//! when `x` is empty, holds a NaN or +inf, or is all -inf: no distribution to normalize.
inline double log_sum_exp(std::span<const float> x) {
  constexpr double nan = std::numeric_limits<double>::quiet_NaN();
  double mx = -std::numeric_limits<double>::infinity();
  for (const float v : x) {
    if (std::isnan(v)) {  // std::max would skip it
      return nan;
    }
    mx = std::max(mx, double(v));
  }
  if (!std::isfinite(mx)) {
    return nan;
  }
  double sum = 0;
  for (const float v : x) {
    sum += std::exp(double(v) - mx);
  }
  return mx + std::log(sum);
}

//! KL(P || Q) in nats, P = softmax(`p_logits`), Q = softmax(`q_logits`) over the same
//! vocabulary: sum_i P_i (log P_i - log Q_i), with the log-probabilities taken in double as
//! logit - log_sum_exp. Identical logits give exactly 0 (each term is x * 0); a token P gives no
//! mass (-inf logit) adds nothing, one Q gives none where P does makes it +inf. NaN when either
//! vector holds a NaN or cannot be normalized, or the sizes differ: a broken run must not read
//! as a small divergence. Rounding can leave a near-zero sum a hair below 0; it is clamped.
inline double kl_divergence(std::span<const float> p_logits, std::span<const float> q_logits) {
  if (p_logits.size() != q_logits.size()) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  const double lp = log_sum_exp(p_logits), lq = log_sum_exp(q_logits);
  if (std::isnan(lp) || std::isnan(lq)) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  double kl = 0;
  for (std::size_t i = 0; i < p_logits.size(); ++i) {
    if (p_logits[i] == -std::numeric_limits<float>::infinity()) {
      continue;  // 0 log 0 = 0 (the product would be NaN)
    }
    const double a = double(p_logits[i]) - lp, b = double(q_logits[i]) - lq;
    kl += std::exp(a) * (a - b);
  }
  return kl < 0 ? 0.0 : kl;  // NaN stays NaN
}

//! Per-position divergences summarized: mean, 90th percentile (nearest rank: the smallest value
//! at or above 90% of them) and maximum; all NaN when one is NaN (a sort with NaN is undefined,
//! and one broken position must show), all 0 when there are none.
struct kl_summary {
  double mean = 0, p90 = 0, max = 0;
};

inline kl_summary summarize_kl(std::vector<double> v) {
  if (v.empty()) {
    return {};
  }
  if (std::any_of(v.begin(), v.end(), [](double x) { return std::isnan(x); })) {
    constexpr double nan = std::numeric_limits<double>::quiet_NaN();
    return {nan, nan, nan};
  }
  std::sort(v.begin(), v.end());
  double sum = 0;
  for (const double x : v) {
    sum += x;
  }
  // Nearest rank: ceil(0.9 n) in 1-based ranks, in integers so that no rounding of 0.9 moves it.
  const std::size_t rank = (9 * v.size() + 9) / 10;
  return {sum / double(v.size()), v[rank - 1], v.back()};
}

}  // namespace accuracy
