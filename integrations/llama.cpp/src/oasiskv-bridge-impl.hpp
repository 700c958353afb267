// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cache_impl<Slow, Summary>`: oasiskv-bridge.h's class over one `tiered_kv_cache`
//! bundle. Instantiated per capacity tier in oasiskv-bridge-host.cpp and oasiskv-bridge-file.cpp.
#pragma once

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "oasiskv-bridge.h"
#include "oasiskv/oasiskv.hpp"

namespace oasiskv_bridge::detail {

//! @brief `cpu::sparse_decode` over the engine's threads: each table's blocks are cut into one
//! range per thread of the current `team`, each range attended on its thread by the
//! single-threaded kernel, and the partial results merged by log-sum-exp (exact up to f32
//! rounding). Without a team, or for tables too short to share, the caller runs the kernel
//! alone. The engine's threads do the work, so no thread of OasisKV's own competes with them.
//! @brief A `team` as the `cpu::loop_runner` a predictor scores on.
class team_runner final : public oasiskv::cpu::loop_runner {
 public:
  explicit team_runner(team& t) : team_(&t) {}
  unsigned size() const noexcept override { return team_->size(); }
  void run(std::size_t n, void (*fn)(void* ctx, std::size_t i), void* ctx) override {
    team_->run(n, fn, ctx);
  }

 private:
  team* team_;
};

class team_decode {
 public:
  //! @brief The fewest blocks a thread's range of one table holds.
  static constexpr std::uint32_t min_part_blocks = 4;

  team_decode() = default;
  //! @brief `*current` is the team of the call in progress, or null.
  explicit team_decode(team* const* current) : current_(current) {}

  void decode(const oasiskv::decode_params& p) {
    team* t = current_ != nullptr ? *current_ : nullptr;
    const std::uint32_t tables = p.table.num_seqs * p.table.tables_per_seq;
    std::uint32_t shortest = ~std::uint32_t{0};
    for (std::uint32_t i = 0; i < tables; ++i) {
      shortest = std::min(shortest, p.table.size(i));
    }
    const std::uint32_t k =
        t == nullptr ? 1u : std::min<std::uint32_t>(t->size(), shortest / min_part_blocks);
    if (k <= 1) {
      kernel_.decode(p);
      return;
    }
    const std::size_t rows = std::size_t{p.num_seqs} * p.q_len * p.pool.layout.num_q_heads;
    const std::uint32_t d = p.pool.layout.head_dim;
    parts_.resize(k);
    for (std::uint32_t j = 0; j < k; ++j) {
      part& pt = parts_[j];
      pt.refs.clear();
      pt.offsets.assign(1, 0);
      for (std::uint32_t i = 0; i < tables; ++i) {
        const std::uint32_t n = p.table.size(i);
        const oasiskv::block_ref* r = p.table.begin(i);
        pt.refs.insert(pt.refs.end(), r + std::uint64_t{n} * j / k,
                       r + std::uint64_t{n} * (j + 1) / k);
        pt.offsets.push_back(static_cast<std::uint32_t>(pt.refs.size()));
      }
      pt.out.resize(rows * d);
      pt.lse.resize(rows);
      pt.p = p;
      pt.p.table.refs = pt.refs.data();
      pt.p.table.offsets = pt.offsets.data();
      pt.p.out = pt.out.data();
      pt.p.lse = pt.lse.data();
    }
    t->run(
        k,
        [](void* ctx, std::size_t j) {
          auto* self = static_cast<team_decode*>(ctx);
          self->kernel_.decode(self->parts_[j].p);
        },
        this);
    part& acc = parts_[0];
    for (std::uint32_t j = 1; j < k; ++j) {
      oasiskv::cpu::merge_partial(acc.out.data(), acc.lse.data(), parts_[j].out.data(),
                                  parts_[j].lse.data(), rows, d);
    }
    std::copy(acc.out.begin(), acc.out.end(), p.out);
    if (p.lse != nullptr) {
      std::copy(acc.lse.begin(), acc.lse.end(), p.lse);
    }
  }

 private:
  struct part {
    std::vector<oasiskv::block_ref> refs;
    std::vector<std::uint32_t> offsets;
    std::vector<float> out, lse;
    oasiskv::decode_params p;
  };
  oasiskv::cpu::sparse_decode kernel_{1u};  // one thread: the team is the parallelism
  team* const* current_ = nullptr;
  std::vector<part> parts_;  // per range; one call at a time (the cache's attend per layer)
};

// Host staging pool, CPU copies and the kernel above; lookahead prediction through `Summary`,
// staged ahead of attention (the bundle the mini-decoder's oasis mode runs).
template <class Slow, class Summary>
struct bundle {
  using allocator = oasiskv::free_list_allocator;
  using fast_tier = oasiskv::host_tier;
  using slow_tier = Slow;
  using transfer = oasiskv::cpu_copy_engine;
  using predictor = oasiskv::lookahead_predictor<Summary>;
  using scheduler = oasiskv::lookahead_prefetcher<>;
  using kernel = team_decode;
};

inline oasiskv::sequence_id id(seq_t s) noexcept {
  return static_cast<oasiskv::sequence_id>(s);
}
inline seq_t handle(oasiskv::sequence_id s) noexcept {
  return static_cast<seq_t>(s);
}

template <class Slow, class Summary>
class cache_impl final : public cache {
  using cache_type = oasiskv::tiered_kv_cache<bundle<Slow, Summary>>;
  static constexpr bool file_capacity = std::is_same_v<Slow, oasiskv::file_tier>;

