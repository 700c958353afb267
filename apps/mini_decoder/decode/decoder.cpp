// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/decode/decoder.hpp>

#include <algorithm>
#include <chrono>

#include <mini_decoder/io/error.hpp>

#include "oasiskv/core/dtype.hpp"

namespace mini_decoder {
namespace {
using clock_type = std::chrono::steady_clock;
double since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}
}  // namespace

decoder::decoder(const model& m, decoder_options o)
    : m_(m), o_(std::move(o)), tf_(m, o_.rope_scale) {
  const model_config& c = m.config;
  kv_dim_ = c.num_kv_heads * c.head_dim;
  if (o_.draft_len == 0 || o_.draft_len >= transformer::max_step_tokens) {
    fail("--draft-len = ", o_.draft_len, " must be in [1, ", transformer::max_step_tokens - 1,
         "] (a verification is at most 16 tokens)");
  }
  if (o_.draft == draft_kind::self && (o_.draft_layers == 0 || o_.draft_layers >= c.num_layers)) {
    fail("--draft-layers = ", o_.draft_layers, " must be in [1, ", c.num_layers - 1, "]");
  }
  if (o_.max_tokens == 0) {
    fail("--max-tokens must be at least 1");
  }
}

decoder::~decoder() = default;

void decoder::append_f16(kv_backend& c, std::uint32_t l, const float* k, const float* v,
                         std::uint32_t n) {
  to_f16_bits(k, v, std::size_t{n} * kv_dim_, k16_, v16_);
  c.append(l, k16_.data(), v16_.data(), n);
}

// Verification in layer l of n = g + 1 tokens at positions p..p+g: token 0 (the pending token)
// is committed already and is appended; the g drafts are never appended before acceptance.
// The cache attends each query over what it holds, the side buffer adds the positions it hides
// (verify.hpp).
void decoder::verify_attend(std::uint32_t l, std::uint32_t n, const float* q, const float* k,
                            const float* v, float* out) {
  const std::size_t bytes = std::size_t{n} * kv_dim_;
  verify_k_[l].assign(k, k + bytes);
  verify_v_[l].assign(v, v + bytes);
  append_f16(*cache_, l, k, v, 1);
  lse_.resize(std::size_t{n} * m_.config.num_heads);
  cache_->attend(l, q, n, out, lse_.data(), nullptr);
  side_.merge(l, q, k, v, n, out, lse_.data());
  // This round's queries (pending token + drafts) predict the next round's blocks in layer l;
  // the transfers overlap the rest of this round and the next draft.
  cache_->lookahead(l, q, n);
}

void decoder::begin(const std::vector<int>& prompt, std::uint32_t ctx) {
  const model_config& c = m_.config;
  const auto P = static_cast<std::uint32_t>(prompt.size());
  if (P == 0) {
    fail("the prompt is empty");
  }
  if (P >= ctx) {
    fail("the prompt is ", P, " tokens, which leaves no room in the context of ", ctx,
         " tokens (shorten it or raise --context)");
  }
  report_ = {};
  report_.prompt_tokens = P;
  cache_config cc{o_.mode,         c.num_layers,     c.num_heads, c.num_kv_heads,      c.head_dim,
                  o_.block_tokens, o_.budget_tokens, ctx,         o_.attention_threads};
  cc.summary = o_.summary;
  cache_ = o_.backend ? o_.backend(cc) : make_kv_backend(cc);
  if (!cache_) {
    fail("the KV backend factory returned no backend");
  }
  drafter_.reset();
  if (o_.draft == draft_kind::self) {
    // The draft model keeps its own small dense cache.
    drafter_ = std::make_unique<self_drafter>(
        m_, o_.draft_layers, o_.block_tokens, ctx,
        self_drafter::slots_for(o_.draft_layers, o_.block_tokens, ctx), o_.rope_scale,
        o_.attention_threads);
    draft_seq_ = drafter_->add();
  }
  side_ = verify_side(c);
  verify_k_.assign(c.num_layers, {});
  verify_v_.assign(c.num_layers, {});
  logits_.resize(std::size_t{transformer::max_step_tokens} * c.vocab_size);
}

