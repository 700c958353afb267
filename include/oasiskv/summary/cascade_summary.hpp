// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cascade_summary<Coarse, Fine>`: a cheap bound over every block picks the contenders
//! for the budget, and only those are scored by a finer summary (`qminmax_int4_cascade`,
//! `qminmax_int8_cascade`).
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <ostream>
#include <span>
#include <vector>

#include "oasiskv/concepts/block_summary.hpp"
#include "oasiskv/concepts/growable_summary.hpp"
#include "oasiskv/concepts/loadable_summary.hpp"
#include "oasiskv/concepts/log_mass_summary.hpp"
#include "oasiskv/concepts/row_scoring_summary.hpp"
#include "oasiskv/concepts/two_stage_summary.hpp"
#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/layout.hpp"
#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/cpu/top_k.hpp"
#include "oasiskv/summary/quantized_key_summary.hpp"
#include "oasiskv/summary/quantized_minmax_summary.hpp"

namespace oasiskv {

//! @brief How many contenders `cascade_summary`'s first stage keeps.
struct cascade_params {
  //! Contenders per KV head: `min(blocks, ceil(contender_factor x budget_blocks))`. Finite and
  //! at least 1: the fine stage then always sees at least the blocks the budget can keep.
  float contender_factor = 4.0f;

