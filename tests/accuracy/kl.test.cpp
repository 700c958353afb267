// SPDX-License-Identifier: Apache-2.0
// The KL divergence of tools/accuracy (kl.hpp), against independent references: divergences of
// small distributions worked out from their probabilities by hand, and of a SmolLM2-sized
// vocabulary from probabilities normalized in long double. Identical logits give exactly 0, the
// direction is KL(first || second), a shift of the logits changes nothing (large ones included,
// where a float softmax overflows), and a NaN or unnormalizable input gives NaN, never a number
// that could pass a threshold.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kl.hpp"

using accuracy::kl_divergence;
using accuracy::summarize_kl;

namespace {

constexpr float f_inf = std::numeric_limits<float>::infinity();
constexpr float f_nan = std::numeric_limits<float>::quiet_NaN();

// Logits whose softmax is `p`, shifted by `shift` (softmax does not see a shift).
std::vector<float> logits_of(const std::vector<double>& p, double shift) {
  std::vector<float> l;
  for (const double x : p) {
    l.push_back(static_cast<float>(std::log(x) + shift));
  }
  return l;
}

}  // namespace

TEST_CASE("kl_divergence: two tokens, worked out by hand, in both directions") {
  // P = (1/4, 3/4), Q = (1/2, 1/2).
  const std::vector<float> p{0.0f, static_cast<float>(std::log(3.0))}, q{0.0f, 0.0f};
  // KL(P || Q) = 1/4 ln(1/2) + 3/4 ln(3/2) = 0.1308121...; KL(Q || P) = 1/2 ln 2 + 1/2 ln(2/3).
  const double pq = 0.25 * std::log(0.5) + 0.75 * std::log(1.5);
  const double qp = 0.5 * std::log(2.0) + 0.5 * std::log(2.0 / 3.0);
  CHECK(pq == doctest::Approx(0.13081203594).epsilon(1e-9));
  CHECK(kl_divergence(p, q) == doctest::Approx(pq).epsilon(1e-6));
  CHECK(kl_divergence(q, p) == doctest::Approx(qp).epsilon(1e-6));
  CHECK(kl_divergence(p, q) != doctest::Approx(kl_divergence(q, p)).epsilon(1e-3));
}

TEST_CASE("kl_divergence: three tokens, any shift of either side") {
  const std::vector<double> P{0.2, 0.3, 0.5}, Q{0.4, 0.4, 0.2};
  double ref = 0;
  for (std::size_t i = 0; i < P.size(); ++i) {
    ref += P[i] * std::log(P[i] / Q[i]);
  }
  CHECK(ref == doctest::Approx(0.2332109).epsilon(1e-6));  // 0.2 ln .5 + 0.3 ln .75 + 0.5 ln 2.5
  for (const double sp : {0.0, -7.5, 40.0}) {
    for (const double sq : {0.0, 3.0, -40.0}) {
      CAPTURE(sp);
      CAPTURE(sq);
      CHECK(kl_divergence(logits_of(P, sp), logits_of(Q, sq)) ==
            doctest::Approx(ref).epsilon(1e-6));
    }
  }
}

TEST_CASE("kl_divergence: logits near 1000, where a float softmax overflows") {
  // Exact in float either way; the reference normalizes the unshifted logits directly.
  const std::vector<double> a{0.0, 0.5, 1.25}, b{-1.0, 1.0, 0.25};
  std::vector<float> p, q;
  double zp = 0, zq = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    p.push_back(static_cast<float>(a[i] + 1000.0));
    q.push_back(static_cast<float>(b[i] + 1000.0));
    zp += std::exp(a[i]);
    zq += std::exp(b[i]);
  }
  CHECK(std::isinf(std::exp(p[0])));
  double ref = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    ref += std::exp(a[i]) / zp * std::log((std::exp(a[i]) / zp) / (std::exp(b[i]) / zq));
  }
  CHECK(ref > 0.1);
  CHECK(kl_divergence(p, q) == doctest::Approx(ref).epsilon(1e-12));
}

TEST_CASE("kl_divergence: identical logits give exactly 0") {
  std::mt19937 rng(7);
  std::normal_distribution<float> d(0.0f, 4.0f);
  std::vector<float> l(49152);
  for (float& x : l) {
    x = d(rng);
  }
  CHECK(kl_divergence(l, l) == 0.0);
  l[3] = -f_inf;  // a token the distribution never gives
  l[9] = 500.0f;
  CHECK(kl_divergence(l, l) == 0.0);
  const std::vector<float> one{2.5f};
  CHECK(kl_divergence(one, one) == 0.0);
}

