// SPDX-License-Identifier: Apache-2.0
// Sampling as the server's parameters ask for it (decode/sampler.hpp, and the batched engine
// that applies it), each against an independent computation: log-probabilities equal
// log_softmax of the logits (the engine's against logits recomputed by a prefill of each
// prefix), top_k 1 at temperature 1 is greedy, top_k keeps only the k largest, penalties and
// logit_bias change exactly the logits they name. Then `batch_engine::cancel`: a waiting request
// leaves the queue and a running one the cache at once, its fast-tier reservation returned.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <mini_decoder/batch/batch.hpp>
#include <mini_decoder/decode/draft.hpp>
#include <mini_decoder/decode/sampler.hpp>
#include <mini_decoder/model/transformer.hpp>

#include "support.hpp"

using namespace mini_decoder;
using mini_decoder::test::error_of;

namespace {

const model& stories() {
  static const auto m = load_model(std::string(MINI_DECODER_STORIES_DIR) + "/stories260K.bin");
  return *m;
}

std::vector<float> random_logits(std::mt19937& rng, std::uint32_t vocab) {
  std::normal_distribution<float> d(0.0f, 3.0f);
  std::vector<float> l(vocab);
  for (float& x : l) {
    x = d(rng);
  }
  return l;
}

// log_softmax in long double, written out: the independent computation.
std::vector<double> log_softmax(const std::vector<float>& l) {
  long double mx = l[0], sum = 0;
  for (float x : l) {
    mx = std::max<long double>(mx, x);
  }
  for (float x : l) {
    sum += std::exp(static_cast<long double>(x) - mx);
  }
  std::vector<double> out;
  for (float x : l) {
    out.push_back(static_cast<double>(x - mx - std::log(sum)));
  }
  return out;
}

sampling_params params(float temperature, std::uint64_t seed) {
  sampling_params p;
  p.temperature = temperature;
  p.seed = seed;
  return p;
}

}  // namespace

TEST_CASE("sampler: logprobs are log_softmax of the logits, with the top n in order") {
  std::mt19937 rng(11);
  for (int round = 0; round < 20; ++round) {
    const std::vector<float> l = random_logits(rng, 300);
    const std::vector<double> want = log_softmax(l);
    sampling_params p = params(round % 2 == 0 ? 0.0f : 0.8f, static_cast<std::uint64_t>(round));
    p.logprobs = 5;
    sampler s(p);
    const int t = s.sample(l.data(), 300);
    const token_logprobs& lp = s.last();
    CHECK(lp.token == t);
    CHECK(lp.logprob == doctest::Approx(want[static_cast<std::size_t>(t)]).epsilon(1e-5));
    REQUIRE(lp.top.size() == 5);
    std::vector<int> order(300);
    for (int i = 0; i < 300; ++i) {
      order[static_cast<std::size_t>(i)] = i;
    }
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return want[static_cast<std::size_t>(a)] > want[static_cast<std::size_t>(b)];
    });
    for (std::size_t k = 0; k < 5; ++k) {
      CHECK(lp.top[k].first == order[k]);
      CHECK(lp.top[k].second ==
            doctest::Approx(want[static_cast<std::size_t>(order[k])]).epsilon(1e-5));
    }
    if (round % 2 == 0) {
      CHECK(t == order[0]);  // greedy: the most likely
    }
  }
  // Reported before any change: penalties, bias and top_k move the choice, not the logprobs.
  const std::vector<float> l = random_logits(rng, 50);
  sampling_params p = params(0.0f, 1);
  p.logprobs = 0;
  p.logit_bias = {{7, 100.0f}};
  sampler s(p);
  CHECK(s.sample(l.data(), 50) == 7);
  CHECK(s.last().logprob == doctest::Approx(log_softmax(l)[7]).epsilon(1e-5));
  CHECK(s.last().top.empty());
}