// The prompt's K,V of layer l into the caches and the side buffer.
void decoder::commit_prompt(std::uint32_t l, const float* k, const float* v, std::uint32_t n) {
  append_f16(*cache_, l, k, v, n);
  if (drafter_) {
    drafter_->append(draft_seq_, l, k, v, n);
  }
  const std::uint32_t keep = std::min(n, verify_side::max_tokens);
  side_.push(l, k + std::size_t{n - keep} * kv_dim_, v + std::size_t{n - keep} * kv_dim_, keep);
}

std::vector<int> decoder::generate(const std::vector<int>& prompt,
                                   const std::function<bool(int)>& on_token) {
  const model_config& c = m_.config;
  const std::uint32_t ctx = o_.context != 0 ? o_.context : c.context_length;
  begin(prompt, ctx);
  const auto t0 = clock_type::now();
  tf_.prefill(
      prompt.data(), static_cast<std::uint32_t>(prompt.size()),
      [&](std::uint32_t l, const float* k, const float* v, std::uint32_t n) {
        commit_prompt(l, k, v, n);
        if (o_.progress)
          o_.progress("prefill", l + 1, c.num_layers, since(t0));
      },
      logits_.data());
  report_.prefill_seconds = since(t0);
  return decode(prompt, ctx, on_token);
}

prefilled_prompt decoder::prefill(const std::vector<int>& prompt) {
  const model_config& c = m_.config;
  if (prompt.empty()) {
    fail("the prompt is empty");
  }
  prefilled_prompt p;
  p.prompt = prompt;
  p.k.resize(c.num_layers);
  p.v.resize(c.num_layers);
  p.logits.resize(c.vocab_size);
  const auto t0 = clock_type::now();
  tf_.prefill(
      prompt.data(), static_cast<std::uint32_t>(prompt.size()),
      [&](std::uint32_t l, const float* k, const float* v, std::uint32_t n) {
        to_f16_bits(k, v, std::size_t{n} * kv_dim_, p.k[l], p.v[l]);
        if (o_.progress)
          o_.progress("prefill", l + 1, c.num_layers, since(t0));
      },
      p.logits.data());
  p.seconds = since(t0);
  return p;
}

std::vector<int> decoder::generate(const prefilled_prompt& p,
                                   const std::function<bool(int)>& on_token) {
  const model_config& c = m_.config;
  const std::uint32_t ctx = o_.context != 0 ? o_.context : c.context_length;
  const auto P = static_cast<std::uint32_t>(p.prompt.size());
  if (p.k.size() != c.num_layers || p.v.size() != c.num_layers || p.logits.size() != c.vocab_size) {
    fail("the prefilled prompt is not this model's");
  }
  begin(p.prompt, ctx);
  std::vector<float> k, v;
  for (std::uint32_t l = 0; l < c.num_layers; ++l) {
    if (p.k[l].size() != std::size_t{P} * kv_dim_ || p.v[l].size() != p.k[l].size()) {
      fail("the prefilled prompt's layer ", l, " holds ", p.k[l].size(), " values, not ",
           std::size_t{P} * kv_dim_);
    }
    cache_->append(l, p.k[l].data(), p.v[l].data(), P);
    // Widened back (exactly: they are f16 values) where the draft cache and the side buffer
    // take f32: the whole layer for the draft model's, the last tokens for the side buffer.
    const bool draft = drafter_ && l < drafter_->layers();
    const std::uint32_t keep = std::min(P, verify_side::max_tokens), from = draft ? 0 : P - keep;
    k.resize(std::size_t{P - from} * kv_dim_);
    v.resize(k.size());
    for (std::size_t i = 0; i < k.size(); ++i) {
      k[i] = oasiskv::f16{p.k[l][std::size_t{from} * kv_dim_ + i]}.to_float();
      v[i] = oasiskv::f16{p.v[l][std::size_t{from} * kv_dim_ + i]}.to_float();
    }
    if (draft) {
      drafter_->append(draft_seq_, l, k.data(), v.data(), P);
    }
    const std::size_t last = std::size_t{P - from - keep} * kv_dim_;
    side_.push(l, k.data() + last, v.data() + last, keep);
  }
  std::copy(p.logits.begin(), p.logits.end(), logits_.begin());
  report_.prefill_seconds = p.seconds;
  return decode(p.prompt, ctx, on_token);
}