TEST_CASE("kl_divergence: a SmolLM2-sized vocabulary against long double probabilities") {
  std::mt19937 rng(11);
  std::normal_distribution<float> d(0.0f, 3.0f), eps(0.0f, 0.05f);
  std::vector<float> p(49152), q(p.size());
  for (std::size_t i = 0; i < p.size(); ++i) {
    p[i] = d(rng);
    q[i] = p[i] + eps(rng) + 20.0f;  // a small perturbation, and a shift
  }
  // Reference: the probabilities themselves, normalized in long double without any shift (the
  // logits are small enough here), then sum P log(P / Q).
  long double zp = 0, zq = 0;
  for (std::size_t i = 0; i < p.size(); ++i) {
    zp += std::exp(static_cast<long double>(p[i]));
    zq += std::exp(static_cast<long double>(q[i]));
  }
  long double ref = 0;
  for (std::size_t i = 0; i < p.size(); ++i) {
    const long double pi = std::exp(static_cast<long double>(p[i])) / zp;
    const long double qi = std::exp(static_cast<long double>(q[i])) / zq;
    ref += pi * std::log(pi / qi);
  }
  CHECK(ref > 1e-4L);  // the perturbation is visible
  CHECK(kl_divergence(p, q) == doctest::Approx(static_cast<double>(ref)).epsilon(1e-9));
}

TEST_CASE("kl_divergence: tokens without mass") {
  // P gives token 0 nothing: it adds 0 (not NaN); KL = ln(1/2 / 1/3) = ln 1.5.
  CHECK(
      kl_divergence(std::vector<float>{-f_inf, 0.0f, 0.0f}, std::vector<float>{0.0f, 0.0f, 0.0f}) ==
      doctest::Approx(std::log(1.5)).epsilon(1e-12));
  // Q gives nothing where P gives mass: infinite, not NaN and not finite.
  const double k = kl_divergence(std::vector<float>{0.0f, 0.0f}, std::vector<float>{-f_inf, 0.0f});
  CHECK(std::isinf(k));
  CHECK(k > 0);
}

TEST_CASE("kl_divergence: NaN or unnormalizable logits give NaN, which passes no threshold") {
  const std::vector<float> ok{0.5f, -1.0f, 2.0f};
  for (const std::vector<float>& bad :
       {std::vector<float>{0.5f, f_nan, 2.0f}, std::vector<float>{f_nan, f_nan, f_nan},
        std::vector<float>{0.5f, f_inf, 2.0f}, std::vector<float>{-f_inf, -f_inf, -f_inf}}) {
    CHECK(std::isnan(kl_divergence(ok, bad)));
    CHECK(std::isnan(kl_divergence(bad, ok)));
    CHECK(std::isnan(kl_divergence(bad, bad)));  // identical, yet not 0
  }
  CHECK(std::isnan(kl_divergence(ok, std::vector<float>{0.5f, -1.0f})));  // sizes differ
  CHECK(std::isnan(kl_divergence(std::vector<float>{}, std::vector<float>{})));
  // As `--expect` compares: neither bound holds for NaN.
  const double k = kl_divergence(ok, std::vector<float>{0.5f, f_nan, 2.0f});
  CHECK_FALSE(k <= 1.0);
  CHECK_FALSE(k >= 0.0);
}

TEST_CASE("summarize_kl: mean, nearest-rank 90th percentile, maximum; NaN spreads") {
  const auto none = summarize_kl({});
  CHECK(none.mean == 0);
  CHECK(none.p90 == 0);
  CHECK(none.max == 0);
  // 1..10 in any order: the 9th smallest is the 90th percentile.
  const auto ten = summarize_kl({7, 1, 10, 3, 5, 2, 9, 4, 8, 6});
  CHECK(ten.mean == doctest::Approx(5.5));
  CHECK(ten.p90 == 9);
  CHECK(ten.max == 10);
  const auto one = summarize_kl({0.25});
  CHECK(one.p90 == 0.25);
  CHECK(one.max == 0.25);
  // 511 positions (the 8k runs'): rank ceil(0.9 * 511) = 460, i.e. value 459 of 0..510.
  std::vector<double> v;
  for (int i = 510; i >= 0; --i) {
    v.push_back(i);
  }
  CHECK(summarize_kl(v).p90 == 459);
  // 512 positions (the held-out text's): rank ceil(460.8) = 461.
  std::vector<double> w(v);
  w.push_back(511);
  CHECK(summarize_kl(w).p90 == 460);
  v[100] = std::numeric_limits<double>::quiet_NaN();
  const auto broken = summarize_kl(v);
  CHECK(std::isnan(broken.mean));
  CHECK(std::isnan(broken.p90));
  CHECK(std::isnan(broken.max));
}
