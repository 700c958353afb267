// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/decode/decoder.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include <mini_decoder/io/error.hpp>

#include "oasiskv/core/dtype.hpp"

namespace mini_decoder {
namespace {
using clock_type = std::chrono::steady_clock;
double since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}
constexpr std::uint32_t tail_tokens = transformer::max_step_tokens;
}  // namespace

decoder::decoder(const model& m, decoder_options o)
    : m_(m), o_(std::move(o)), tf_(m, o_.rope_scale) {
  const model_config& c = m.config;
  kv_dim_ = c.num_kv_heads * c.head_dim;
  scale_ = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
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

void decoder::append_f16(kv_backend& c, std::uint32_t l, const float* k, const float* v,
                         std::uint32_t n) {
  to_f16_bits(k, v, std::size_t{n} * kv_dim_, k16_, v16_);
  c.append(l, k16_.data(), v16_.data(), n);
}

void decoder::push_tail(std::uint32_t l, const float* k, const float* v, std::uint32_t n) {
  layer_tail& t = tails_[l];
  t.k.insert(t.k.end(), k, k + std::size_t{n} * kv_dim_);
  t.v.insert(t.v.end(), v, v + std::size_t{n} * kv_dim_);
  const std::size_t keep = std::size_t{tail_tokens} * kv_dim_;
  if (t.k.size() > keep) {
    t.k.erase(t.k.begin(), t.k.end() - static_cast<std::ptrdiff_t>(keep));
    t.v.erase(t.v.begin(), t.v.end() - static_cast<std::ptrdiff_t>(keep));
  }
}

// Folds side tokens into attention the cache computed: query j also attends side entries
// [j + first_shift, j + first_shift + count) (count = 0: all of them), merged through the
// cache's log-sum-exp, so the result is exact attention over the union.
void decoder::merge_side(const float* q, std::uint32_t n, const float* sk, const float* sv,
                         std::uint32_t first_shift, std::uint32_t count, float* out,
                         const float* lse) {
  const model_config& c = m_.config;
  const std::uint32_t hd = c.head_dim, group = c.num_heads / c.num_kv_heads;
  std::vector<float> s(tail_tokens * 2), acc(hd);
  for (std::uint32_t j = 0; j < n; ++j) {
    const std::uint32_t first = j + first_shift;
    for (std::uint32_t h = 0; h < c.num_heads; ++h) {
      const std::size_t row = std::size_t{j} * c.num_heads + h;
      const float* qv = q + row * hd;
      const std::size_t off = std::size_t{h / group} * hd;
      float mx = lse[row];
      for (std::uint32_t i = 0; i < count; ++i) {
        const float* kv = sk + std::size_t{first + i} * kv_dim_ + off;
        float dot = 0.0f;
        for (std::uint32_t x = 0; x < hd; ++x)
          dot += qv[x] * kv[x];
        s[i] = scale_ * dot;
        mx = std::max(mx, s[i]);
      }
      const float wc = std::isinf(lse[row]) ? 0.0f : std::exp(lse[row] - mx);
      float* o = out + row * hd;
      float den = wc;
      for (std::uint32_t x = 0; x < hd; ++x)
        acc[x] = wc * o[x];
      for (std::uint32_t i = 0; i < count; ++i) {
        const float e = std::exp(s[i] - mx);
        const float* vv = sv + std::size_t{first + i} * kv_dim_ + off;
        for (std::uint32_t x = 0; x < hd; ++x)
          acc[x] += e * vv[x];
        den += e;
      }
      for (std::uint32_t x = 0; x < hd; ++x)
        o[x] = acc[x] / den;
    }
  }
}

// Verification in layer l of n = g + 1 tokens at positions p..p+g: token 0 (the pending token)
// is committed already and is appended; the g drafts are never appended before acceptance.
// The library's attend treats its q_len queries as the last q_len cached positions, so query j
// sees cached positions <= p - g + j; the g positions it also needs (the last g - 1 committed
// tokens, the pending token and the drafts up to itself) come from a side buffer, merged exactly
// by log-sum-exp.
void decoder::verify_attend(std::uint32_t l, std::uint32_t n, const float* q, const float* k,
                            const float* v, float* out) {
  const std::size_t bytes = std::size_t{n} * kv_dim_;
  verify_k_[l].assign(k, k + bytes);
  verify_v_[l].assign(v, v + bytes);
  append_f16(*cache_, l, k, v, 1);
  lse_.resize(std::size_t{n} * m_.config.num_heads);
  cache_->attend(l, q, n, out, lse_.data(), nullptr);
  const std::uint32_t g = n - 1;
  if (g > 0) {
    const layer_tail& t = tails_[l];
    const std::size_t from_tail = std::size_t{g - 1} * kv_dim_;
    side_k_.assign(t.k.end() - static_cast<std::ptrdiff_t>(from_tail), t.k.end());
    side_v_.assign(t.v.end() - static_cast<std::ptrdiff_t>(from_tail), t.v.end());
    side_k_.insert(side_k_.end(), k, k + bytes);
    side_v_.insert(side_v_.end(), v, v + bytes);
    merge_side(q, n, side_k_.data(), side_v_.data(), 0, g, out, lse_.data());
  }
  // This round's queries (pending token + drafts) predict the next round's blocks in layer l;
  // the transfers overlap the rest of this round and the next draft.
  cache_->lookahead(l, q, n);
}

// The draft model's attention for one token: its cache holds the committed tokens; the tokens
// drafted this round (the pending one first) are in draft_k_/draft_v_, itself last.
void decoder::draft_attend(std::uint32_t l, const float* q, const float* k, const float* v,
                           float* out) {
  draft_k_[l].insert(draft_k_[l].end(), k, k + kv_dim_);
  draft_v_[l].insert(draft_v_[l].end(), v, v + kv_dim_);
  lse_.resize(m_.config.num_heads);
  draft_cache_->attend(l, q, 1, out, lse_.data(), nullptr);
  const auto count = static_cast<std::uint32_t>(draft_k_[l].size() / kv_dim_);
  merge_side(q, 1, draft_k_[l].data(), draft_v_[l].data(), 0, count, out, lse_.data());
}

std::vector<int> decoder::self_draft(int x, std::uint32_t p, std::uint32_t g) {
  for (std::uint32_t l = 0; l < o_.draft_layers; ++l) {
    draft_k_[l].clear();
    draft_v_[l].clear();
  }
  const attention_fn attend = [this](std::uint32_t l, std::uint32_t, const float* q, const float* k,
                                     const float* v, float* out) {
    draft_attend(l, q, k, v, out);
  };
  std::vector<int> drafts;
  int tok = x;
  for (std::uint32_t j = 0; j < g; ++j) {
    tf_.step(&tok, 1, p + j, o_.draft_layers, attend, logits_.data());
    tok = argmax(logits_.data(), m_.config.vocab_size);
    drafts.push_back(tok);
  }
  return drafts;
}

std::vector<int> decoder::generate(const std::vector<int>& prompt,
                                   const std::function<bool(int)>& on_token) {
  const model_config& c = m_.config;
  const std::uint32_t ctx = o_.context != 0 ? o_.context : c.context_length;
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
  draft_cache_.reset();
  const bool self = o_.draft == draft_kind::self;
  if (self) {
    cache_config dc = cc;
    dc.mode = attention_mode::dense;  // the draft model keeps its own small dense cache
    dc.num_layers = o_.draft_layers;
    draft_cache_ = make_kv_backend(dc);
  }
  tails_.assign(c.num_layers, {});
  verify_k_.assign(c.num_layers, {});
  verify_v_.assign(c.num_layers, {});
  draft_k_.assign(c.num_layers, {});
  draft_v_.assign(c.num_layers, {});
  logits_.resize(std::size_t{transformer::max_step_tokens} * c.vocab_size);
  sampler smp(o_.temperature, o_.top_p, o_.seed);

  // -- prefill -------------------------------------------------------------------------------
  const auto t0 = clock_type::now();
  tf_.prefill(
      prompt.data(), P,
      [&](std::uint32_t l, const float* k, const float* v, std::uint32_t n) {
        append_f16(*cache_, l, k, v, n);
        if (self && l < o_.draft_layers) {
          append_f16(*draft_cache_, l, k, v, n);
        }
        const std::uint32_t keep = std::min(n, tail_tokens);
        push_tail(l, k + std::size_t{n - keep} * kv_dim_, v + std::size_t{n - keep} * kv_dim_,
                  keep);
        if (o_.progress)
          o_.progress("prefill", l + 1, c.num_layers, since(t0));
      },
      logits_.data());
  report_.prefill_seconds = since(t0);

  // -- decode rounds ---------------------------------------------------------------------------
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
  std::vector<int> batch;
  while (!stop && p + 1 < ctx) {
    std::uint32_t g = 0;
    if (o_.draft != draft_kind::none) {
      g = std::min(
          {o_.draft_len, p, ctx - 1 - p, o_.max_tokens - static_cast<std::uint32_t>(out.size())});
    }
    std::vector<int> drafts;
    if (g > 0 && self) {
      drafts = self_draft(x, p, g);
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
    std::uint32_t a = 0;
    int y = 0;
    for (std::uint32_t i = 0; i < n; ++i) {
      const int t = smp.sample(logits_.data() + std::size_t{i} * c.vocab_size, c.vocab_size);
      if (i < drafts.size() && t == drafts[i]) {
        ++a;
        continue;
      }
      y = t;
      break;
    }
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
      if (self && l < o_.draft_layers) {
        append_f16(*draft_cache_, l, k, v, a + 1);
      }
      push_tail(l, k, v, a + 1);
    }
    history.insert(history.end(), batch.begin(), batch.begin() + a + 1);
    p += a + 1;
    for (std::uint32_t i = 0; i < a; ++i)
      emit(drafts[i]);
    emit(y);
    x = y;
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
