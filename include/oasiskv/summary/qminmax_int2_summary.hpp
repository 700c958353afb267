// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `qminmax_int2_summary`: int8 min/max bounds per block, and a 2-bit code of every key
//! element between its block's bounds; the bounds pick a budget's contenders, the codes score
//! them. Under 10% of the KV bytes at 16-token blocks, head_dim 64, f16.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/layout.hpp"
#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/summary/cascade_summary.hpp"
#include "oasiskv/summary/cpu/int2_codes.hpp"
#include "oasiskv/summary/quantized_minmax_summary.hpp"
#include "oasiskv/summary/summary_checks.hpp"

namespace oasiskv {

//! @brief A two-stage summary in one store: `quantized_minmax_summary`'s int8 bounds of each
//! block (Quest), and per key element a 2-bit code `u` in [0, 3] that places it between its
//! dimension's bounds, `k'_x = lo_x + u (hi_x - lo_x) / 3` (per-channel quantization against the
//! block's own range, as KIVI quantizes keys). The bounds cost nothing extra: they are the
//! first stage's data and the codes' scale at once.
//!
//! `score_two_stage` (`two_stage_summary`) ranks every block by its bound, keeps the
//! `contenders(blocks, budget_blocks)` = `min(blocks, ceil(contender_factor x budget_blocks))`
//! highest (as `cascade_summary`), and scores those from their codes: the max of the dequantized
//! dot products, or for softmax-mass aggregation the block's log-sum-exp of them
//! (`score_log_mass`); the others score `-inf`. `score` / `score_log_mass` score every block from
//! its codes.
//!
//! Codes are relative to the bounds, which grow while a block fills. A block is therefore coded
//! when it holds `tokens_per_block` tokens (a bulk update of a whole block codes it at once);
//! until then the keys of its tokens are kept in f32 beside the store and scored exactly. In the
//! facade that is the one block per layer and sequence still being appended to. Folding tokens
//! into a full entry again (replacing them) codes them against the bounds after the update; where
//! those bounds widened, the entry's other tokens are re-coded from their dequantized values
//! (they stay within the bounds, off by up to one code step more). A key with a non-finite
//! element makes every score of its entry `+inf` (never NaN); an entry with no tokens scores
//! `-inf`.
//!
//! Models `block_summary`, `two_stage_summary`, `log_mass_summary` and `growable_summary`.
//! Memory per entry: the bounds' (`num_kv_heads * (2 * head_dim + 8) + 6` bytes) plus
//! `num_kv_heads * head_dim * tp / 4` bytes of codes (`tp` = `tokens_per_block` rounded up to 16)
//! and 3 bytes (token count, flag): 9.6% of the KV bytes for 16-token blocks, head_dim 64, f16
//! K+V (bounds 3.3%, codes 6.25%); plus, for each entry not yet full, `num_kv_heads *
//! tokens_per_block * head_dim` f32 keys. Scoring paths: `cpu_isa::avx512_vnni` (what `best` and
//! `avx512` resolve to on a CPU with AVX512_VNNI) scores whole entries of up to 16 tokens (head_dim
//! a multiple of 32, at most 256) with 8-bit integer products (`vpdpbusd`): each query row is
//! rounded to `alpha Q` with int8 `Q` once per call, and each code's offset from the lower bound to
//! whole int8 steps of the bounds' scale `s`, which together move a score by at most `alpha / 2 *
//! sum_x |k'_x| + s / 3 * (sum_x |q_x| + head_dim * alpha / 2)`, far below the codes' own error;
//! other entries, and AVX-512 without VNNI, take an
//! f32 AVX-512 kernel (16 tokens x up to 12 rows per pass); both end in one vector epilogue for all
//! rows (the polynomial `exp` and `log`). Every other path takes the portable kernel (f32 products,
//! `std::exp`). Concurrent scoring calls are safe;
//! `update`, `reset` and `grow` need exclusive access.
class qminmax_int2_summary {
  static constexpr std::uint32_t lanes = cpu::detail::int2_lanes;
  static constexpr const char* name = "qminmax_int2_summary";

 public:
  //! @brief Entries one pass over a tile of the bounds scores (`summary_tile_entries`).
  static constexpr std::uint32_t entries_per_tile = quantized_minmax_summary::entries_per_tile;