 public:
  cache_impl(const cache_config& c, const oasiskv::kv_layout& l, Slow slow,
             std::uint32_t fast_slots, const oasiskv::cache_options& o)
      : config_(c),
        cache_(std::move(slow), oasiskv::host_tier(l, fast_slots), o, {}, team_decode(&team_)),
        fast_slots_(fast_slots),
        fast_slot_bytes_(cache_.fast_tier().slot_bytes()) {}

  seq_t add_sequence() override { return keep(cache_.add_sequence()); }
  seq_t fork(seq_t parent, std::uint32_t tokens) override {
    return keep(cache_.fork(id(parent), tokens));
  }
  void truncate(seq_t s, std::uint32_t tokens) override { cache_.truncate(id(s), tokens); }
  void remove(seq_t s) override {
    cache_.remove(id(s));
    live_.erase(std::find(live_.begin(), live_.end(), s));
  }
  std::uint32_t length(seq_t s, std::uint32_t layer) const override {
    return cache_.length(id(s), layer);
  }
  bool same_blocks(seq_t a, seq_t b) const override {
    for (std::uint32_t l = 0; l < cache_.layout().num_layers; ++l) {
      if (cache_.block_slots(id(a), l) != cache_.block_slots(id(b), l)) {
        return false;
      }
    }
    return true;
  }

  void append(const seq_t* seqs, std::uint32_t n_seqs, std::uint32_t layer, const void* k,
              const void* v, std::uint32_t n) override {
    cache_.append(ids(seqs, n_seqs), layer, k, v, n);
  }
  void lookahead(const seq_t* seqs, std::uint32_t n_seqs, std::uint32_t layer, const float* q,
                 std::uint32_t q_len, team* t) override {
    // The predictor scores on the engine's threads of this operation, lent for the call.
    std::optional<team_runner> runner;
    if (t != nullptr && t->size() > 1) {
      runner.emplace(*t);
    }
    struct lend {
      typename bundle<Slow, Summary>::predictor& p;
      ~lend() { p.set_thread_pool(nullptr); }
    } lent{cache_.predictor()};
    lent.p.set_thread_pool(runner ? &*runner : nullptr);
    cache_.lookahead(ids(seqs, n_seqs), layer, q, q_len);
  }
  void attend(const seq_t* seqs, std::uint32_t n_seqs, std::uint32_t layer, const float* q,
              std::uint32_t q_len, float* out, team* t) override {
    team_ = t;
    try {
      cache_.attend(ids(seqs, n_seqs), layer, q, q_len, out);
    } catch (...) {
      team_ = nullptr;
      throw;
    }
    team_ = nullptr;
  }

  void read(seq_t s, std::uint32_t layer, std::uint32_t first, std::uint32_t n, void* k,
            std::size_t k_token, std::size_t k_elem, void* v, std::size_t v_token,
            std::size_t v_elem) override {
    const oasiskv::kv_layout& l = cache_.layout();
    const std::uint32_t tpb = l.tokens_per_block, heads = l.num_kv_heads, d = l.head_dim;
    const std::size_t es = oasiskv::dtype_size(l.kv_dtype), row = std::size_t{d} * es;
    if (first % tpb != 0) {
      throw std::invalid_argument("oasiskv bridge: read from token " + std::to_string(first) +
                                  ", not a block boundary");
    }
    const std::vector<oasiskv::slot_id> slots = cache_.block_slots(id(s), layer);
    thread_local std::vector<std::byte> buffer;
    for (std::uint32_t t0 = first; t0 < first + n; t0 += tpb) {
      const std::uint32_t b = t0 / tpb, count = std::min(tpb, first + n - t0);
      if (b >= slots.size()) {
        throw std::out_of_range("oasiskv bridge: read of token " + std::to_string(t0) +
                                " past the end of the sequence");
      }
      const std::byte* block = nullptr;
      if constexpr (file_capacity) {
        buffer.resize(l.block_bytes());
        cache_.capacity_tier().read_block(slots[b], buffer.data());
        block = buffer.data();
      } else {
        block = cache_.capacity_tier().slot_data(slots[b]);
      }
      // A block is [2 (K, V)][kv_heads][tokens_per_block][head_dim].
      for (std::uint32_t kv = 0; kv < 2; ++kv) {
        auto* dst = static_cast<std::byte*>(kv == 0 ? k : v);
        const std::size_t tstride = kv == 0 ? k_token : v_token;
        const std::size_t estride = kv == 0 ? k_elem : v_elem;
        for (std::uint32_t h = 0; h < heads; ++h) {
          const std::byte* src = block + (std::size_t{kv} * heads + h) * tpb * row;
          for (std::uint32_t t = 0; t < count; ++t) {
            std::byte* out =
                dst + std::size_t{t0 - first + t} * tstride + std::size_t{h} * d * estride;
            if (estride == es) {
              std::memcpy(out, src + std::size_t{t} * row, row);
            } else {
              for (std::uint32_t e = 0; e < d; ++e) {
                std::memcpy(out + e * estride, src + std::size_t{t} * row + e * es, es);
              }
            }
          }
        }
      }
    }
  }

