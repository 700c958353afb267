// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/batch/batch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>

#include <mini_decoder/io/error.hpp>
#include <mini_decoder/kv/cache_bundles.hpp>
#include <mini_decoder/ops/threads.hpp>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/cpu/thread_pool.hpp"

namespace mini_decoder {

namespace {

using clock_type = batch_engine::clock_type;
double since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

}  // namespace

latency_summary summarise(std::vector<double> v) {
  latency_summary s;
  if (v.empty()) {
    return s;
  }
  std::sort(v.begin(), v.end());
  auto at = [&](double q) {
    const auto i = static_cast<std::size_t>(std::ceil(q * static_cast<double>(v.size()))) - 1;
    return v[std::min(i, v.size() - 1)];
  };
  s.p50 = at(0.50);
  s.p90 = at(0.90);
  s.p99 = at(0.99);
  s.max = v.back();
  return s;
}

sampling_params sampling_of(const batch_request& r) {
  sampling_params p = r.sampling;
  p.temperature = r.temperature;
  p.top_p = r.top_p;
  p.seed = r.seed;
  return p;
}

batch_engine::batch_engine(const model& m, batch_options o)
    : m_(m), o_(std::move(o)), tf_(m, o_.rope_scale) {
  const model_config& c = m.config;
  if (o_.mode != attention_mode::dense && o_.mode != attention_mode::oasis) {
    fail("the batched engine runs --mode dense or oasis, not ", to_string(o_.mode));
  }
  if (o_.fast_tier_bytes == 0) {
    fail(
        "the batched engine's fast-tier budget is 0 bytes: give it the fast memory its "
        "sequences may hold");
  }
  if (o_.max_batch == 0) {
    fail("the batched engine's max_batch must be at least 1");
  }
  if (o_.draft != draft_kind::none &&
      (o_.draft_len == 0 || o_.draft_len >= transformer::max_step_tokens)) {
    fail("--draft-len = ", o_.draft_len, " must be in [1, ", transformer::max_step_tokens - 1,
         "] (a verification is at most 16 tokens)");
  }
  if (o_.draft == draft_kind::self && (o_.draft_layers == 0 || o_.draft_layers >= c.num_layers)) {
    fail("--draft-layers = ", o_.draft_layers, " must be in [1, ", c.num_layers - 1, "]");
  }
  ctx_ = o_.context != 0 ? o_.context : c.context_length;
  kv_dim_ = c.num_kv_heads * c.head_dim;
  const oasiskv::kv_layout l{c.num_layers, c.num_heads,     c.num_kv_heads,
                             c.head_dim,   o_.block_tokens, oasiskv::dtype::f16};
  try {
    l.validate();
  } catch (const oasiskv::error& e) {
    fail("bad cache layout (--block = ", o_.block_tokens, "): ", e.what());
  }
  block_bytes_ = l.block_bytes();
  if (o_.mode == attention_mode::oasis) {
    summary_block_bytes_ = bundles::with_summary(o_.summary, [&]<class S>(std::type_identity<S>) {
      return static_cast<std::uint64_t>(S(l, 1).bytes_per_block());
    });
  }
  fast_slots_ = o_.fast_tier_bytes / block_bytes_;
  oasiskv::cache_options co;
  co.max_tokens_per_sequence = ctx_;
  const std::uint32_t ctx_blocks = l.blocks_for(ctx_);
  const std::uint32_t min_blocks = co.sink_blocks + co.recent_blocks;
  // Per layer of a sequence at the full context: the fast-tier blocks it may stage.
  std::uint64_t staging = ctx_blocks;
  if (o_.mode == attention_mode::dense) {
    // Every block is attended (the predictor ignores the budget); the cache only asks that one
    // selection fit in its fast tier.
    if (fast_slots_ < min_blocks + 1) {
      fail("the fast-tier budget of ", o_.fast_tier_bytes, " bytes holds ", fast_slots_,
           " blocks of ", block_bytes_, " bytes; the dense cache needs at least ", min_blocks + 1);
    }
    budget_blocks_ = static_cast<std::uint32_t>(
        std::max<std::uint64_t>(min_blocks, std::min<std::uint64_t>(ctx_blocks, fast_slots_ - 1)));
    co.budget_tokens = budget_blocks_ * o_.block_tokens;
  } else {
    co.budget_tokens = o_.budget_tokens;
    budget_blocks_ = l.blocks_for(o_.budget_tokens);
    if (o_.budget_tokens == 0 || budget_blocks_ < min_blocks) {
      fail("--budget = ", o_.budget_tokens, " tokens is below the minimum of ",
           min_blocks * o_.block_tokens, " (", co.sink_blocks, " sink + ", co.recent_blocks,
           " recent blocks of ", o_.block_tokens, " tokens)");
    }
    if (fast_slots_ < std::uint64_t{budget_blocks_} + 1) {
      fail("the fast-tier budget of ", o_.fast_tier_bytes, " bytes holds ", fast_slots_,
           " blocks of ", block_bytes_, " bytes, fewer than one selection of ", budget_blocks_,
           " blocks (--budget = ", o_.budget_tokens, ") plus the block being appended to");
    }
    staging = std::min<std::uint64_t>(ctx_blocks, 2ull * budget_blocks_ + 4);
  }
  // The fast tier never needs more than max_batch sequences at the full context.
  const std::uint64_t most_fast = std::uint64_t{o_.max_batch} * c.num_layers * staging;
  const std::uint64_t fast_tier_slots =
      std::max<std::uint64_t>(std::min(fast_slots_, most_fast), budget_blocks_ + 1);
  // Every admitted sequence's capacity need is at most max(2, (blocks + 1) / staging) times its
  // fast need (blocks(len) + 1 vs min(blocks(len), staging) per layer), and their fast needs sum
  // to at most the budget: this many capacity slots hold every set admission lets in.
  const std::uint64_t ratio_bound =
      std::max(2 * fast_slots_, (fast_slots_ * (ctx_blocks + 1) + staging - 1) / staging);
  capacity_slots_ = std::min(
      ratio_bound, std::uint64_t{o_.max_batch} * c.num_layers * (std::uint64_t{ctx_blocks} + 1));
  constexpr std::uint64_t max_slots = 0xFFFFFFF0u;
  if (capacity_slots_ > max_slots || fast_tier_slots > max_slots) {
    fail("the fast-tier budget of ", o_.fast_tier_bytes, " bytes makes a cache of ",
         capacity_slots_, " capacity blocks, more than a tier holds");
  }
  shared_cache_config sc;
  sc.mode = o_.mode;
  sc.summary = o_.summary;
  sc.layout = l;
  sc.capacity_slots = static_cast<std::uint32_t>(capacity_slots_);
  sc.fast_slots = static_cast<std::uint32_t>(fast_tier_slots);
  sc.options = co;
  sc.attention_threads = o_.attention_threads;
  cache_ = make_shared_kv_cache(sc);
  if (o_.draft == draft_kind::self) {
    // The draft model's blocks are a share of each admitted sequence's need: draft / (draft +
    // staged), which grows with the length, so its value at the full context bounds the share
    // of the whole budget that every admitted set's draft blocks take.
    const long double d = static_cast<long double>(o_.draft_layers) * ctx_blocks;
    const long double share = d / (d + static_cast<long double>(c.num_layers) * staging);
    const auto draft_slots = std::min<std::uint64_t>(
        static_cast<std::uint64_t>(std::ceil(static_cast<long double>(fast_slots_) * share)) +
            o_.draft_layers,
        std::uint64_t{o_.max_batch} * o_.draft_layers * ctx_blocks);
    drafter_ = std::make_unique<self_drafter>(m, o_.draft_layers, o_.block_tokens, ctx_,
                                              draft_slots, o_.rope_scale, o_.attention_threads);
  }
  report_.fast_tier_bytes = fast_tier_slots * block_bytes_;
  report_.capacity_tier_bytes = capacity_slots_ * block_bytes_;
}

batch_engine::~batch_engine() = default;

sequence_need batch_engine::need(std::uint32_t prompt_tokens, std::uint32_t max_tokens) const {
  const std::uint64_t len = std::uint64_t{prompt_tokens} + max_tokens;
  const std::uint64_t blocks = (len + o_.block_tokens - 1) / o_.block_tokens;
  const std::uint64_t per_layer = o_.mode == attention_mode::dense
                                      ? blocks
                                      : std::min<std::uint64_t>(blocks, 2ull * budget_blocks_ + 4);
  sequence_need r;
  r.summary_bytes = blocks * m_.config.num_layers * summary_block_bytes_;
  if (o_.draft == draft_kind::self) {
    r.draft_slots = self_drafter::slots_for(o_.draft_layers, o_.block_tokens, len);
  }
  r.fast_slots = per_layer * m_.config.num_layers +
                 (r.summary_bytes + block_bytes_ - 1) / block_bytes_ + r.draft_slots;
  r.capacity_slots = (blocks + 1) * m_.config.num_layers;
  r.fast_bytes = r.fast_slots * block_bytes_;
  return r;
}

batch_engine::request_id batch_engine::submit(batch_request r) {
  const model_config& c = m_.config;
  const auto P = static_cast<std::uint32_t>(r.prompt.size());
  if (P == 0) {
    fail("batch request: the prompt is empty");
  }
  if (r.max_tokens == 0) {
    fail("batch request: max_tokens must be at least 1");
  }
  for (std::uint32_t i = 0; i < P; ++i) {
    if (r.prompt[i] < 0 || static_cast<std::uint32_t>(r.prompt[i]) >= c.vocab_size) {
      fail("batch request: prompt token ", i, " = ", r.prompt[i], " is outside the vocabulary of ",
           c.vocab_size);
    }
  }
  (void)sampler(sampling_of(r));  // checks the sampling parameters
  for (const auto& [token, bias] : r.sampling.logit_bias) {
    if (static_cast<std::uint32_t>(token) >= c.vocab_size) {
      fail("batch request: logit_bias names token ", token, ", outside the vocabulary of ",
           c.vocab_size);
    }
  }
  const std::uint64_t len = std::uint64_t{P} + r.max_tokens;
  if (len > ctx_) {
    fail("batch request: a prompt of ", P, " tokens + max_tokens = ", r.max_tokens, " is ", len,
         " tokens, beyond the context of ", ctx_, " tokens");
  }
  const sequence_need nd = need(P, r.max_tokens);
  if (nd.fast_slots > fast_slots_ || nd.capacity_slots > capacity_slots_) {
    fail("batch request: ", len, " tokens need ", nd.fast_bytes, " bytes of fast tier (",
         nd.fast_slots, " blocks of ", block_bytes_, " bytes, ", to_string(o_.mode),
         "), more than the whole budget of ", o_.fast_tier_bytes, " bytes (", fast_slots_,
         " blocks): it could never be admitted");
  }
  const request_id id = next_id_++;
  record& rec = records_[id];
  rec.req = std::move(r);
  rec.need = nd;
  rec.rep.prompt_tokens = P;
  rec.submitted = clock_type::now();
  queue_.push_back(id);
  return id;
}

batch_engine::record& batch_engine::find(request_id id, const char* what) {
  const auto it = records_.find(id);
  if (it == records_.end()) {
    fail("batch_engine::", what, ": no request ", id);
  }
  return it->second;
}

const batch_engine::record& batch_engine::find(request_id id, const char* what) const {
  return const_cast<batch_engine*>(this)->find(id, what);
}

void batch_engine::cancel(request_id id) {
  record& r = find(id, "cancel");
  if (r.rep.done) {
    return;
  }
  r.rep.done = true;
  if (const auto q = std::find(queue_.begin(), queue_.end(), id); q != queue_.end()) {
    queue_.erase(q);
    return;
  }
  const auto a =
      std::find_if(active_.begin(), active_.end(), [id](const sequence& s) { return s.id == id; });
  if (a != active_.end()) {
    release(*a);  // its sequences leave the caches (the draft model's too), its bytes return
    active_.erase(a);
  }
}

bool batch_engine::done(request_id id) const {
  return find(id, "done").rep.done;
}

void batch_engine::forget(request_id id) {
  if (!find(id, "forget").rep.done) {
    fail("batch_engine::forget: request ", id, " is not done");
  }
  records_.erase(id);
}
const std::vector<int>& batch_engine::output(request_id id) const {
  return find(id, "output").out;
}
const request_report& batch_engine::report(request_id id) const {
  return find(id, "report").rep;
}
const batch_report& batch_engine::report() const {
  return report_;
}

std::size_t batch_engine::decoding() const {
  return static_cast<std::size_t>(std::count_if(active_.begin(), active_.end(),
                                                [](const sequence& s) { return s.decoding(); }));
}

// Hands tokens committed together to the request: each is checked for the end and the limits and
// seen by its callback; the time since the last delivery is shared by the tokens delivered.
void batch_engine::deliver(sequence& s, const int* tokens, std::uint32_t count,
                           const token_logprobs* logprobs) {
  record& r = find(s.id, "deliver");
  const std::size_t before = r.out.size();
  for (std::uint32_t i = 0; i < count && !s.stop; ++i) {
    const int tok = tokens[i];
    if (!r.req.ignore_eos && m_.tok->is_end(tok)) {
      s.stop = true;
      break;
    }
    r.out.push_back(tok);
    if (logprobs && r.req.on_logprobs) {
      r.req.on_logprobs(logprobs[i]);
    }
    if ((r.req.on_token && !r.req.on_token(tok)) || r.out.size() >= r.req.max_tokens) {
      s.stop = true;
    }
  }
  const std::size_t delivered = r.out.size() - before;
  if (delivered == 0) {
    return;
  }
  const auto now = clock_type::now();
  std::size_t timed = delivered;
  if (before == 0) {
    r.rep.first_token_seconds = std::chrono::duration<double>(now - r.submitted).count();
    timed -= 1;  // the first token's time is the time to first token
  } else {
    const double gap = std::chrono::duration<double>(now - r.last_token).count();
    r.rep.delivery_seconds.push_back(gap);
    r.rep.token_seconds.insert(r.rep.token_seconds.end(), timed, gap / static_cast<double>(timed));
    timed = 0;
  }
  r.rep.token_seconds.insert(r.rep.token_seconds.end(), timed, 0.0);
  r.last_token = now;
  r.rep.generated = static_cast<std::uint32_t>(r.out.size());
}

void batch_engine::admit(request_id id) {
  record& r = find(id, "admit");
  r.rep.admitted_seconds = since(r.submitted);
  active_.emplace_back(id, r.req, o_, m_.config);
  sequence& s = active_.back();
  s.seq = cache_->add();
  if (drafter_) {
    s.draft_seq = drafter_->add();
  }
  if (o_.draft == draft_kind::ngram) {
    s.history = r.req.prompt;
  }
  fast_used_ += r.need.fast_slots;
  capacity_used_ += r.need.capacity_slots;
}

void batch_engine::release(const sequence& s) {
  record& r = find(s.id, "retire");
  r.rep.done = true;
  cache_->remove(s.seq);
  if (drafter_) {
    drafter_->remove(s.draft_seq);
  }
  fast_used_ -= r.need.fast_slots;
  capacity_used_ -= r.need.capacity_slots;
}

void batch_engine::retire_finished() {
  for (const sequence& s : active_) {
    if (s.stop) {
      release(s);
    }
  }
  active_.erase(
      std::remove_if(active_.begin(), active_.end(), [](const sequence& s) { return s.stop; }),
      active_.end());
}

// -- prefill -------------------------------------------------------------------------------------

// Tokens [prefilled, prefilled + n) of the sequence's prompt, one dense pass (the earlier chunks'
// K,V read back from the capacity tier); the last chunk samples the first token.
void batch_engine::prefill_chunk(sequence& s, std::uint32_t n) {
  const record& r = find(s.id, "prefill");
  const model_config& c = m_.config;
  logits_.resize(std::max<std::size_t>(logits_.size(), c.vocab_size));
  const oasiskv::sequence_id seq = s.seq;
  tf_.prefill(
      r.req.prompt.data() + s.prefilled, n, s.prefilled,
      [&](std::uint32_t l, std::uint32_t past, float* k, float* v) {
        cache_->read(seq, l, past, k, v);
      },
      [&](std::uint32_t l, const float* k, const float* v, std::uint32_t rows) {
        to_f16_bits(k, v, std::size_t{rows} * kv_dim_, k16_, v16_);
        cache_->append(std::span<const oasiskv::sequence_id>(&seq, 1), l, k16_.data(), v16_.data(),
                       rows);
        if (drafter_) {
          drafter_->append(s.draft_seq, l, k, v, rows);
        }
        const std::uint32_t keep = std::min(rows, verify_side::max_tokens);
        s.side.push(l, k + std::size_t{rows - keep} * kv_dim_,
                    v + std::size_t{rows - keep} * kv_dim_, keep);
      },
      logits_.data());
  s.prefilled += n;
  ++report_.prefill_chunks;
  report_.prefill_tokens += n;
  if (s.decoding()) {
    s.pos = s.prompt;
    s.pending = s.smp.sample(logits_.data(), c.vocab_size);
    s.smp.accept(s.pending);
    deliver(s, &s.pending, 1, &s.smp.last());
  }
}

// The prefill part of a step: chunks of the sequences being admitted, in admission order, within
// `budget` tokens (all of them without a step budget): whole multiples of the attention's row
// block where the budget allows, else what it allows, but at least `min_prefill_chunk` tokens a
// step so that prefill goes on however many rows decode.
void batch_engine::prefill_step(std::uint32_t budget) {
  const auto t0 = clock_type::now();
  const bool unbounded = o_.step_tokens == 0;
  // With nothing decoding, the first prompt holds no one up: it goes whole.
  bool whole = decoding() == 0;
  bool first = true;
  for (sequence& s : active_) {
    if (s.decoding()) {
      continue;
    }
    const std::uint32_t left = s.prompt - s.prefilled;
    std::uint32_t n = left;
    if (!unbounded && !whole && left > budget) {
      n = budget >= transformer::prefill_rows
              ? budget / transformer::prefill_rows * transformer::prefill_rows
              : budget;
      if (first) {
        n = std::max(n, std::min(left, min_prefill_chunk));
      }
    }
    if (n == 0) {
      break;
    }
    prefill_chunk(s, n);
    budget -= std::min(budget, n);
    whole = first = false;
    if (!unbounded && budget == 0) {
      break;
    }
  }
  report_.prefill_seconds += since(t0);
}

// -- the speculative round -----------------------------------------------------------------------

// Picks each decoding sequence's draft length, trims the longest to fit the step's budget, and
// drafts: prompt lookup per sequence, or the draft model for all of them together.
void batch_engine::draft_round(std::uint32_t budget) {
  std::vector<std::uint32_t> want(round_.size(), 0);
  std::uint64_t rows = 0;
  for (std::size_t i = 0; i < round_.size(); ++i) {
    sequence& s = *round_[i];
    const record& r = find(s.id, "draft");
    if (o_.draft != draft_kind::none) {
      const auto left = static_cast<std::uint32_t>(r.req.max_tokens - r.out.size());
      want[i] = std::min({s.length.next(), s.pos, ctx_ - 1 - s.pos, left});
    }
    rows += want[i] + 1;
  }
  while (rows > budget) {  // the longest draft gives a token back first
    const auto longest = std::max_element(want.begin(), want.end());
    if (*longest == 0) {
      break;
    }
    --*longest;
    --rows;
  }
  jobs_.clear();
  for (std::size_t i = 0; i < round_.size(); ++i) {
    sequence& s = *round_[i];
    s.drafts.clear();
    if (want[i] == 0) {
      continue;
    }
    if (o_.draft == draft_kind::ngram) {
      s.history.push_back(s.pending);
      s.drafts = ngram_draft(s.history, want[i]);
      s.history.pop_back();
    } else {
      self_drafter::job j;
      j.seq = s.draft_seq;
      j.token = s.pending;
      j.pos = s.pos;
      j.count = want[i];
      jobs_.push_back(std::move(j));
    }
  }
  if (!jobs_.empty()) {
    drafter_->draft(jobs_);
    std::size_t next = 0;
    for (std::size_t i = 0; i < round_.size(); ++i) {
      if (want[i] > 0) {
        round_[i]->drafts = std::move(jobs_[next++].drafts);
      }
    }
  }
}

// One layer of the verification: the pending tokens are committed (one batched append), each
// run of sequences with as many rows attends in one call (q_len = rows), the side buffer adds
// the positions the cache hides from each row, and the rows' queries predict the next step's
// blocks of this layer (the transfers overlap the other layers and the next drafts).
void batch_engine::verify_layer(std::uint32_t l, std::uint32_t rows, const float* q, const float* k,
                                const float* v, float* out) {
  const model_config& c = m_.config;
  const std::size_t qd = std::size_t{c.num_heads} * c.head_dim;
  verify_k_[l].assign(k, k + std::size_t{rows} * kv_dim_);
  verify_v_[l].assign(v, v + std::size_t{rows} * kv_dim_);
  const std::size_t n = round_.size();
  past_k_.resize(n * kv_dim_);
  past_v_.resize(n * kv_dim_);
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t from = std::size_t{round_[i]->row} * kv_dim_;
    std::copy(k + from, k + from + kv_dim_,
              past_k_.begin() + static_cast<std::ptrdiff_t>(i * kv_dim_));
    std::copy(v + from, v + from + kv_dim_,
              past_v_.begin() + static_cast<std::ptrdiff_t>(i * kv_dim_));
  }
  to_f16_bits(past_k_.data(), past_v_.data(), n * kv_dim_, k16_, v16_);
  cache_->append(seq_ids_, l, k16_.data(), v16_.data(), 1);
  lse_.resize(std::size_t{rows} * c.num_heads);
  for (std::size_t gi = 0; gi + 1 < groups_.size(); ++gi) {
    const std::uint32_t b = groups_[gi], e = groups_[gi + 1];
    const std::uint32_t row0 = round_[b]->row;
    const auto q_len = static_cast<std::uint32_t>(round_[b]->drafts.size() + 1);
    const std::span<const oasiskv::sequence_id> seqs(seq_ids_.data() + b, e - b);
    cache_->attend(seqs, l, q + row0 * qd, q_len, out + row0 * qd,
                   lse_.data() + std::size_t{row0} * c.num_heads);
    if (q_len > 1) {
      engine_pool().parallel_for(e - b, [&](std::size_t i) {
        sequence& s = *round_[b + i];
        s.side.merge(l, q + s.row * qd, k + std::size_t{s.row} * kv_dim_,
                     v + std::size_t{s.row} * kv_dim_, q_len, out + s.row * qd,
                     lse_.data() + std::size_t{s.row} * c.num_heads);
      });
    }
    cache_->lookahead(seqs, l, q + row0 * qd, q_len);
  }
}

