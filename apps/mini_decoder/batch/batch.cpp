// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/batch/batch.hpp>

#include <algorithm>
#include <span>

#include <mini_decoder/io/error.hpp>
#include <mini_decoder/kv/cache_bundles.hpp>

#include "oasiskv/core/dtype.hpp"

namespace mini_decoder {

//! The calls the batched engine makes on its shared cache, one implementation per mode.
class batch_engine::cache {
 public:
  virtual ~cache() = default;
  virtual oasiskv::sequence_id add() = 0;
  virtual void remove(oasiskv::sequence_id seq) = 0;
  //! k, v: [n][kv_heads][head_dim] f16 bit patterns.
  virtual void append(oasiskv::sequence_id seq, std::uint32_t layer, const std::uint16_t* k,
                      const std::uint16_t* v, std::uint32_t n) = 0;
  //! One token per sequence, k, v: [seqs][kv_heads][head_dim] (one batched append).
  virtual void append(std::span<const oasiskv::sequence_id> seqs, std::uint32_t layer,
                      const std::uint16_t* k, const std::uint16_t* v) = 0;
  //! One step's query per sequence, q [seqs][q_heads][head_dim]: predicts each one's next
  //! step's blocks (all of them scored together).
  virtual void lookahead(std::span<const oasiskv::sequence_id> seqs, std::uint32_t layer,
                         const float* q) = 0;
  //! One query per sequence: q, out [seqs][q_heads][head_dim]; lse [seqs][q_heads].
  virtual void attend(std::span<const oasiskv::sequence_id> seqs, std::uint32_t layer,
                      const float* q, float* out, float* lse) = 0;
  virtual oasiskv::cache_stats stats() const = 0;
  virtual std::size_t audit() = 0;
  virtual std::size_t sequences() const = 0;
};

namespace {

using clock_type = std::chrono::steady_clock;
double since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

template <class Bundle>
class shared_cache final : public batch_engine::cache {
 public:
  shared_cache(const oasiskv::kv_layout& l, std::uint32_t slow_slots, std::uint32_t fast_slots,
               oasiskv::cache_options o, unsigned threads)
      : cache_(oasiskv::host_tier(l, slow_slots), oasiskv::host_tier(l, fast_slots), o, {},
               bundles::attention_kernel(threads, pool_)) {
    bundles::share_pool_with_predictor(cache_, pool_.get());
  }
  oasiskv::sequence_id add() override { return cache_.add_sequence(); }
  void remove(oasiskv::sequence_id seq) override { cache_.remove(seq); }
  void append(oasiskv::sequence_id seq, std::uint32_t layer, const std::uint16_t* k,
              const std::uint16_t* v, std::uint32_t n) override {
    cache_.append(seq, layer, k, v, n);
  }
  void append(std::span<const oasiskv::sequence_id> seqs, std::uint32_t layer,
              const std::uint16_t* k, const std::uint16_t* v) override {
    cache_.append(seqs, layer, k, v, 1);
  }
  void lookahead(std::span<const oasiskv::sequence_id> seqs, std::uint32_t layer,
                 const float* q) override {
    cache_.lookahead(seqs, layer, q, 1);
  }
  void attend(std::span<const oasiskv::sequence_id> seqs, std::uint32_t layer, const float* q,
              float* out, float* lse) override {
    cache_.attend(seqs, layer, q, 1, out, lse);
  }
  oasiskv::cache_stats stats() const override { return cache_.stats(); }
  std::size_t audit() override { return cache_.audit(); }
  std::size_t sequences() const override { return cache_.num_sequences(); }