  //! @brief `capacity` empty entries of `layout`, scored on path `isa`.
  //! `errc::invalid_argument` naming `params.contender_factor` unless it is finite and >= 1, or
  //! for a capacity of 0.
  qminmax_int2_summary(const kv_layout& layout, std::uint32_t capacity, cascade_params params = {},
                       cpu_isa isa = cpu_isa::best)
      : params_(detail::checked_cascade_params(params)),
        layout_(layout),
        bounds_(layout, capacity, isa),
        capacity_(capacity) {
    set_isa(isa);
    groups_ = (layout_.tokens_per_block + lanes - 1) / lanes;
    words_ = std::size_t{layout_.head_dim} * groups_;
    codes_.assign(std::size_t{layout_.num_kv_heads} * capacity_ * words_, 0u);
    tokens_.assign(capacity_, 0);
    bad_.assign(capacity_, 0);
  }

  //! @brief The number of entries.
  std::uint32_t capacity() const noexcept { return capacity_; }
  //! @brief The layout the entries describe.
  const kv_layout& layout() const noexcept { return layout_; }
  //! @brief The contender factor in use.
  const cascade_params& params() const noexcept { return params_; }
  //! @brief The first stage: the blocks' int8 bounds.
  const quantized_minmax_summary& bounds() const noexcept { return bounds_; }
  //! @brief The scoring path in use.
  cpu_isa isa() const noexcept { return isa_; }
  //! @brief Chooses the scoring path (the bounds' and the codes'); `errc::unsupported` if it
  //! cannot run.
  void set_isa(cpu_isa isa) {
    bounds_.set_isa(isa);
    isa_ = resolve_isa(isa, cpu_isa::avx512_vnni);
  }

  //! @brief How many of `blocks` entries the first stage keeps for a budget of `keep_blocks`:
  //! `min(blocks, ceil(contender_factor x keep_blocks))`.
  std::uint32_t contenders(std::uint32_t blocks, std::uint32_t keep_blocks) const noexcept {
    return params_.contenders(blocks, keep_blocks);
  }

  //! @brief Fast-tier bytes of one entry: bounds, codes, token count and flag.
  std::size_t bytes_per_block() const noexcept {
    return bounds_.bytes_per_block() + std::size_t{layout_.num_kv_heads} * words_ * 4 +
           sizeof(std::uint16_t) + 1;
  }

  //! @brief How many distinct tokens entry `b` holds.
  std::uint32_t tokens(std::uint32_t b) const {
    check_entry(b);
    return tokens_[b];
  }

  //! @brief Whether entry `b` holds a whole block and is scored from its codes.
  bool coded(std::uint32_t b) const {
    check_entry(b);
    return tokens_[b] == layout_.tokens_per_block;
  }

  //! @brief Capacity becomes `capacity`: entries keep their state, the new ones start empty
  //! (models `growable_summary`). `errc::invalid_argument` below the current capacity.
  void grow(std::uint32_t capacity) {
    detail::check_summary_grow(name, capacity_, capacity);
    auto codes = detail::regrow_parts(codes_, layout_.num_kv_heads, capacity_ * words_,
                                      capacity * words_, std::uint32_t{0});
    auto tokens = detail::regrow(tokens_, capacity, std::uint16_t{0});
    auto bad = detail::regrow(bad_, capacity, std::uint8_t{0});
    bounds_.grow(capacity);
    codes_ = std::move(codes);
    tokens_ = std::move(tokens);
    bad_ = std::move(bad);
    capacity_ = capacity;
  }

  //! @brief Entry `b` describes an empty block.
  void reset(std::uint32_t b) {
    check_entry(b);
    bounds_.reset(b);
    for (std::uint32_t h = 0; h < layout_.num_kv_heads; ++h) {
      std::fill_n(codes_of(h, b), words_, 0u);
    }
    open_.erase(b);
    tokens_[b] = 0;
    bad_[b] = 0;
  }