  //! @brief How many of `blocks` entries stage 1 keeps for a budget of `keep_blocks`:
  //! `min(blocks, ceil(contender_factor x keep_blocks))`.
  std::uint32_t contenders(std::uint32_t blocks, std::uint32_t keep_blocks) const noexcept {
    const double want = std::ceil(double{contender_factor} * keep_blocks);
    return want >= blocks ? blocks : static_cast<std::uint32_t>(want);
  }
};

namespace detail {

//! @brief Throws `errc::invalid_argument` naming `p.contender_factor` unless it is finite and
//! at least 1; returns `p`.
inline cascade_params checked_cascade_params(const cascade_params& p) {
  if (!std::isfinite(p.contender_factor) || !(p.contender_factor >= 1.0f)) [[unlikely]] {
    raise(errc::invalid_argument, "cascade_params.contender_factor = ", p.contender_factor,
          " must be finite and >= 1");
  }
  return p;
}

//! @brief Appends `l`'s fields to an error message: `{layers, q heads, kv heads, head_dim,
//! tokens_per_block, dtype}`.
struct layout_fields {
  const kv_layout& l;  //!< the layout to print
  //! @brief Writes the fields.
  friend std::ostream& operator<<(std::ostream& os, const layout_fields& f) {
    return os << "{num_layers " << f.l.num_layers << ", num_q_heads " << f.l.num_q_heads
              << ", num_kv_heads " << f.l.num_kv_heads << ", head_dim " << f.l.head_dim
              << ", tokens_per_block " << f.l.tokens_per_block << ", " << to_string(f.l.kv_dtype)
              << "}";
  }
};

//! @brief Per-thread scratch of `pick_contenders`; its result is `picked` and `ids`.
struct contender_scratch {
  std::vector<float> coarse;          //!< the coarse scores
  std::vector<float> bound;           //!< [entries]: the bound folded over the rows
  std::vector<float> ranked, pool;    //!< keep_top's
  std::vector<std::uint32_t> picked;  //!< the contenders' indices into `entries`, ascending
  std::vector<std::uint32_t> ids;     //!< their entry ids
};

//! @brief The first stage of a two-stage summary: scores `entries` of KV head `h` with `coarse`
//! (a `block_summary`; its `score_rows` where it models `row_scoring_summary`) and folds each
//! entry's scores to one bound, the maximum over the `n` rows (NaN counts as `+inf`), into
//! `bound[i]`. Each entry's bound depends on that entry alone, so a range of entries can be
//! bounded apart from the rest. `scores` is scratch. Needs `n > 0` and non-null `q`.
template <class Coarse>
void contender_bounds(const Coarse& coarse, std::uint32_t h, std::span<const std::uint32_t> entries,
                      const float* q, std::uint32_t n, std::vector<float>& scores, float* bound) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  const auto m = static_cast<std::uint32_t>(entries.size());
  scores.resize(std::size_t{m} * n);
  if constexpr (row_scoring_summary<Coarse>) {
    coarse.score_rows(h, entries, q, n, scores.data());
    std::copy_n(scores.data(), m, bound);
    for (std::uint32_t r = 1; r < n; ++r) {
      const float* row = scores.data() + std::size_t{r} * m;
      for (std::uint32_t i = 0; i < m; ++i) {
        bound[i] = std::max(bound[i], row[i]);
      }
    }
    for (std::uint32_t r = 0; r < n; ++r) {  // NaN (rare): a max would drop it
      const float* row = scores.data() + std::size_t{r} * m;
      for (std::uint32_t i = 0; i < m; ++i) {
        bound[i] = std::isnan(row[i]) ? inf : bound[i];
      }
    }
  } else {
    coarse.score(h, entries, q, n, scores.data());
    for (std::uint32_t i = 0; i < m; ++i) {
      const float* e = scores.data() + std::size_t{i} * n;
      float b = -inf;
      for (std::uint32_t r = 0; r < n; ++r) {
        b = std::isnan(e[r]) ? inf : std::max(b, e[r]);
      }
      bound[i] = b;
    }
  }
}

//! @brief Leaves in `s.picked` / `s.ids` the `c` of `entries` with the highest `bound` (ties to
//! the earlier entry), ascending. Needs `0 < c < entries.size()`.
inline void keep_contenders(cpu_isa isa, std::span<const std::uint32_t> entries, const float* bound,
                            std::uint32_t c, contender_scratch& s) {
  s.picked.clear();
  cpu::detail::keep_top(isa, bound, static_cast<std::uint32_t>(entries.size()), c, 0, s.ranked,
                        s.pool, s.picked);
  s.ids.resize(s.picked.size());
  for (std::size_t j = 0; j < s.picked.size(); ++j) {
    s.ids[j] = entries[s.picked[j]];
  }
}

//! @brief Both stages of the pick: `contender_bounds` over every entry into `s.bound`, then
//! `keep_contenders`. Needs `0 < c < entries.size()`, `n > 0` and non-null `q`.
template <class Coarse>
void pick_contenders(const Coarse& coarse, cpu_isa isa, std::uint32_t h,
                     std::span<const std::uint32_t> entries, const float* q, std::uint32_t n,
                     std::uint32_t c, contender_scratch& s) {
  s.bound.resize(entries.size());
  contender_bounds(coarse, h, entries, q, n, s.coarse, s.bound.data());
  keep_contenders(isa, entries, s.bound.data(), c, s);
}

}  // namespace detail