 private:
  std::shared_ptr<oasiskv::cpu::thread_pool> pool_;  // the kernel's, when shared; outlives it
  oasiskv::tiered_kv_cache<Bundle> cache_;
};

}  // namespace

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
  try {
    if (o_.mode == attention_mode::dense) {
      cache_ = std::make_unique<shared_cache<bundles::dense_bundle>>(
          l, static_cast<std::uint32_t>(capacity_slots_),
          static_cast<std::uint32_t>(fast_tier_slots), co, o_.attention_threads);
    } else {
      cache_ = bundles::with_summary(o_.summary, [&]<class S>(std::type_identity<S>) {
        return std::unique_ptr<cache>(std::make_unique<shared_cache<bundles::oasis_bundle<S>>>(
            l, static_cast<std::uint32_t>(capacity_slots_),
            static_cast<std::uint32_t>(fast_tier_slots), co, o_.attention_threads));
      });
    }
  } catch (const oasiskv::error& e) {
    fail("cannot build the batched engine's ", to_string(o_.mode), " KV cache: ", e.what());
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
  r.fast_slots =
      per_layer * m_.config.num_layers + (r.summary_bytes + block_bytes_ - 1) / block_bytes_;
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
    cache_->remove(a->seq);
    fast_used_ -= r.need.fast_slots;
    capacity_used_ -= r.need.capacity_slots;
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

void batch_engine::emit(sequence& s, int tok) {
  record& r = find(s.id, "emit");
  if (s.stop) {
    return;
  }
  if (!r.req.ignore_eos && m_.tok->is_end(tok)) {
    s.stop = true;
    return;
  }
  const auto now = clock_type::now();
  if (r.out.empty()) {
    r.rep.first_token_seconds = std::chrono::duration<double>(now - r.submitted).count();
  } else {
    r.rep.token_seconds.push_back(std::chrono::duration<double>(now - r.last_token).count());
  }
  r.last_token = now;
  r.out.push_back(tok);
  r.rep.generated = static_cast<std::uint32_t>(r.out.size());
  s.pending = tok;
  s.smp.accept(tok);
  if (r.req.on_logprobs && r.req.sampling.logprobs >= 0) {
    r.req.on_logprobs(s.smp.last());
  }
  if ((r.req.on_token && !r.req.on_token(tok)) || r.out.size() >= r.req.max_tokens) {
    s.stop = true;
  }
}

void batch_engine::admit(request_id id) {
  record& r = find(id, "admit");
  const model_config& c = m_.config;
  const auto t0 = clock_type::now();
  r.rep.admitted_seconds = std::chrono::duration<double>(t0 - r.submitted).count();
  const oasiskv::sequence_id seq = cache_->add();
  fast_used_ += r.need.fast_slots;
  capacity_used_ += r.need.capacity_slots;
  const auto P = static_cast<std::uint32_t>(r.req.prompt.size());
  logits_.resize(std::max<std::size_t>(logits_.size(), c.vocab_size));
  try {
    tf_.prefill(
        r.req.prompt.data(), P,
        [&](std::uint32_t l, const float* k, const float* v, std::uint32_t n) {
          to_f16_bits(k, v, std::size_t{n} * kv_dim_, k16_, v16_);
          cache_->append(seq, l, k16_.data(), v16_.data(), n);
        },
        logits_.data());
  } catch (...) {
    cache_->remove(seq);
    fast_used_ -= r.need.fast_slots;
    capacity_used_ -= r.need.capacity_slots;
    r.rep.done = true;
    throw;
  }
  report_.prefill_seconds += since(t0);
  active_.emplace_back(id, seq, r.req);
  sequence& s = active_.back();
  s.pos = P;
  emit(s, s.smp.sample(logits_.data(), c.vocab_size));
}

void batch_engine::retire_finished() {
  for (const sequence& s : active_) {
    if (s.stop) {
      record& r = find(s.id, "retire");
      r.rep.done = true;
      cache_->remove(s.seq);
      fast_used_ -= r.need.fast_slots;
      capacity_used_ -= r.need.capacity_slots;
    }
  }
  active_.erase(
      std::remove_if(active_.begin(), active_.end(), [](const sequence& s) { return s.stop; }),
      active_.end());
}

// One layer of a batched step: every sequence commits its new token's K,V (one batched append),
// then one attend over every active sequence (one query each), then their queries predict their
// next step together.
void batch_engine::attend_layer(std::uint32_t l, std::uint32_t n, const float* q, const float* k,
                                const float* v, float* out) {
  to_f16_bits(k, v, std::size_t{n} * kv_dim_, k16_, v16_);
  const std::span<const oasiskv::sequence_id> seqs(seq_ids_.data(), n);
  cache_->append(seqs, l, k16_.data(), v16_.data());
  const model_config& c = m_.config;
  lse_.resize(std::size_t{n} * c.num_heads);
  cache_->attend(seqs, l, q, out, lse_.data());
  cache_->lookahead(seqs, l, q);
}

void batch_engine::decode_step() {
  const model_config& c = m_.config;
  const auto n = static_cast<std::uint32_t>(active_.size());
  tokens_.resize(n);
  positions_.resize(n);
  seq_ids_.resize(n);
  for (std::uint32_t i = 0; i < n; ++i) {
    tokens_[i] = active_[i].pending;
    positions_[i] = active_[i].pos;
    seq_ids_[i] = active_[i].seq;
  }
  logits_.resize(std::max(logits_.size(), std::size_t{n} * c.vocab_size));
  const auto t0 = clock_type::now();
  tf_.step_batch(
      tokens_.data(), positions_.data(), n,
      [this](std::uint32_t l, std::uint32_t count, const float* q, const float* k, const float* v,
             float* out) { attend_layer(l, count, q, k, v, out); },
      logits_.data());
  for (std::uint32_t i = 0; i < n; ++i) {
    sequence& s = active_[i];
    ++s.pos;
    emit(s, s.smp.sample(logits_.data() + std::size_t{i} * c.vocab_size, c.vocab_size));
    if (s.pos + 1 >= ctx_) {
      s.stop = true;  // the context is full (not reached: submit keeps prompt + max within it)
    }
  }
  report_.decode_seconds += since(t0);
  report_.decode_tokens += n;
  ++report_.steps;
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
  retire_finished();  // those done at their first token
  if (!active_.empty()) {
    decode_step();
    retire_finished();
  }
  report_.cache = cache_->stats();
  return !active_.empty() || !queue_.empty();
}

std::size_t batch_engine::audit() {
  if (cache_->sequences() != active_.size()) {
    fail("batch_engine::audit: the cache holds ", cache_->sequences(), " sequences, the engine ",
         active_.size(), " active");
  }
  try {
    return cache_->audit();
  } catch (const oasiskv::error& e) {
    fail("batch_engine::audit: ", e.what());
  }
}

void batch_engine::run() {
  while (step()) {
  }
}

}  // namespace mini_decoder