TEST_CASE("sampler: top_k 1 at temperature 1 is greedy; top_k keeps only the k largest") {
  std::mt19937 rng(5);
  for (int round = 0; round < 50; ++round) {
    std::vector<float> l = random_logits(rng, 200);
    if (round % 5 == 0) {
      l[17] = l[90] = *std::max_element(l.begin(), l.end()) + 1.0f;  // a tie: the first wins
    }
    sampling_params p = params(1.0f, static_cast<std::uint64_t>(round));
    p.top_k = 1;
    sampler s(p);
    CHECK(s.sample(l.data(), 200) == argmax(l.data(), 200));
  }
  const std::vector<float> l = random_logits(rng, 200);
  std::vector<int> order(200);
  for (int i = 0; i < 200; ++i) {
    order[static_cast<std::size_t>(i)] = i;
  }
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    return l[static_cast<std::size_t>(a)] > l[static_cast<std::size_t>(b)];
  });
  const std::set<int> top5(order.begin(), order.begin() + 5);
  sampling_params p = params(5.0f, 3);  // hot: without top_k most draws fall outside the 5
  p.top_k = 5;
  sampler s(p);
  std::set<int> seen;
  for (int i = 0; i < 400; ++i) {
    const int t = s.sample(l.data(), 200);
    CHECK(top5.count(t) == 1);
    seen.insert(t);
  }
  CHECK(seen.size() > 1);
  // top_k 0, or at least the vocabulary: the plain sampler's draws, one for one.
  for (const std::uint32_t k : {0u, 200u, 1000u}) {
    sampling_params q = params(0.9f, 77);
    q.top_k = k;
    sampler a(q), b(0.9f, 1.0f, 77);
    for (int i = 0; i < 50; ++i) {
      CHECK(a.sample(l.data(), 200) == b.sample(l.data(), 200));
    }
  }
}

TEST_CASE("sampler: penalties and logit_bias change exactly the logits they name") {
  std::mt19937 rng(9);
  std::vector<float> l = random_logits(rng, 100);
  const int first = argmax(l.data(), 100);
  std::vector<float> rest = l;
  rest[static_cast<std::size_t>(first)] = -1e30f;
  const int second = argmax(rest.data(), 100);
  const float gap = l[static_cast<std::size_t>(first)] - l[static_cast<std::size_t>(second)];

  // A frequency penalty applies once per time the token was generated; presence once.
  sampling_params p = params(0.0f, 1);
  p.frequency_penalty = gap * 0.4f;
  sampler s(p);
  CHECK(s.sample(l.data(), 100) == first);
  s.accept(first);  // first - 0.4 gap: still first
  CHECK(s.sample(l.data(), 100) == first);
  s.accept(first);  // first - 0.8 gap
  CHECK(s.sample(l.data(), 100) == first);
  s.accept(first);  // first - 1.2 gap: second
  CHECK(s.sample(l.data(), 100) == second);

  sampling_params q = params(0.0f, 1);
  q.presence_penalty = gap * 0.6f;
  sampler t(q);
  t.accept(first);
  CHECK(t.sample(l.data(), 100) == first);  // -0.6 gap once
  t.accept(first);
  CHECK(t.sample(l.data(), 100) == first);  // still once: presence does not grow
  q.presence_penalty = gap * 1.1f;
  sampler u(q);
  u.accept(first);
  CHECK(u.sample(l.data(), 100) == second);
  // Negative penalties encourage: the opposite direction.
  q.presence_penalty = 0.0f;
  q.frequency_penalty = -(gap + 1.0f);
  sampler v(q);
  v.accept(second);
  CHECK(v.sample(l.data(), 100) == second);

  // logit_bias: -100 on the first makes the second greedy's choice; +100 picks any token.
  sampling_params b = params(0.0f, 1);
  b.logit_bias = {{first, -100.0f}};
  CHECK(sampler(b).sample(l.data(), 100) == second);
  b.logit_bias = {{42, 100.0f}};
  CHECK(sampler(b).sample(l.data(), 100) == 42);
  // Bad values are refused.
  b.logit_bias = {{-1, 1.0f}};
  CHECK(error_of([&] { sampler x(b); }).find("logit_bias") != std::string::npos);
  b.logit_bias = {{3, std::nanf("")}};
  CHECK(error_of([&] { sampler x(b); }).find("logit_bias") != std::string::npos);
  sampling_params bad = params(std::numeric_limits<float>::infinity(), 1);
  CHECK(error_of([&] { sampler x(bad); }).find("temperature") != std::string::npos);
}