  //! @brief Folds tokens `[first, first + count)` of the slot at `block` into entry `b`
  //! (replacing those tokens if they were folded in before); codes the entry once it holds a
  //! whole block.
  void update(std::uint32_t b, const std::byte* block, std::uint32_t first, std::uint32_t count) {
    check_entry(b);
    if (count == 0) {
      return;
    }
    detail::check_summary_update(name, layout_, block, first, count);
    const std::uint32_t d = layout_.head_dim, heads = layout_.num_kv_heads,
                        tpb = layout_.tokens_per_block;
    // The new keys in f32, [heads][count][d], read before anything changes.
    thread_local std::vector<float> fresh;
    fresh.resize(std::size_t{heads} * count * d);
    bool finite = true;
    visit_dtype(layout_.kv_dtype, [&](auto elem) {
      using T = decltype(elem);
      for (std::uint32_t h = 0; h < heads; ++h) {
        const T* keys =
            reinterpret_cast<const T*>(block + layout_.key_offset(h)) + std::size_t{first} * d;
        float* to = fresh.data() + std::size_t{h} * count * d;
        for (std::size_t i = 0; i < std::size_t{count} * d; ++i) {
          to[i] = to_float(keys[i]);
          finite = finite && std::isfinite(to[i]);
        }
      }
    });
    if (tokens_[b] == tpb) {
      update_coded(b, block, first, count, fresh.data());
    } else {
      update_open(b, block, first, count, fresh.data());
    }
    bad_[b] = static_cast<std::uint8_t>(bad_[b] | (finite ? 0u : 1u));
  }

  //! @brief The key of token `t` of entry `b`, KV head `h`, as the entry scores it (`head_dim`
  //! floats): dequantized from its codes once the entry is coded, else the key itself; zeros for
  //! a token not folded in.
  std::vector<float> dequantized(std::uint32_t h, std::uint32_t b, std::uint32_t t) const {
    check_entry(b);
    const std::uint32_t d = layout_.head_dim;
    if (h >= layout_.num_kv_heads || t >= layout_.tokens_per_block) [[unlikely]] {
      detail::raise(errc::out_of_range, name, "::dequantized: kv head ", h, " or token ", t,
                    " out of range");
    }
    std::vector<float> k(d, 0.0f);
    if (tokens_[b] == layout_.tokens_per_block) {
      std::vector<float> lo(d), step(d);
      range(h, b, lo.data(), step.data());
      for (std::uint32_t x = 0; x < d; ++x) {
        k[x] = cpu::detail::int2_value(lo[x], step[x],
                                       cpu::detail::int2_code(codes_of(h, b), groups_, x, t));
      }
    } else if (const auto it = open_.find(b); it != open_.end() && it->second.present[t]) {
      std::copy_n(it->second.key(h, t, layout_), d, k.data());
    }
    return k;
  }

  //! @brief `out[i * n + r]` = `max_t dot(q_r, k'_t)` over the keys `k'_t` of KV head `h` in
  //! entry `entries[i]` as `dequantized` gives them; `-inf` for an empty entry, `+inf` for one
  //! holding a non-finite key.
  void score(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
             std::uint32_t n, float* out) const {
    run(h, entries, q, n, 0.0f, out, "score");
  }

  //! @brief `out[i * n + r]` = `log(sum_t exp(scale * dot(q_r, k'_t))) / scale` over the same
  //! keys: the block's log-sum-exp of attention logits at logit scale `scale`, in the units of
  //! `score` (see `quantized_key_summary::score_log_mass`). `scale` must be finite and > 0.
  void score_log_mass(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
                      std::uint32_t n, float scale, float* out) const {
    if (!(scale > 0.0f) || !std::isfinite(scale)) [[unlikely]] {
      detail::raise(errc::invalid_argument, name, "::score_log_mass: scale = ", scale,
                    " must be finite and > 0");
    }
    run(h, entries, q, n, scale, out, "score_log_mass");
  }