// Each sequence accepts its prefix of drafts and the target's own token; the accepted drafts'
// K,V join the cache (one batched append per layer for the sequences that accepted as many), the
// draft model's cache and the side buffer.
void batch_engine::commit_round() {
  const model_config& c = m_.config;
  const std::size_t n = round_.size();
  std::vector<std::uint32_t> taken(n);
  std::vector<int> next(n);
  for (std::size_t i = 0; i < n; ++i) {
    sequence& s = *round_[i];
    const acceptance acc = accept_drafts(s.smp, logits_.data() + std::size_t{s.row} * c.vocab_size,
                                         c.vocab_size, s.drafts, &s.logprobs);
    taken[i] = acc.accepted;
    next[i] = acc.next;
    s.length.update(static_cast<std::uint32_t>(s.drafts.size()), acc.accepted);
    record& r = find(s.id, "commit");
    ++r.rep.rounds;
    r.rep.drafted += static_cast<std::uint32_t>(s.drafts.size());
    r.rep.accepted += acc.accepted;
    ++report_.rounds;
    report_.drafted += s.drafts.size();
    report_.accepted += acc.accepted;
  }
  // The sequences by accepted count: each run that accepted a > 0 appends a tokens at once.
  std::vector<std::uint32_t> order(n);
  for (std::uint32_t i = 0; i < n; ++i) {
    order[i] = i;
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](std::uint32_t a, std::uint32_t b) { return taken[a] < taken[b]; });
  std::vector<oasiskv::sequence_id> seqs;
  for (std::uint32_t l = 0; l < c.num_layers; ++l) {
    const float* k = verify_k_[l].data();
    const float* v = verify_v_[l].data();
    for (std::size_t b = 0; b < n;) {
      std::size_t e = b;
      while (e < n && taken[order[e]] == taken[order[b]]) {
        ++e;
      }
      const std::uint32_t a = taken[order[b]];
      if (a > 0) {
        seqs.clear();
        past_k_.clear();
        past_v_.clear();
        for (std::size_t i = b; i < e; ++i) {
          const sequence& s = *round_[order[i]];
          const std::size_t from = (std::size_t{s.row} + 1) * kv_dim_;
          seqs.push_back(s.seq);
          past_k_.insert(past_k_.end(), k + from, k + from + std::size_t{a} * kv_dim_);
          past_v_.insert(past_v_.end(), v + from, v + from + std::size_t{a} * kv_dim_);
        }
        to_f16_bits(past_k_.data(), past_v_.data(), past_k_.size(), k16_, v16_);
        cache_->append(seqs, l, k16_.data(), v16_.data(), a);
      }
      b = e;
    }
    for (std::size_t i = 0; i < n; ++i) {
      sequence& s = *round_[i];
      const std::size_t from = std::size_t{s.row} * kv_dim_;
      if (drafter_) {
        drafter_->append(s.draft_seq, l, k + from, v + from, taken[i] + 1);
      }
      s.side.push(l, k + from, v + from, taken[i] + 1);
    }
  }
  std::vector<int> toks;
  for (std::size_t i = 0; i < n; ++i) {
    sequence& s = *round_[i];
    const std::uint32_t a = taken[i];
    if (o_.draft == draft_kind::ngram) {
      s.history.push_back(s.pending);
      s.history.insert(s.history.end(), s.drafts.begin(), s.drafts.begin() + a);
    }
    s.pos += a + 1;
    toks.assign(s.drafts.begin(), s.drafts.begin() + a);
    toks.push_back(next[i]);
    const std::size_t before = find(s.id, "commit").out.size();
    deliver(s, toks.data(), a + 1, s.logprobs.empty() ? nullptr : s.logprobs.data());
    report_.decode_tokens += find(s.id, "commit").out.size() - before;
    s.pending = next[i];
    if (s.pos + 1 >= ctx_) {
      s.stop = true;  // the context is full (not reached: submit keeps prompt + max within it)
    }
  }
}