TEST_CASE("batch: the engine's logprobs equal log_softmax of logits recomputed per prefix") {
  const model& m = stories();
  const std::uint32_t vocab = m.config.vocab_size;
  batch_options o;
  o.fast_tier_bytes = std::uint64_t{16} << 20;
  batch_engine e(m, o);
  batch_request r;
  r.prompt = m.tok->encode("Once upon a time", true);
  r.max_tokens = 16;
  r.ignore_eos = true;
  r.sampling.logprobs = 3;
  std::vector<token_logprobs> got;
  std::vector<int> tokens;
  r.on_logprobs = [&](const token_logprobs& lp) {
    got.push_back(lp);
  };
  r.on_token = [&](int t) {
    tokens.push_back(t);
    return true;
  };
  const std::vector<int> prompt = r.prompt;
  const auto id = e.submit(std::move(r));
  e.run();
  REQUIRE(e.done(id));
  REQUIRE(got.size() == 16);
  REQUIRE(tokens == e.output(id));
  // Each token's distribution, independently: a dense prefill of the prompt and the tokens
  // before it gives the logits of its position.
  transformer tf(m);
  std::vector<float> logits(vocab);
  std::vector<int> prefix = prompt;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    CAPTURE(i);
    tf.prefill(
        prefix.data(), static_cast<std::uint32_t>(prefix.size()),
        [](std::uint32_t, const float*, const float*, std::uint32_t) {}, logits.data());
    const std::vector<double> want = log_softmax(logits);
    CHECK(got[i].token == tokens[i]);
    CHECK(tokens[i] == argmax(logits.data(), vocab));  // greedy
    CHECK(got[i].logprob ==
          doctest::Approx(want[static_cast<std::size_t>(tokens[i])]).epsilon(0.02));
    REQUIRE(got[i].top.size() == 3);
    CHECK(got[i].top[0].first == tokens[i]);
    for (const auto& [tok, lp] : got[i].top) {
      CHECK(lp == doctest::Approx(want[static_cast<std::size_t>(tok)]).epsilon(0.02));
    }
    prefix.push_back(tokens[i]);
  }
}

TEST_CASE("accept_drafts: each kept token counts for the penalties before the next row") {
  // Row 0 prefers token 1 (the draft); row 1 prefers token 1 over 2 by less than the presence
  // penalty, so once row 0's token is counted, row 1 samples 2 and rejects the second draft.
  const std::uint32_t vocab = 4;
  const std::vector<float> logits = {0.0f, 1.0f, 0.5f, 0.0f,   // row 0
                                     0.0f, 1.0f, 0.6f, 0.0f,   // row 1
                                     0.0f, 0.0f, 0.0f, 3.0f};  // row 2
  sampling_params p;
  p.presence_penalty = 1.0f;
  p.logprobs = 0;
  sampler s(p);
  const std::vector<int> drafts = {1, 1};
  std::vector<token_logprobs> lps;
  const acceptance a = accept_drafts(s, logits.data(), vocab, drafts, &lps);
  CHECK(a.accepted == 1);
  CHECK(a.next == 2);
  REQUIRE(lps.size() == 2);  // the kept tokens', in order
  CHECK(lps[0].token == 1);
  CHECK(lps[1].token == 2);
  // log-probabilities of the logits as given, before the penalty
  const std::vector<double> row1 =
      log_softmax(std::vector<float>(logits.begin() + 4, logits.begin() + 8));
  CHECK(lps[1].logprob == doctest::Approx(row1[2]).epsilon(1e-4));
  // Without the penalty both drafts are taken, and row 2 gives the next token.
  sampler plain(sampling_params{});
  const acceptance b = accept_drafts(plain, logits.data(), vocab, drafts);
  CHECK(b.accepted == 2);
  CHECK(b.next == 3);
}

