// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/kv/shared_cache.hpp>

#include <algorithm>

#include <mini_decoder/io/error.hpp>
#include <mini_decoder/kv/cache_bundles.hpp>

namespace mini_decoder {

namespace {

template <class Bundle>
class shared_cache final : public shared_kv_cache {
 public:
  explicit shared_cache(const shared_cache_config& c)
      : cache_(oasiskv::host_tier(c.layout, c.capacity_slots),
               oasiskv::host_tier(c.layout, c.fast_slots), c.options, {},
               bundles::attention_kernel(c.attention_threads, pool_)) {
    bundles::share_pool_with_predictor(cache_, pool_.get());
  }
  oasiskv::sequence_id add() override { return cache_.add_sequence(); }
  void remove(oasiskv::sequence_id seq) override { cache_.remove(seq); }
  void append(std::span<const oasiskv::sequence_id> seqs, std::uint32_t layer,
              const std::uint16_t* k, const std::uint16_t* v, std::uint32_t n) override {
    cache_.append(seqs, layer, k, v, n);
  }
  void lookahead(std::span<const oasiskv::sequence_id> seqs, std::uint32_t layer, const float* q,
                 std::uint32_t q_len) override {
    cache_.lookahead(seqs, layer, q, q_len);
  }
  void attend(std::span<const oasiskv::sequence_id> seqs, std::uint32_t layer, const float* q,
              std::uint32_t q_len, float* out, float* lse) override {
    cache_.attend(seqs, layer, q, q_len, out, lse);
  }
  void truncate(oasiskv::sequence_id seq, std::uint32_t tokens) override {
    cache_.truncate(seq, tokens);
  }
  void read(oasiskv::sequence_id seq, std::uint32_t layer, std::uint32_t tokens, float* k,
            float* v) override {
    const oasiskv::kv_layout& l = cache_.layout();
    const std::vector<oasiskv::slot_id> slots = cache_.block_slots(seq, layer);
    if (tokens > std::uint64_t{slots.size()} * l.tokens_per_block) {
      fail("shared cache: ", tokens, " tokens read from a layer of ", slots.size(), " blocks");
    }
    // The capacity tier holds every block (the fast tier is a cache of it); its slot of a block
    // is [K, V][kv_heads][tokens_per_block][head_dim] f16.
    const oasiskv::block_pool_view pool = cache_.capacity_tier().view();
    const std::uint32_t hd = l.head_dim, kvd = l.num_kv_heads * hd;
    for (std::uint32_t t0 = 0; t0 < tokens; t0 += l.tokens_per_block) {
      const oasiskv::slot_id s = slots[t0 / l.tokens_per_block];
      const std::uint32_t n = std::min(l.tokens_per_block, tokens - t0);
      for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
        const auto* ks = pool.keys<std::uint16_t>(s, h);
        const auto* vs = pool.values<std::uint16_t>(s, h);
        for (std::uint32_t t = 0; t < n; ++t) {
          float* kd = k + std::size_t{t0 + t} * kvd + std::size_t{h} * hd;
          float* vd = v + std::size_t{t0 + t} * kvd + std::size_t{h} * hd;
          for (std::uint32_t x = 0; x < hd; ++x) {
            kd[x] = oasiskv::f16{ks[std::size_t{t} * hd + x]}.to_float();
            vd[x] = oasiskv::f16{vs[std::size_t{t} * hd + x]}.to_float();
          }
        }
      }
    }
  }
  std::uint32_t length(oasiskv::sequence_id seq, std::uint32_t layer) const override {
    return cache_.length(seq, layer);
  }
  oasiskv::cache_stats stats() const override { return cache_.stats(); }
  std::size_t audit() override { return cache_.audit(); }
  std::size_t sequences() const override { return cache_.num_sequences(); }

 private:
  std::shared_ptr<oasiskv::cpu::thread_pool> pool_;  // the kernel's, when shared; outlives it
  oasiskv::tiered_kv_cache<Bundle> cache_;
};

}  // namespace

std::unique_ptr<shared_kv_cache> make_shared_kv_cache(const shared_cache_config& c) {
  try {
    if (c.mode == attention_mode::dense) {
      return std::make_unique<shared_cache<bundles::dense_bundle>>(c);
    }
    if (c.mode == attention_mode::oasis) {
      return bundles::with_summary(c.summary, [&]<class S>(std::type_identity<S>) {
        return std::unique_ptr<shared_kv_cache>(
            std::make_unique<shared_cache<bundles::oasis_bundle<S>>>(c));
      });
    }
  } catch (const oasiskv::error& e) {
    fail("cannot build the shared ", to_string(c.mode), " KV cache: ", e.what());
  }
  fail("a shared KV cache runs --mode dense or oasis, not ", to_string(c.mode));
}

}  // namespace mini_decoder