  //! @brief The two-stage scores (`two_stage_summary`): `out[i * n + r]` is `score` (`scale ==
  //! 0`) or `score_log_mass` (`scale > 0`) of `entries[i]` if its bound ranks among the
  //! `contenders(entries.size(), keep_blocks)` highest (the maximum over the rows, NaN as `+inf`,
  //! ties to the earlier entry), else `-inf`. `errc::invalid_argument` naming `scale` unless it is
  //! finite and >= 0.
  void score_two_stage(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
                       std::uint32_t n, float scale, std::uint32_t keep_blocks, float* out) const {
    if (!(scale >= 0.0f) || !std::isfinite(scale)) [[unlikely]] {
      detail::raise(errc::invalid_argument, name, "::score_two_stage: scale = ", scale,
                    " must be finite and >= 0");
    }
    const auto m = static_cast<std::uint32_t>(entries.size());
    const std::uint32_t c = contenders(m, keep_blocks);
    if (c >= m || m == 0 || n == 0) {
      run(h, entries, q, n, scale, out, "score_two_stage");
      return;
    }
    if (q == nullptr || out == nullptr) [[unlikely]] {
      detail::raise(errc::invalid_argument, name, "::score_two_stage: null query or output");
    }
    std::fill(out, out + std::size_t{m} * n, -std::numeric_limits<float>::infinity());
    if (c == 0) {
      return;
    }
    thread_local detail::contender_scratch pick;
    thread_local std::vector<float> fine;
    detail::pick_contenders(bounds_, isa_, h, entries, q, n, c, pick);
    fine.resize(pick.ids.size() * n);
    run(h, pick.ids, q, n, scale, fine.data(), "score_two_stage");
    for (std::size_t j = 0; j < pick.picked.size(); ++j) {
      std::copy_n(fine.data() + j * n, n, out + std::size_t{pick.picked[j]} * n);
    }
  }

  //! @brief Stage 1 alone (`split_two_stage_summary`): `bound[i]` is the int8 bound of
  //! `entries[i]` folded over the `n` rows (the maximum; NaN as `+inf`).
  void score_bounds(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
                    std::uint32_t n, float* bound) const {
    if (entries.empty() || n == 0) {
      return;
    }
    if (q == nullptr || bound == nullptr) [[unlikely]] {
      detail::raise(errc::invalid_argument, name, "::score_bounds: null query or output");
    }
    thread_local std::vector<float> scores;
    detail::contender_bounds(bounds_, h, entries, q, n, scores, bound);
  }

  //! @brief Stage 2 alone (`split_two_stage_summary`): the codes' scores of `entries`, `score`
  //! (`scale == 0`) or `score_log_mass` (`scale > 0`). `errc::invalid_argument` naming `scale`
  //! unless it is finite and >= 0.
  void score_fine(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
                  std::uint32_t n, float scale, float* out) const {
    if (!(scale >= 0.0f) || !std::isfinite(scale)) [[unlikely]] {
      detail::raise(errc::invalid_argument, name, "::score_fine: scale = ", scale,
                    " must be finite and >= 0");
    }
    run(h, entries, q, n, scale, out, "score_fine");
  }

 private:
  // The keys of an entry not yet full: [heads][tokens_per_block][head_dim] f32, and which
  // tokens are present.
  struct open_entry {
    std::vector<float> keys;
    std::vector<std::uint8_t> present;
    const float* key(std::uint32_t h, std::uint32_t t, const kv_layout& l) const noexcept {
      return keys.data() + (std::size_t{h} * l.tokens_per_block + t) * l.head_dim;
    }
    float* key(std::uint32_t h, std::uint32_t t, const kv_layout& l) noexcept {
      return keys.data() + (std::size_t{h} * l.tokens_per_block + t) * l.head_dim;
    }
  };

  // Tokens into an entry not yet full: kept as keys, coded once the block is whole. What can
  // throw (a new entry's allocation, the bounds' update) runs before the entry changes.
  void update_open(std::uint32_t b, const std::byte* block, std::uint32_t first,
                   std::uint32_t count, const float* fresh) {
    const std::uint32_t d = layout_.head_dim, heads = layout_.num_kv_heads,
                        tpb = layout_.tokens_per_block;
    auto it = open_.find(b);
    const bool created = it == open_.end();
    if (created) {
      open_entry e;
      e.keys.assign(std::size_t{heads} * tpb * d, 0.0f);
      e.present.assign(tpb, 0);
      it = open_.emplace(b, std::move(e)).first;
    }
    open_entry& e = it->second;
    std::uint32_t added = 0;
    for (std::uint32_t t = first; t < first + count; ++t) {
      added += e.present[t] ? 0u : 1u;
    }
    const std::uint32_t have = tokens_[b] + added;
    thread_local std::vector<std::uint32_t> words;
    try {
      words.resize(have == tpb ? std::size_t{heads} * words_ : 0);
      bounds_.update(b, block, first, count);
    } catch (...) {
      if (created) {
        open_.erase(it);
      }
      throw;
    }
    for (std::uint32_t t = first; t < first + count; ++t) {
      e.present[t] = 1;
      for (std::uint32_t h = 0; h < heads; ++h) {
        std::copy_n(fresh + (std::size_t{h} * count + (t - first)) * d, d, e.key(h, t, layout_));
      }
    }
    if (have == tpb) {
      encode_all(b, e, words.data());
      for (std::uint32_t h = 0; h < heads; ++h) {
        std::copy_n(words.data() + std::size_t{h} * words_, words_, codes_of(h, b));
      }
      open_.erase(it);
    }
    tokens_[b] = static_cast<std::uint16_t>(have);
  }