// One speculative round for every decoding sequence: drafts, one batched verification over all
// their rows (grouped by row count, each group contiguous), acceptance. Returns the tokens
// delivered.
std::uint32_t batch_engine::decode_step() {
  round_.clear();
  for (sequence& s : active_) {
    if (s.decoding() && !s.stop) {
      round_.push_back(&s);
    }
  }
  if (round_.empty()) {
    return 0;
  }
  const model_config& c = m_.config;
  const auto t0 = clock_type::now();
  const std::uint64_t tokens_before = report_.decode_tokens;
  const auto n = static_cast<std::uint32_t>(round_.size());
  draft_round(o_.step_tokens == 0 ? std::numeric_limits<std::uint32_t>::max()
                                  : std::max(o_.step_tokens, n));
  std::stable_sort(round_.begin(), round_.end(), [](const sequence* a, const sequence* b) {
    return a->drafts.size() < b->drafts.size();
  });
  tokens_.clear();
  positions_.clear();
  seq_ids_.clear();
  groups_.clear();
  for (std::uint32_t i = 0; i < n; ++i) {
    sequence& s = *round_[i];
    if (i == 0 || s.drafts.size() != round_[i - 1]->drafts.size()) {
      groups_.push_back(i);
    }
    s.row = static_cast<std::uint32_t>(tokens_.size());
    seq_ids_.push_back(s.seq);
    tokens_.push_back(s.pending);
    tokens_.insert(tokens_.end(), s.drafts.begin(), s.drafts.end());
    for (std::uint32_t j = 0; j <= s.drafts.size(); ++j) {
      positions_.push_back(s.pos + j);
    }
  }
  groups_.push_back(n);
  const auto rows = static_cast<std::uint32_t>(tokens_.size());
  verify_k_.resize(c.num_layers);
  verify_v_.resize(c.num_layers);
  logits_.resize(std::max(logits_.size(), std::size_t{rows} * c.vocab_size));
  tf_.step_batch(
      tokens_.data(), positions_.data(), rows,
      [this](std::uint32_t l, std::uint32_t count, const float* q, const float* k, const float* v,
             float* out) { verify_layer(l, count, q, k, v, out); },
      logits_.data());
  report_.verify_rows += rows;
  commit_round();
  const double seconds = since(t0);
  const std::uint64_t delivered = report_.decode_tokens - tokens_before;
  report_.decode_seconds += seconds;
  ++report_.steps;
  if (report_.by_decoding.size() <= n) {
    report_.by_decoding.resize(n + 1);
  }
  concurrency_row& row = report_.by_decoding[n];
  ++row.steps;
  row.tokens += delivered;
  row.seconds += seconds;
  return static_cast<std::uint32_t>(delivered);
}

