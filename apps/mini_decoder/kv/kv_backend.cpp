// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/kv/kv_backend.hpp>

#include <cstddef>
#include <string>

#include <mini_decoder/io/error.hpp>
#include <mini_decoder/kv/cache_bundles.hpp>

namespace mini_decoder {

namespace {

// Each enumerator's command-line name, in the order help texts list them.
template <class E>
struct named {
  E value;
  const char* name;
};
constexpr named<attention_mode> mode_table[] = {{attention_mode::dense, "dense"},
                                                {attention_mode::oasis, "oasis"},
                                                {attention_mode::quest, "quest"},
                                                {attention_mode::recency, "recency"},
                                                {attention_mode::on_demand, "on-demand"}};
constexpr named<summary_kind> summary_table[] = {
    {summary_kind::int2, "int2"},     {summary_kind::cascade, "cascade"},
    {summary_kind::minmax, "minmax"}, {summary_kind::qminmax, "qminmax"},
    {summary_kind::int8, "int8"},     {summary_kind::int4, "int4"}};

template <class E, std::size_t N>
const char* name_of(const named<E> (&table)[N], E v) {
  for (const auto& e : table) {
    if (e.value == v) {
      return e.name;
    }
  }
  return "?";
}

template <class E, std::size_t N>
std::string joined(const named<E> (&table)[N], const char* sep) {
  std::string s;
  for (const auto& e : table) {
    s += s.empty() ? "" : sep;
    s += e.name;
  }
  return s;
}

template <class E, std::size_t N>
const E* find_named(const named<E> (&table)[N], const std::string& s) {
  for (const auto& e : table) {
    if (s == e.name) {
      return &e.value;
    }
  }
  return nullptr;
}

}  // namespace

const char* to_string(attention_mode m) {
  return name_of(mode_table, m);
}

attention_mode parse_mode(const std::string& s) {
  if (const attention_mode* m = find_named(mode_table, s)) {
    return *m;
  }
  fail("unknown --mode '", s, "' (", joined(mode_table, ", "), ")");
}

const char* to_string(summary_kind k) {
  return name_of(summary_table, k);
}

const char* summary_names() {
  static const std::string names = joined(summary_table, "|");
  return names.c_str();
}

summary_kind parse_summary(const std::string& s) {
  if (const summary_kind* k = find_named(summary_table, s)) {
    return *k;
  }
  fail("unknown --summary '", s, "' (", summary_names(), ")");
}

namespace {

using namespace bundles;

template <class Bundle>
class backend final : public kv_backend {
 public:
  backend(const oasiskv::kv_layout& l, std::uint32_t slow_slots, std::uint32_t fast_slots,
          oasiskv::cache_options o, unsigned threads)
      : cache_(oasiskv::host_tier(l, slow_slots), oasiskv::host_tier(l, fast_slots), o, {},
               attention_kernel(threads, pool_)),
        seq_(cache_.add_sequence()),
        fast_slots_(fast_slots),
        slow_slots_(slow_slots) {
    share_pool_with_predictor(cache_, pool_.get());
  }

  void append(std::uint32_t layer, const std::uint16_t* k, const std::uint16_t* v,
              std::uint32_t n) override {
    cache_.append(seq_, layer, k, v, n);
  }
  void lookahead(std::uint32_t layer, const float* q, std::uint32_t n) override {
    cache_.lookahead(seq_, layer, oasiskv::query_view{q, nullptr, n});
  }
  void attend(std::uint32_t layer, const float* q, std::uint32_t q_len, float* out, float* lse,
              oasiskv::attended_blocks* attended) override {
    cache_.attend(std::span<const oasiskv::sequence_id>(&seq_, 1), layer, q, q_len, out, lse,
                  attended);
  }
  std::uint32_t length(std::uint32_t layer) const override { return cache_.length(seq_, layer); }
  oasiskv::cache_stats stats() const override { return cache_.stats(); }
  const oasiskv::kv_layout& layout() const override { return cache_.layout(); }
  std::uint64_t fast_tier_bytes() const override {
    return std::uint64_t{fast_slots_} * cache_.layout().block_bytes();
  }
  std::uint64_t capacity_tier_bytes() const override {
    return std::uint64_t{slow_slots_} * cache_.layout().block_bytes();
  }
  std::uint64_t summary_bytes() const override { return cache_.summary_bytes(); }
  std::uint32_t budget_tokens() const override { return cache_.options().budget_tokens; }