  // Tokens folded into a coded entry again: the others are re-coded where the bounds widened.
  void update_coded(std::uint32_t b, const std::byte* block, std::uint32_t first,
                    std::uint32_t count, const float* fresh) {
    const std::uint32_t d = layout_.head_dim, heads = layout_.num_kv_heads;
    thread_local std::vector<float> lo0, step0, lo1, step1;
    lo0.resize(std::size_t{heads} * d);
    step0.resize(lo0.size());
    lo1.resize(lo0.size());
    step1.resize(lo0.size());
    for (std::uint32_t h = 0; h < heads; ++h) {
      range(h, b, lo0.data() + std::size_t{h} * d, step0.data() + std::size_t{h} * d);
    }
    bounds_.update(b, block, first, count);
    for (std::uint32_t h = 0; h < heads; ++h) {
      float* lo = lo1.data() + std::size_t{h} * d;
      float* step = step1.data() + std::size_t{h} * d;
      range(h, b, lo, step);
      std::uint32_t* words = codes_of(h, b);
      for (std::uint32_t x = 0; x < d; ++x) {
        const float l0 = lo0[std::size_t{h} * d + x], s0 = step0[std::size_t{h} * d + x];
        const bool moved = l0 != lo[x] || s0 != step[x];
        for (std::uint32_t t = 0; t < layout_.tokens_per_block; ++t) {
          float v;
          if (t >= first && t < first + count) {
            v = fresh[(std::size_t{h} * count + (t - first)) * d + x];
          } else if (moved) {
            v = cpu::detail::int2_value(l0, s0, cpu::detail::int2_code(words, groups_, x, t));
          } else {
            continue;
          }
          set_code(words, x, t, encode(v, lo[x], step[x]));
        }
      }
    }
  }

  // Codes every token of a whole block (`e` holds its keys) into `words` ([heads][words_]).
  void encode_all(std::uint32_t b, const open_entry& e, std::uint32_t* words) const {
    const std::uint32_t d = layout_.head_dim;
    thread_local std::vector<float> lo, step;
    lo.resize(d);
    step.resize(d);
    for (std::uint32_t h = 0; h < layout_.num_kv_heads; ++h) {
      std::uint32_t* w = words + std::size_t{h} * words_;
      std::fill_n(w, words_, 0u);
      range(h, b, lo.data(), step.data());
      for (std::uint32_t t = 0; t < layout_.tokens_per_block; ++t) {
        const float* k = e.key(h, t, layout_);
        for (std::uint32_t x = 0; x < d; ++x) {
          set_code(w, x, t, encode(k[x], lo[x], step[x]));
        }
      }
    }
  }

  // The nearest code of `v` between `lo` and `lo + 3 step`; 0 for a non-finite `v`.
  static std::uint32_t encode(float v, float lo, float step) noexcept {
    if (!(step > 0.0f) || !std::isfinite(v)) {
      return 0;
    }
    const float u = std::nearbyint((v - lo) / step);
    return static_cast<std::uint32_t>(std::clamp(u, 0.0f, 3.0f));
  }

  void set_code(std::uint32_t* words, std::uint32_t x, std::uint32_t t,
                std::uint32_t u) const noexcept {
    std::uint32_t& w = words[std::size_t{x} * groups_ + t / lanes];
    const std::uint32_t shift = 2 * (t % lanes);
    w = (w & ~(3u << shift)) | (u << shift);
  }

  // Entry b, head h: the lower bound and the code step per dimension.
  void range(std::uint32_t h, std::uint32_t b, float* lo, float* step) const {
    thread_local std::vector<float> hi;
    hi.resize(layout_.head_dim);
    bounds_.bounds(h, b, hi.data(), lo);
    for (std::uint32_t x = 0; x < layout_.head_dim; ++x) {
      step[x] = hi[x] > lo[x] ? (hi[x] - lo[x]) / 3.0f : 0.0f;
    }
  }

