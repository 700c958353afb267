// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cache::step_planner`: turns each sequence's selection into the capacity slots to
//! stage and the block tables a decode kernel reads (plan), hands the plan to the kernel outside
//! the cache's lock (run), and unpins what the step pinned (close).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include "oasiskv/cache/admission.hpp"
#include "oasiskv/cache/layer_blocks.hpp"
#include "oasiskv/concepts/prefetch_scheduler.hpp"
#include "oasiskv/core/decode_params.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/ids.hpp"
#include "oasiskv/core/kept_window.hpp"
#include "oasiskv/core/selection.hpp"
#include "oasiskv/core/views.hpp"
#include "oasiskv/kv_cache_types.hpp"

namespace oasiskv::cache {

//! @brief One decode step over a batch of sequences, as the kernel reads it: for sequence `i`
//! and its table `t`, `refs[offsets[i * tables_per_seq + t] ..)` are the staged blocks (fast
//! slot, position in the sequence) in ascending position; `lens[i]` its tokens. `pinned` holds
//! the fast slots the step pinned, which `step_planner::close` unpins.
struct step_plan {
  std::vector<block_ref> refs;         // [offsets.back()]
  std::vector<std::uint32_t> offsets;  // [sequences * tables_per_seq + 1]
  std::vector<std::uint32_t> lens;     // [sequences]
  std::vector<slot_id> pinned;         // fast slots acquired, null_slot for a skipped miss
  std::vector<float> lse;              // [rows] where the caller passes no lse
  std::uint32_t tables_per_seq = 0;
  selection predicted;  // a selection made at attention time (no lookahead came first)

  std::uint32_t sequences() const noexcept { return static_cast<std::uint32_t>(lens.size()); }
  //! @brief The tables as the kernel reads them.
  block_table_view table() const noexcept {
    return {refs.data(), offsets.data(), sequences(), tables_per_seq};
  }

 private:
  template <class>
  friend class step_planner;
  std::vector<slot_id> sources_;  // one sequence's unique capacity slots, ascending
  std::vector<slot_id> staged_;   // the fast slot of each source
};

//! @brief Plans decode steps over one cache's scheduler. Owns the plans, one per step running
//! at once (steps for different sequences may run concurrently: their kernels run outside the
//! cache's lock), reused from step to step, so a steady decode allocates nothing; they are freed
//! with the planner. Every call but `run`'s kernel happens under the cache's lock.
template <class Scheduler>
class step_planner {
 public:
  using plan_ptr = std::unique_ptr<step_plan>;

  explicit step_planner(Scheduler& scheduler) noexcept : scheduler_(scheduler) {}

  //! @brief Adds the kept window `w` (of the sequence's current length) to every table of `sel`
  //! and drops the blocks past it: a selection made before the newest tokens were appended (a
  //! lookahead, a step early) may miss the newest blocks. Tables stay ascending and unique.
  void merge_window(const block_window& w, selection& sel) {
    merged_.clear();
    offsets_.assign(1, 0);
    for (std::uint32_t t = 0; t < sel.tables; ++t) {
      const std::size_t start = merged_.size();
      for (std::uint32_t b : sel.table(t)) {
        if (b < w.blocks) {
          merged_.push_back(b);
        }
      }
      for (std::uint32_t b = 0; b < w.sinks; ++b) {
        merged_.push_back(b);
      }
      for (std::uint32_t b = w.recent_from; b < w.blocks; ++b) {
        merged_.push_back(b);
      }
      const auto first = merged_.begin() + static_cast<std::ptrdiff_t>(start);
      std::sort(first, merged_.end());
      merged_.erase(std::unique(first, merged_.end()), merged_.end());
      offsets_.push_back(static_cast<std::uint32_t>(merged_.size()));
    }
    std::swap(sel.blocks, merged_);
    std::swap(sel.offsets, offsets_);
  }

  //! @brief Starts staging what `sel` (its window merged, see `merge_window`) reads of a layer
  //! whose blocks lie in capacity slots `blocks`: the prefetch of a lookahead. Returns at once.
  void prefetch(std::span<const slot_id> blocks, const block_window& w, selection& sel) {
    merge_window(w, sel);
    sources_.clear();
    collect_sources(blocks, sel, sources_);
    scheduler_.prefetch(sources_);
  }

  //! @brief Starts staging what a layer of capacity slots `blocks` needs when it is admitted:
  //! of its first `full` blocks, the kept ones of `w` (or all, `admission_mode::full`; see
  //! `admission::initial_blocks`).
  void admit(std::span<const slot_id> blocks, const block_window& w, std::uint32_t full,
             admission_mode mode) {
    indices_.clear();
    admission::initial_blocks(w, full, mode, indices_);
    sources_.clear();
    for (const std::uint32_t b : indices_) {
      sources_.push_back(blocks[b]);
    }
    if (!sources_.empty()) {
      scheduler_.prefetch(sources_);
    }
  }