 private:
  std::shared_ptr<oasiskv::cpu::thread_pool> pool_;  // the kernel's, when shared; outlives it
  oasiskv::tiered_kv_cache<Bundle> cache_;
  oasiskv::sequence_id seq_;
  std::uint32_t fast_slots_, slow_slots_;
};

}  // namespace

std::unique_ptr<kv_backend> make_kv_backend(const cache_config& c) {
  const oasiskv::kv_layout l{c.num_layers, c.num_q_heads,  c.num_kv_heads,
                             c.head_dim,   c.block_tokens, oasiskv::dtype::f16};
  try {
    l.validate();
  } catch (const oasiskv::error& e) {
    fail("bad cache layout (--block = ", c.block_tokens, "): ", e.what());
  }
  const std::uint32_t blocks = l.blocks_for(c.max_tokens);
  const std::uint32_t slow_slots = c.num_layers * (blocks + 1);
  oasiskv::cache_options o;
  o.max_tokens_per_sequence = c.max_tokens;
  if (c.mode == attention_mode::dense) {
    o.budget_tokens = blocks * c.block_tokens;
    return std::make_unique<backend<dense_bundle>>(l, slow_slots, slow_slots, o,
                                                   c.attention_threads);
  }
  o.budget_tokens = c.budget_tokens;
  const std::uint32_t budget_blocks = l.blocks_for(c.budget_tokens);
  if (c.budget_tokens == 0 || budget_blocks < o.sink_blocks + o.recent_blocks) {
    fail("--budget = ", c.budget_tokens, " tokens is below the minimum of ",
         (o.sink_blocks + o.recent_blocks) * c.block_tokens, " (", o.sink_blocks, " sink + ",
         o.recent_blocks, " recent blocks of ", c.block_tokens, " tokens)");
  }
  // Per layer, the selection being attended and the next one being prefetched (they differ by
  // a few blocks) plus the sinks and window a lookahead adds: double-buffered, as
  // `admission()` counts it. With only one selection per layer, LRU eviction thrashes: the
  // layers are visited cyclically, so the least recently used blocks are exactly the next
  // layer's prefetched ones (measured: 0.6% hits at 4k context, budget 1024).
  const std::uint32_t fast_slots =
      std::min(slow_slots, c.num_layers * (2 * std::min(budget_blocks, blocks) + 4));
  try {
    switch (c.mode) {
      case attention_mode::oasis:
        return with_summary(c.summary, [&]<class S>(std::type_identity<S>) {
          return std::unique_ptr<kv_backend>(std::make_unique<backend<oasis_bundle<S>>>(
              l, slow_slots, fast_slots, o, c.attention_threads));
        });
      case attention_mode::quest:
        return std::make_unique<backend<quest_bundle>>(l, slow_slots, fast_slots, o,
                                                       c.attention_threads);
      case attention_mode::recency:
        return std::make_unique<backend<recency_bundle>>(l, slow_slots, fast_slots, o,
                                                         c.attention_threads);
      case attention_mode::on_demand:
        return with_summary(c.summary, [&]<class S>(std::type_identity<S>) {
          return std::unique_ptr<kv_backend>(std::make_unique<backend<on_demand_bundle<S>>>(
              l, slow_slots, fast_slots, o, c.attention_threads));
        });
      default:
        break;
    }
  } catch (const oasiskv::error& e) {
    fail("cannot build the ", to_string(c.mode), " KV cache: ", e.what());
  }
  fail("unknown attention mode");
}

}  // namespace mini_decoder