  // scale == 0: the max of dot products; > 0: the scaled log-sum-exp.
  void run(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q, std::uint32_t n,
           float scale, float* out, const char* what) const {
    if (h >= layout_.num_kv_heads) [[unlikely]] {
      detail::raise(errc::out_of_range, name, "::", what, ": kv head ", h,
                    " >= num_kv_heads = ", layout_.num_kv_heads);
    }
    if (entries.empty() || n == 0) {
      return;
    }
    if (q == nullptr || out == nullptr) [[unlikely]] {
      detail::raise(errc::invalid_argument, name, "::", what, ": null query or output");
    }
    cpu::detail::check_entry_ids(entries, capacity_, name);
    constexpr float inf = std::numeric_limits<float>::infinity();
    const std::uint32_t d = layout_.head_dim, tpb = layout_.tokens_per_block;
    thread_local std::vector<float> lo, step, dots;
    thread_local std::vector<std::uint32_t> bound;
    thread_local cpu::detail::int2_query z;
    lo.resize(d);
    step.resize(d);
    bound.resize(d / 2);
    dots.resize(std::size_t{n} * std::max(groups_ * lanes, tpb));
    const bool integer = cpu::detail::int2_prepare_integer(isa_, groups_, d, q, n, z);
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const std::uint32_t b = entries[i];
      float* o = out + i * n;
      if (tokens_[b] == 0) {
        std::fill(o, o + n, -inf);
      } else if (bad_[b] != 0) {
        std::fill(o, o + n, inf);
      } else if (tokens_[b] == tpb) {
        if (integer) {
          const float s = bounds_.bound_words(h, b, bound.data());
          cpu::detail::int2_score_integer(codes_of(h, b), bound.data(), s, tpb, z, scale, o);
          continue;
        }
        range(h, b, lo.data(), step.data());
        cpu::detail::int2_score_entry(isa_, codes_of(h, b), groups_, lo.data(), step.data(), d, tpb,
                                      q, n, scale, dots.data(), o);
      } else {
        score_open(h, open_.at(b), q, n, scale, dots.data(), o);
      }
    }
  }

  // An entry not yet full, from its keys: the exact dot products of its present tokens.
  void score_open(std::uint32_t h, const open_entry& e, const float* q, std::uint32_t n,
                  float scale, float* dots, float* o) const {
    const std::uint32_t d = layout_.head_dim, tpb = layout_.tokens_per_block;
    for (std::uint32_t r = 0; r < n; ++r) {
      const float* qr = q + std::size_t{r} * d;
      float* v = dots + std::size_t{r} * tpb;
      std::uint32_t k = 0;
      for (std::uint32_t t = 0; t < tpb; ++t) {
        if (!e.present[t]) {
          continue;
        }
        const float* key = e.key(h, t, layout_);
        float s = 0.0f;
        for (std::uint32_t x = 0; x < d; ++x) {
          s += qr[x] * key[x];
        }
        v[k++] = s;
      }
      o[r] = cpu::detail::int2_reduce_scalar(v, k, scale);
    }
  }

  std::uint32_t* codes_of(std::uint32_t h, std::uint32_t b) noexcept {
    return codes_.data() + (std::size_t{h} * capacity_ + b) * words_;
  }
  const std::uint32_t* codes_of(std::uint32_t h, std::uint32_t b) const noexcept {
    return codes_.data() + (std::size_t{h} * capacity_ + b) * words_;
  }
  void check_entry(std::uint32_t b) const {
    if (b >= capacity_) [[unlikely]] {
      detail::raise(errc::out_of_range, name, ": entry ", b, " >= capacity = ", capacity_);
    }
  }

  cascade_params params_;
  kv_layout layout_;
  quantized_minmax_summary bounds_;
  std::uint32_t capacity_;
  cpu_isa isa_ = cpu_isa::scalar;
  std::uint32_t groups_ = 0;                            // token groups of 16 per block
  std::size_t words_ = 0;                               // code words per (entry, KV head)
  std::vector<std::uint32_t> codes_;                    // [kv heads][capacity][head_dim][groups]
  std::vector<std::uint16_t> tokens_;                   // [capacity]: distinct tokens
  std::vector<std::uint8_t> bad_;                       // [capacity]: 1 if a key is non-finite
  std::unordered_map<std::uint32_t, open_entry> open_;  // entries not yet full
};

}  // namespace oasiskv