std::vector<int> decoder::decode(const std::vector<int>& prompt, std::uint32_t ctx,
                                 const std::function<bool(int)>& on_token) {
  const model_config& c = m_.config;
  const auto P = static_cast<std::uint32_t>(prompt.size());
  sampler smp(o_.temperature, o_.top_p, o_.seed);
  const auto t1 = clock_type::now();
  auto last_progress = t1;
  std::vector<int> out, history = prompt;
  bool stop = false;
  auto emit = [&](int tok) {
    if (stop)
      return;
    if (!o_.ignore_eos && m_.tok->is_end(tok)) {
      stop = true;
      return;
    }
    out.push_back(tok);
    report_.generated = static_cast<std::uint32_t>(out.size());
    if ((on_token && !on_token(tok)) || out.size() >= o_.max_tokens) {
      stop = true;
    }
  };
  int x = smp.sample(logits_.data(), c.vocab_size);
  emit(x);
  std::uint32_t p = P;  // committed tokens in the cache; x is at position p
  const attention_fn verify = [this](std::uint32_t l, std::uint32_t n, const float* q,
                                     const float* k, const float* v, float* o) {
    verify_attend(l, n, q, k, v, o);
  };
  draft_length length(o_.draft == draft_kind::none ? 0 : o_.draft_len, o_.adaptive_draft);
  std::vector<int> batch;
  self_drafter::job job;
  while (!stop && p + 1 < ctx) {
    std::uint32_t g = 0;
    if (o_.draft != draft_kind::none) {
      g = std::min(
          {length.next(), p, ctx - 1 - p, o_.max_tokens - static_cast<std::uint32_t>(out.size())});
    }
    std::vector<int> drafts;
    if (g > 0 && drafter_) {
      job.seq = draft_seq_;
      job.token = x;
      job.pos = p;
      job.count = g;
      drafter_->draft(std::span<self_drafter::job>(&job, 1));
      drafts = job.drafts;
    } else if (g > 0) {
      history.push_back(x);
      drafts = ngram_draft(history, g);
      history.pop_back();
    }
    batch.assign(1, x);
    batch.insert(batch.end(), drafts.begin(), drafts.end());
    const auto n = static_cast<std::uint32_t>(batch.size());
    tf_.step(batch.data(), n, p, c.num_layers, verify, logits_.data());
    // Accept the longest prefix of drafts the target agrees with, plus the target's own token.
    const acceptance acc = accept_drafts(smp, logits_.data(), c.vocab_size, drafts);
    const std::uint32_t a = acc.accepted;
    length.update(static_cast<std::uint32_t>(drafts.size()), a);
    ++report_.rounds;
    report_.drafted += static_cast<std::uint32_t>(drafts.size());
    report_.accepted += a;
    // Commit the pending token and the accepted drafts; the rejected ones were never appended.
    for (std::uint32_t l = 0; l < c.num_layers; ++l) {
      const float* k = verify_k_[l].data();
      const float* v = verify_v_[l].data();
      if (a > 0) {
        append_f16(*cache_, l, k + kv_dim_, v + kv_dim_, a);
      }
      if (drafter_) {
        drafter_->append(draft_seq_, l, k, v, a + 1);
      }
      side_.push(l, k, v, a + 1);
    }
    history.insert(history.end(), batch.begin(), batch.begin() + a + 1);
    p += a + 1;
    for (std::uint32_t i = 0; i < a; ++i)
      emit(drafts[i]);
    emit(acc.next);
    x = acc.next;
    if (o_.progress && since(last_progress) > 0.25) {
      last_progress = clock_type::now();
      o_.progress("decode", static_cast<std::uint32_t>(out.size()), o_.max_tokens, since(t1));
    }
  }
  report_.decode_seconds = since(t1);
  report_.cache = cache_->stats();
  report_.fast_tier_bytes = cache_->fast_tier_bytes();
  report_.capacity_tier_bytes = cache_->capacity_tier_bytes();
  report_.summary_bytes = cache_->summary_bytes();
  const oasiskv::kv_layout& l = cache_->layout();
  report_.dense_kv_bytes =
      std::uint64_t{l.num_layers} * l.blocks_for(cache_->length(0)) * l.block_bytes();
  if (o_.progress)
    o_.progress("done", report_.generated, o_.max_tokens, report_.decode_seconds);
  return out;
}

}  // namespace mini_decoder