//! @brief Two summaries of the same blocks scored as a cascade: `Coarse` (cheap, a bound, e.g.
//! `quantized_minmax_summary`) scores every block, and only the blocks whose bound ranks among
//! the top `contenders` are scored by `Fine` (accurate, e.g. `int4_key_summary`'s exact block
//! mass); the others score `-inf` (zero mass).
//!
//! Stage 1 folds `Coarse`'s scores of a block to one bound, the maximum over the query rows
//! (every q head of the GQA group, every lookahead token; NaN counts as `+inf`), and keeps the
//! `contenders(blocks, budget_blocks)` = `min(blocks, ceil(contender_factor x budget_blocks))`
//! highest bounds (ties to the earlier entry). Stage 2 scores those with `Fine`: its
//! `score_log_mass` when the predictor folds softmax mass and `Fine` models `log_mass_summary`,
//! else its `score`. With a bound-style `Coarse`, a block is ruled out only if `contenders`
//! others have a higher bound; the fine pass costs `contenders / blocks` of a full one, and the
//! coarse pass is one vector pass over the coarse entries. Exposed as `score_two_stage`
//! (`two_stage_summary`), which the summary-scoring predictors call with their budget.
//!
//! Without a budget (`score`, `score_log_mass`, `score_rows`) it is `Fine` alone: every block
//! a contender. Every `update`, `reset`, `grow` (when both parts model `growable_summary`) and
//! `load` (when both model `loadable_summary` with one wire format: each part reads the same
//! shipped bytes) goes to both parts. Memory: the sum of both parts' (`bytes_per_block`). Models
//! `block_summary`, `two_stage_summary`, and each of `growable_summary`, `loadable_summary`,
//! `log_mass_summary`, `row_scoring_summary` that its parts model (the last two: `Fine`).
//! Concurrent scoring calls are safe (per-thread scratch; steady-state calls do not allocate).
template <block_summary Coarse, block_summary Fine>
class cascade_summary {
 public:
  //! The first-stage summary, scored over every block.
  using coarse_type = Coarse;
  //! The second-stage summary, scored over the contenders.
  using fine_type = Fine;
  //! @brief Entries one pass over a tile scores: `Coarse`'s, the summary read for every block.
  static constexpr std::uint32_t entries_per_tile = summary_tile_entries_v<Coarse>;

  //! @brief Both parts over `capacity` entries of `layout`, on scoring path `isa`.
  //! `errc::invalid_argument` naming `params.contender_factor` unless it is finite and >= 1.
  cascade_summary(const kv_layout& layout, std::uint32_t capacity, cascade_params params = {},
                  cpu_isa isa = cpu_isa::best)
      : params_(detail::checked_cascade_params(params)),
        layout_(layout),
        isa_(resolve_isa(isa)),
        coarse_(make<Coarse>(layout, capacity, isa)),
        fine_(make<Fine>(layout, capacity, isa)) {}

  //! @brief Adopts already-built parts. `errc::invalid_argument` naming both values when their
  //! layouts or capacities differ, or naming `params.contender_factor` as above.
  cascade_summary(Coarse coarse, Fine fine, cascade_params params = {}) requires
      requires(const Coarse& c, const Fine& f) {
    { c.layout() } -> std::convertible_to<const kv_layout&>;
    { f.layout() } -> std::convertible_to<const kv_layout&>;
  } : params_(detail::checked_cascade_params(params)),
      layout_(coarse.layout()),
      isa_(resolve_isa(cpu_isa::best)),
      coarse_(std::move(coarse)),
      fine_(std::move(fine)) {
    if (!(coarse_.layout() == fine_.layout())) [[unlikely]] {
      detail::raise(errc::invalid_argument, "cascade_summary: coarse layout ",
                    detail::layout_fields{coarse_.layout()}, " != fine layout ",
                    detail::layout_fields{fine_.layout()});
    }
    if (coarse_.capacity() != fine_.capacity()) [[unlikely]] {
      detail::raise(errc::invalid_argument, "cascade_summary: coarse capacity ", coarse_.capacity(),
                    " != fine capacity ", fine_.capacity());
    }
  }

  //! @brief The number of entries (both parts have it).
  std::uint32_t capacity() const noexcept { return coarse_.capacity(); }
  //! @brief The layout both parts describe.
  const kv_layout& layout() const noexcept { return layout_; }
  //! @brief The contender factor in use.
  const cascade_params& params() const noexcept { return params_; }
  //! @brief The first-stage summary.
  const Coarse& coarse() const noexcept { return coarse_; }
  //! @brief The second-stage summary.
  const Fine& fine() const noexcept { return fine_; }

  //! @brief How many of `blocks` entries the first stage keeps for a budget of `keep_blocks`:
  //! `min(blocks, ceil(contender_factor x keep_blocks))`.
  std::uint32_t contenders(std::uint32_t blocks, std::uint32_t keep_blocks) const noexcept {
    return params_.contenders(blocks, keep_blocks);
  }