bool batch_engine::step() {
  while (!queue_.empty() && active_.size() < o_.max_batch) {
    const record& r = find(queue_.front(), "step");
    if (fast_used_ + r.need.fast_slots > fast_slots_ ||
        capacity_used_ + r.need.capacity_slots > capacity_slots_) {
      break;  // FIFO: the head waits for memory, the others behind it
    }
    const request_id id = queue_.front();
    queue_.pop_front();
    admit(id);
  }
  report_.peak_active = std::max(report_.peak_active, static_cast<std::uint32_t>(active_.size()));
  const std::uint64_t rows_before = report_.verify_rows;
  decode_step();
  const std::uint64_t rows = report_.verify_rows - rows_before;
  prefill_step(o_.step_tokens > rows ? static_cast<std::uint32_t>(o_.step_tokens - rows) : 0);
  retire_finished();
  report_.cache = cache_->stats();
  return !active_.empty() || !queue_.empty();
}

std::size_t batch_engine::audit() {
  if (cache_->sequences() != active_.size() ||
      (drafter_ && drafter_->sequences() != active_.size())) {
    fail("batch_engine::audit: the cache holds ", cache_->sequences(), " sequences, the engine ",
         active_.size(), " active");
  }
  try {
    return cache_->audit() + (drafter_ ? drafter_->audit() : 0);
  } catch (const oasiskv::error& e) {
    fail("batch_engine::audit: ", e.what());
  }
}

void batch_engine::run() {
  while (step()) {
  }
}

}  // namespace mini_decoder
