// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/decode/self_draft.hpp>

#include <algorithm>

#include <mini_decoder/decode/sampler.hpp>
#include <mini_decoder/io/error.hpp>

namespace mini_decoder {

self_drafter::self_drafter(const model& m, std::uint32_t layers, std::uint32_t block_tokens,
                           std::uint32_t max_tokens, std::uint64_t slots, float rope_scale,
                           unsigned attention_threads)
    : m_(m),
      layers_(layers),
      kv_dim_(m.config.num_kv_heads * m.config.head_dim),
      tf_(m, rope_scale) {
  const model_config& c = m.config;
  if (layers == 0 || layers >= c.num_layers) {
    fail("--draft-layers = ", layers, " must be in [1, ", c.num_layers - 1, "]");
  }
  shared_cache_config sc;
  sc.mode = attention_mode::dense;
  sc.layout = {layers, c.num_heads, c.num_kv_heads, c.head_dim, block_tokens, oasiskv::dtype::f16};
  try {
    sc.layout.validate();
  } catch (const oasiskv::error& e) {
    fail("bad draft cache layout (--block = ", block_tokens, "): ", e.what());
  }
  // Dense: every block staged and attended; the budget only has to fit in the fast tier.
  const std::uint64_t min_slots = sc.options.sink_blocks + sc.options.recent_blocks + 1;
  slots = std::max(slots, min_slots);
  if (slots > 0xFFFFFFF0u) {
    fail("the draft cache of ", slots, " blocks is more than a tier holds");
  }
  sc.capacity_slots = sc.fast_slots = static_cast<std::uint32_t>(slots);
  sc.options.max_tokens_per_sequence = max_tokens;
  const std::uint64_t budget_blocks = std::max<std::uint64_t>(
      min_slots - 1, std::min<std::uint64_t>(sc.layout.blocks_for(max_tokens), slots - 1));
  sc.options.budget_tokens = static_cast<std::uint32_t>(budget_blocks * block_tokens);
  sc.attention_threads = attention_threads;
  cache_ = make_shared_kv_cache(sc);
}

self_drafter::~self_drafter() = default;

std::uint64_t self_drafter::slots_for(std::uint32_t layers, std::uint32_t block_tokens,
                                      std::uint64_t tokens) {
  return std::uint64_t{layers} * ((tokens + block_tokens - 1) / block_tokens);
}

oasiskv::sequence_id self_drafter::add() {
  return cache_->add();
}

void self_drafter::remove(oasiskv::sequence_id seq) {
  cache_->remove(seq);
}

void self_drafter::append(oasiskv::sequence_id seq, std::uint32_t layer, const float* k,
                          const float* v, std::uint32_t n) {
  if (layer >= layers_ || n == 0) {
    return;
  }
  to_f16_bits(k, v, std::size_t{n} * kv_dim_, k16_, v16_);
  cache_->append(std::span<const oasiskv::sequence_id>(&seq, 1), layer, k16_.data(), v16_.data(),
                 n);
}

void self_drafter::draft(std::span<job> jobs) {
  const model_config& c = m_.config;
  std::uint32_t longest = 0;
  for (job& j : jobs) {
    j.drafts.clear();
    longest = std::max(longest, j.count);
  }
  // Each drafting position appends its row's K,V (one token per sequence: one batched append)
  // and attends the draft cache exactly: the committed tokens and this round's drafts so far.
  const attention_fn attend = [this, &c](std::uint32_t l, std::uint32_t n, const float* q,
                                         const float* k, const float* v, float* out) {
    const std::span<const oasiskv::sequence_id> seqs(seqs_.data(), n);
    to_f16_bits(k, v, std::size_t{n} * kv_dim_, k16_, v16_);
    cache_->append(seqs, l, k16_.data(), v16_.data(), 1);
    lse_.resize(std::size_t{n} * c.num_heads);
    cache_->attend(seqs, l, q, 1, out, lse_.data());
  };
  for (std::uint32_t d = 0; d < longest; ++d) {
    tokens_.clear();
    positions_.clear();
    seqs_.clear();
    rows_.clear();
    for (std::size_t i = 0; i < jobs.size(); ++i) {
      const job& j = jobs[i];
      if (j.count > d) {
        tokens_.push_back(d == 0 ? j.token : j.drafts.back());
        positions_.push_back(j.pos + d);
        seqs_.push_back(j.seq);
        rows_.push_back(i);
      }
    }
    const auto n = static_cast<std::uint32_t>(tokens_.size());
    logits_.resize(std::max(logits_.size(), std::size_t{n} * c.vocab_size));
    tf_.step_batch(tokens_.data(), positions_.data(), n, attend, logits_.data(), layers_);
    for (std::uint32_t r = 0; r < n; ++r) {
      jobs[rows_[r]].drafts.push_back(
          argmax(logits_.data() + std::size_t{r} * c.vocab_size, c.vocab_size));
    }
  }
  for (const job& j : jobs) {
    if (j.count > 0) {
      cache_->truncate(j.seq, j.pos);  // the drafts' K,V: the verification commits its own
    }
  }
}

}  // namespace mini_decoder