  //! @brief Bytes one entry costs: the sum of both parts'.
  std::size_t bytes_per_block() const noexcept {
    return coarse_.bytes_per_block() + fine_.bytes_per_block();
  }

  //! @brief Entry `b` of both parts describes an empty block.
  void reset(std::uint32_t b) {
    coarse_.reset(b);
    fine_.reset(b);
  }

  //! @brief Folds tokens `[first, first + count)` of the slot at `block` into entry `b` of both
  //! parts.
  void update(std::uint32_t b, const std::byte* block, std::uint32_t first, std::uint32_t count) {
    coarse_.update(b, block, first, count);
    fine_.update(b, block, first, count);
  }

  //! @brief Both parts' capacity becomes `capacity` (models `growable_summary` when both do).
  void grow(std::uint32_t capacity) requires growable_summary<Coarse> && growable_summary<Fine> {
    detail::check_summary_grow("cascade_summary", coarse_.capacity(), capacity);
    coarse_.grow(capacity);
    fine_.grow(capacity);
  }

  //! @brief Bytes of one shipped entry: the format both parts load (models `loadable_summary`
  //! when both do).
  std::size_t wire_bytes() const noexcept requires loadable_summary<Coarse> &&
      loadable_summary<Fine> {
    return coarse_.wire_bytes();
  }

  //! @brief Entry `b` of each part is loaded from the same shipped `bytes`.
  //! `errc::invalid_argument` naming both sizes when the parts load different formats.
  void load(std::uint32_t b, std::span<const std::byte> bytes,
            std::uint32_t tokens) requires loadable_summary<Coarse> && loadable_summary<Fine> {
    if (coarse_.wire_bytes() != fine_.wire_bytes()) [[unlikely]] {
      detail::raise(errc::invalid_argument, "cascade_summary::load: coarse wire_bytes ",
                    coarse_.wire_bytes(), " != fine wire_bytes ", fine_.wire_bytes());
    }
    coarse_.load(b, bytes, tokens);
    fine_.load(b, bytes, tokens);
  }

  //! @brief Chooses both parts' scoring path and the contender pick's.
  void set_isa(cpu_isa isa) requires requires(Coarse& c, Fine& f) {
    c.set_isa(isa);
    f.set_isa(isa);
  }
  {
    coarse_.set_isa(isa);
    fine_.set_isa(isa);
    isa_ = resolve_isa(isa);
  }

  //! @brief `Fine`'s `score`: every block a contender.
  void score(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
             std::uint32_t n, float* out) const {
    fine_.score(h, entries, q, n, out);
  }

  //! @brief `Fine`'s `score_log_mass` (models `log_mass_summary` when `Fine` does).
  void score_log_mass(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
                      std::uint32_t n, float scale,
                      float* out) const requires log_mass_summary<Fine> {
    fine_.score_log_mass(h, entries, q, n, scale, out);
  }

  //! @brief `Fine`'s `score_rows` (models `row_scoring_summary` when `Fine` does).
  void score_rows(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
                  std::uint32_t n, float* out) const requires row_scoring_summary<Fine> {
    fine_.score_rows(h, entries, q, n, out);
  }

  //! @brief Stage 1 alone (`split_two_stage_summary`): `bound[i]` is `Coarse`'s score of
  //! `entries[i]` folded over the `n` rows (the maximum; NaN as `+inf`).
  void score_bounds(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
                    std::uint32_t n, float* bound) const {
    if (entries.empty() || n == 0) {
      return;
    }
    if (q == nullptr || bound == nullptr) [[unlikely]] {
      detail::raise(errc::invalid_argument, "cascade_summary::score_bounds: null query or output");
    }
    thread_local std::vector<float> scores;
    detail::contender_bounds(coarse_, h, entries, q, n, scores, bound);
  }