TEST_CASE("batch: penalties with drafts equal a reference recomputed per prefix") {
  // Greedy with presence and frequency penalties, against an independent computation: the
  // logits of each position from a dense prefill of its prefix, penalised by the counts of the
  // tokens generated before it. Plain decoding and speculative rounds (prompt lookup) alike.
  const model& m = stories();
  const std::uint32_t vocab = m.config.vocab_size;
  const std::vector<int> prompt = m.tok->encode("Once upon a time, there was a little girl", true);
  const std::uint32_t n = 40;
  const float presence = 0.5f, frequency = 0.3f;
  transformer tf(m);
  std::vector<float> logits(vocab);
  std::vector<int> prefix = prompt, want;
  std::vector<std::uint32_t> counts(vocab, 0);
  for (std::uint32_t i = 0; i < n; ++i) {
    tf.prefill(
        prefix.data(), static_cast<std::uint32_t>(prefix.size()),
        [](std::uint32_t, const float*, const float*, std::uint32_t) {}, logits.data());
    for (std::uint32_t t = 0; t < vocab; ++t) {
      if (counts[t] > 0) {
        logits[t] -= presence + frequency * static_cast<float>(counts[t]);
      }
    }
    const int tok = argmax(logits.data(), vocab);
    want.push_back(tok);
    ++counts[static_cast<std::size_t>(tok)];
    prefix.push_back(tok);
  }
  std::vector<int> unpenalised;
  for (const draft_kind k : {draft_kind::none, draft_kind::ngram}) {
    CAPTURE(to_string(k));
    batch_options o;
    o.fast_tier_bytes = std::uint64_t{16} << 20;
    o.draft = k;
    batch_engine e(m, o);
    batch_request r;
    r.prompt = prompt;
    r.max_tokens = n;
    r.ignore_eos = true;
    r.sampling.presence_penalty = presence;
    r.sampling.frequency_penalty = frequency;
    const auto id = e.submit(r);
    batch_request free = r;
    free.sampling = sampling_params{};
    const auto id_free = e.submit(std::move(free));
    e.run();
    CHECK(e.output(id) == want);
    unpenalised = e.output(id_free);
    if (k == draft_kind::ngram) {
      CHECK(e.report(id).rounds < n);  // some round kept drafts
    }
  }
  CHECK(unpenalised != want);  // the penalties change the answer
}

TEST_CASE("batch: top_k 1 at temperature 1 gives the greedy answer; bad bias is refused") {
  const model& m = stories();
  batch_options o;
  o.fast_tier_bytes = std::uint64_t{16} << 20;
  batch_engine e(m, o);
  batch_request greedy;
  greedy.prompt = m.tok->encode("Lily and Tom", true);
  greedy.max_tokens = 30;
  batch_request k1 = greedy;
  k1.temperature = 1.0f;
  k1.seed = 1234;
  k1.sampling.top_k = 1;
  batch_request hot = k1;
  hot.sampling.top_k = 0;
  const auto a = e.submit(greedy), b = e.submit(k1), c = e.submit(hot);
  e.run();
  CHECK(e.output(a) == e.output(b));
  CHECK(e.output(a) != e.output(c));  // temperature 1 without top_k does sample
  batch_request bad = greedy;
  bad.sampling.logit_bias = {{static_cast<int>(m.config.vocab_size), 1.0f}};
  CHECK(error_of([&] { e.submit(bad); }).find("outside the vocabulary") != std::string::npos);
}

TEST_CASE("batch: cancel frees a waiting request at once and a running one's fast tier") {
  const model& m = stories();
  batch_options probe_o;
  probe_o.fast_tier_bytes = std::uint64_t{1} << 30;
  const std::vector<int> prompt = m.tok->encode("Once upon a time", true);
  const auto P = static_cast<std::uint32_t>(prompt.size());
  const std::uint64_t big = batch_engine(m, probe_o).need(P, 400).fast_bytes;
  batch_options o;
  o.fast_tier_bytes = big;  // room for the long request alone
  batch_engine e(m, o);
  batch_request long_one;
  long_one.prompt = prompt;
  long_one.max_tokens = 400;
  long_one.ignore_eos = true;
  batch_request small = long_one;
  small.max_tokens = 4;
  const auto l = e.submit(long_one);
  const auto w = e.submit(small);  // waits: the long one holds the whole fast tier
  const auto w2 = e.submit(small);
  e.step();
  e.step();
  CHECK(e.active() == 1);
  CHECK(e.waiting() == 2);
  CHECK(e.fast_slots_reserved() > 0);
  e.cancel(w2);  // waiting: out of the queue now
  CHECK(e.waiting() == 1);
  CHECK(e.done(w2));
  CHECK(e.output(w2).empty());
  const std::size_t made = e.output(l).size();
  e.cancel(l);  // running: out of the cache now, its reservation back
  CHECK(e.done(l));
  CHECK(e.active() == 0);
  CHECK(e.fast_slots_reserved() == 0);
  CHECK(e.output(l).size() == made);  // nothing more after the cancel
  CHECK(e.audit() == 0);              // the cache holds nothing
  e.cancel(l);                        // a done request: nothing happens
  // The small request is admitted at the next step and finishes as usual.
  e.run();
  CHECK(e.done(w));
  CHECK(e.output(w).size() == 4);
  e.forget(l);
  e.forget(w2);
  CHECK(error_of([&] { e.cancel(l); }).find("no request") != std::string::npos);
}