  cache_report report() const override {
    const oasiskv::cache_stats s = cache_.stats();
    cache_report r;
    r.steps = s.sequence_steps;
    r.lookaheads = s.lookaheads;
    r.unpredicted = s.unpredicted;
    r.hits = s.step.hits;
    r.misses = s.step.misses;
    r.predict_seconds = s.predict_seconds;
    r.fast_bytes = std::uint64_t{fast_slots_} * fast_slot_bytes_;
    r.capacity_in_memory = !file_capacity;
    r.summary_bytes = cache_.summary_bytes();
    r.capacity_bytes_in_use = std::uint64_t{slots_in_use()} * cache_.layout().block_bytes();
    return r;
  }
  const cache_config& config() const override { return config_; }

 private:
  seq_t keep(oasiskv::sequence_id s) {
    live_.push_back(handle(s));
    return live_.back();
  }
  std::span<const oasiskv::sequence_id> ids(const seq_t* seqs, std::uint32_t n) {
    ids_.resize(n);
    std::transform(seqs, seqs + n, ids_.begin(), id);
    return ids_;
  }
  // Distinct capacity slots the sequences hold (forks share theirs).
  std::size_t slots_in_use() const {
    std::vector<oasiskv::slot_id> all;
    for (const seq_t s : live_) {
      for (std::uint32_t l = 0; l < cache_.layout().num_layers; ++l) {
        const auto b = cache_.block_slots(id(s), l);
        all.insert(all.end(), b.begin(), b.end());
      }
    }
    std::sort(all.begin(), all.end());
    return static_cast<std::size_t>(std::unique(all.begin(), all.end()) - all.begin());
  }

  cache_config config_;
  team* team_ = nullptr;  // of the attend in progress, which the kernel reads
  cache_type cache_;
  std::uint32_t fast_slots_;
  std::size_t fast_slot_bytes_;
  std::vector<oasiskv::sequence_id> ids_;  // scratch of the batched calls (one caller at a time)
  std::vector<seq_t> live_;                // the sequences held, for `report`
};

//! @brief The cache of `c` over capacity tier `slow`, the summary named in `c`; null for an
//! unknown summary name.
// Each summary's name, in the order the help text lists them (the first is the default).
template <class F>
inline bool with_summary(std::string_view name, F&& f) {
  if (name == "int2") {
    f(std::type_identity<oasiskv::qminmax_int2_summary>{});
  } else if (name == "cascade") {
    f(std::type_identity<oasiskv::qminmax_int4_cascade>{});
  } else if (name == "minmax") {
    f(std::type_identity<oasiskv::minmax_summary<>>{});
  } else if (name == "qminmax") {
    f(std::type_identity<oasiskv::quantized_minmax_summary>{});
  } else if (name == "int8") {
    f(std::type_identity<oasiskv::int8_key_summary>{});
  } else if (name == "int4") {
    f(std::type_identity<oasiskv::int4_key_summary>{});
  } else {
    return false;
  }
  return true;
}

template <class Slow>
std::unique_ptr<cache> make_cache(const cache_config& c, const oasiskv::kv_layout& l, Slow slow,
                                  std::uint32_t fast_slots, const oasiskv::cache_options& o) {
  std::unique_ptr<cache> made;
  with_summary(c.summary, [&]<class S>(std::type_identity<S>) {
    made = std::make_unique<cache_impl<Slow, S>>(c, l, std::move(slow), fast_slots, o);
  });
  return made;
}

std::unique_ptr<cache> make_host_cache(const cache_config& c, const oasiskv::kv_layout& l,
                                       std::uint32_t slow_slots, std::uint32_t fast_slots,
                                       const oasiskv::cache_options& o);
std::unique_ptr<cache> make_file_cache(const cache_config& c, const oasiskv::kv_layout& l,
                                       std::uint32_t slow_slots, std::uint32_t fast_slots,
                                       const oasiskv::cache_options& o);

}  // namespace oasiskv_bridge::detail