  //! @brief Stage 2 alone (`split_two_stage_summary`): `Fine`'s scores of `entries`, in the
  //! layout and units of `score_two_stage` (`scale` as there).
  void score_fine(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
                  std::uint32_t n, float scale, float* out) const {
    if (!(scale >= 0.0f) || !std::isfinite(scale)) [[unlikely]] {
      detail::raise(errc::invalid_argument, "cascade_summary::score_fine: scale = ", scale,
                    " must be finite and >= 0");
    }
    if constexpr (log_mass_summary<Fine>) {
      if (scale > 0.0f) {
        fine_.score_log_mass(h, entries, q, n, scale, out);
        return;
      }
    }
    fine_.score(h, entries, q, n, out);
  }

  //! @brief The two-stage scores (see the class comment and `two_stage_summary`):
  //! `out[i * n + r]` is `Fine`'s score of `entries[i]` for row `r` if the entry is among the
  //! `contenders(entries.size(), keep_blocks)` highest `Coarse` bounds, else `-inf`. `scale == 0`:
  //! `Fine`'s `score`; `scale > 0`: its `score_log_mass` at that scale if it has one, else its
  //! `score`. `errc::invalid_argument` naming `scale` unless it is finite and >= 0.
  void score_two_stage(std::uint32_t h, std::span<const std::uint32_t> entries, const float* q,
                       std::uint32_t n, float scale, std::uint32_t keep_blocks, float* out) const {
    if (!(scale >= 0.0f) || !std::isfinite(scale)) [[unlikely]] {
      detail::raise(errc::invalid_argument, "cascade_summary::score_two_stage: scale = ", scale,
                    " must be finite and >= 0");
    }
    const auto m = static_cast<std::uint32_t>(entries.size());
    const std::uint32_t c = contenders(m, keep_blocks);
    if (c >= m || m == 0 || n == 0) {
      score_fine(h, entries, q, n, scale, out);
      return;
    }
    if (q == nullptr || out == nullptr) [[unlikely]] {
      detail::raise(errc::invalid_argument,
                    "cascade_summary::score_two_stage: null query or output");
    }
    constexpr float inf = std::numeric_limits<float>::infinity();
    thread_local scratch s;
    std::fill(out, out + std::size_t{m} * n, -inf);
    if (c == 0) {
      return;
    }
    detail::pick_contenders(coarse_, isa_, h, entries, q, n, c, s.pick);
    s.fine.resize(s.pick.ids.size() * n);
    score_fine(h, s.pick.ids, q, n, scale, s.fine.data());
    for (std::size_t j = 0; j < s.pick.picked.size(); ++j) {
      std::copy_n(s.fine.data() + j * n, n, out + std::size_t{s.pick.picked[j]} * n);
    }
  }

 private:
  struct scratch {
    detail::contender_scratch pick;  // stage 1
    std::vector<float> fine;         // [contenders][rows]: Fine's scores
  };

  template <class S>
  static S make(const kv_layout& layout, std::uint32_t capacity, cpu_isa isa) {
    if constexpr (std::constructible_from<S, const kv_layout&, std::uint32_t, cpu_isa>) {
      return S(layout, capacity, isa);
    } else {
      return S(layout, capacity);
    }
  }

  cascade_params params_;
  kv_layout layout_;
  cpu_isa isa_;
  Coarse coarse_;
  Fine fine_;
};

//! @brief int8 min/max bounds pick the contenders, an int4 copy of their keys scores them
//! (exact block mass): about 3.3% + 14.1% of the KV bytes (head_dim 64, 16-token blocks, f16).
using qminmax_int4_cascade = cascade_summary<quantized_minmax_summary, int4_key_summary>;
//! @brief int8 min/max bounds pick the contenders, an int8 copy of their keys scores them.
using qminmax_int8_cascade = cascade_summary<quantized_minmax_summary, int8_key_summary>;

}  // namespace oasiskv