  //! @brief An empty plan, from those a finished step gave back where there is one.
  plan_ptr open() {
    plan_ptr p;
    if (free_.empty()) {
      p = std::make_unique<step_plan>();
    } else {
      p = std::move(free_.back());
      free_.pop_back();
    }
    p->refs.clear();
    p->offsets.assign(1, 0);
    p->lens.clear();
    p->pinned.clear();
    p->tables_per_seq = 0;
    return p;
  }

  //! @brief Adds one sequence, `ls` with the kept window `w`, to `p`: merges the window into
  //! `sel`, acquires its blocks (waiting only for those; a miss is fetched or skipped, as the
  //! scheduler's policy says) and appends its tables. Every sequence of a plan must have as
  //! many tables (one granularity). Counts the step in `stats`. On an error the blocks it
  //! acquired are in `p.pinned`, which `close` unpins.
  void add(step_plan& p, const layer_blocks& ls, const block_window& w, selection& sel,
           cache_stats& stats) {
    if (p.tables_per_seq != 0 && p.tables_per_seq != sel.tables) [[unlikely]] {
      detail::raise(errc::invalid_argument, "attend: sequences of one call selected with ",
                    "different granularities (", p.tables_per_seq, " and ", sel.tables, " tables)");
    }
    merge_window(w, sel);
    p.sources_.clear();
    collect_sources(ls.blocks, sel, p.sources_);
    p.staged_.resize(p.sources_.size());
    const acquire_stats st = scheduler_.acquire(p.sources_, p.staged_);
    p.pinned.insert(p.pinned.end(), p.staged_.begin(), p.staged_.end());
    stats.step += st;
    ++stats.sequence_steps;
    p.tables_per_seq = sel.tables;
    for (std::uint32_t t = 0; t < sel.tables; ++t) {
      for (const std::uint32_t b : sel.table(t)) {
        const auto it = std::lower_bound(p.sources_.begin(), p.sources_.end(), ls.blocks[b]);
        const slot_id fast = p.staged_[static_cast<std::size_t>(it - p.sources_.begin())];
        if (fast != null_slot) {
          p.refs.push_back({fast, b});
        }
      }
      stats.selected_blocks += sel.table(t).size();
      p.offsets.push_back(static_cast<std::uint32_t>(p.refs.size()));
    }
    p.lens.push_back(ls.tokens);
  }

  //! @brief A plan filled by `fill(plan)` (which calls `add` per sequence), under the cache's
  //! lock; where `fill` throws, what it pinned is unpinned and the plan kept for reuse.
  template <class Fill>
  plan_ptr build(Fill&& fill) {
    plan_ptr p = open();
    try {
      fill(*p);
    } catch (...) {
      close(std::move(p));
      throw;
    }
    return p;
  }

  //! @brief Runs `launch(plan)` (the kernel over it) without the cache's lock, then closes the
  //! plan holding `mutex` (the cache's lock), whether `launch` returned or threw.
  template <class Mutex, class Launch>
  void run(plan_ptr p, Mutex& mutex, Launch&& launch) {
    try {
      launch(*p);
    } catch (...) {
      std::lock_guard lock(mutex);
      close(std::move(p));
      throw;
    }
    std::lock_guard lock(mutex);
    close(std::move(p));
  }

  //! @brief The blocks each sequence's tables read, as positions in the sequence.
  static void describe(const step_plan& p, attended_blocks& out) {
    out.blocks.resize(p.refs.size());
    for (std::size_t i = 0; i < p.refs.size(); ++i) {
      out.blocks[i] = p.refs[i].index;
    }
    out.offsets.assign(p.offsets.begin(), p.offsets.end());
    out.tables_per_seq = p.tables_per_seq;
  }

  //! @brief Unpins what `p` pinned and keeps `p` for a later step.
  void close(plan_ptr p) {
    if (p == nullptr) {
      return;
    }
    try {
      scheduler_.release(p->pinned);
    } catch (...) {
      p->pinned.clear();
      free_.push_back(std::move(p));
      throw;
    }
    p->pinned.clear();
    free_.push_back(std::move(p));
  }

  //! @brief Plans kept for reuse (the most steps that ran at once, less those running).
  std::size_t idle_plans() const noexcept { return free_.size(); }

 private:
  // The unique capacity slots `sel` reads, ascending.
  static void collect_sources(std::span<const slot_id> blocks, const selection& sel,
                              std::vector<slot_id>& out) {
    for (const std::uint32_t b : sel.blocks) {
      out.push_back(blocks[b]);
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
  }

  Scheduler& scheduler_;
  std::vector<plan_ptr> free_;
  std::vector<std::uint32_t> merged_, offsets_;  // merge_window's scratch
  std::vector<slot_id> sources_;                 // prefetch's and admit's scratch
  std::vector<std::uint32_t> indices_;           // admit's
};

}  // namespace oasiskv::cache
