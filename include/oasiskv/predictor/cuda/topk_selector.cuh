// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `cuda::topk_selector`: the lookahead prediction on the GPU. Scores every block's
//! min/max summary (f16 or int8 bounds) against the lookahead queries and writes each table's top
//! blocks, translated to staging slots, straight into a device block table, with no host round
//! trip.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <type_traits>

#include "oasiskv/concepts/device_selector.hpp"
#include "oasiskv/core/decode_params.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/kept_window.hpp"
#include "oasiskv/core/layout.hpp"
#include "oasiskv/core/selection.hpp"
#include "oasiskv/cuda/detail/runtime.cuh"
#include "oasiskv/predictor/cuda/detail/select_kernels.cuh"
#include "oasiskv/summary/cuda/device_minmax_summary.cuh"
#include "oasiskv/summary/cuda/device_quantized_minmax_summary.cuh"

namespace oasiskv::cuda {

//! @brief One step's selection for a batch of sequences. Every pointer is device memory.
//!
//! `weights` is each sequence's `query_view::weights`, laid out as the queries are: row `s`
//! holds sequence `s`'s `num_tokens` draft confidences (e.g. the draft model's probability of
//! each lookahead token). Null weighs every token 1. Only
//! `selection_aggregation::confidence_weighted` reads them (max and plain softmax mass ignore
//! them, as the host's `max_aggregation` and `softmax_mass_aggregation` do), but every weight
//! given is checked on the device, whatever the aggregation: a negative or non-finite one (which
//! the host's predictor refuses with `errc::invalid_argument`) counts as 0 and is reported by
//! `topk_selector::check_status`.
struct topk_request {
  const float* queries = nullptr;  //!< [num_seqs][num_tokens][num_q_heads][head_dim]
  //! [num_seqs][num_tokens] draft confidence of each lookahead token, finite and >= 0; null: 1
  const float* weights = nullptr;
  std::uint32_t num_tokens = 1;                // lookahead tokens per sequence, 1..16
  const std::uint32_t* seq_lens = nullptr;     // [num_seqs]
  const std::uint32_t* summary_ids = nullptr;  // [num_seqs][max_blocks]: block i's entry
  const slot_id* staged_slots =
      nullptr;                       // [num_seqs][max_blocks]: block i's fast slot or null_slot
  block_ref* refs = nullptr;         // out: [num_seqs * tables_per_seq * budget_blocks]
  std::uint32_t* offsets = nullptr;  // out: [num_seqs * tables_per_seq + 1]
  std::uint32_t* misses = nullptr;   // out, optional: [num_seqs * tables_per_seq][budget_blocks]
                                     // selected blocks with no staged slot (unordered)
  std::uint32_t* miss_counts = nullptr;  // out, with misses: [num_seqs * tables_per_seq]
  std::uint32_t num_seqs = 0;
  std::uint32_t max_blocks = 0;  // the grid's bound on blocks per sequence
  selection_params params{};
};

//! @brief How `topk_selector` folds the scores of many query rows into one score per block.
enum class selection_aggregation : std::uint8_t {
  max,           //!< `max_aggregation`: the highest bound over rows (and KV heads when shared)
  softmax_mass,  //!< `softmax_mass_aggregation`: per row a softmax over blocks, summed
  //! `confidence_weighted_aggregation`: softmax mass with each row's mass times its lookahead
  //! token's weight (`topk_request::weights`; null: all 1, the same bits as `softmax_mass`)
  confidence_weighted,
};

//! @brief GPU counterpart of `lookahead_predictor<minmax_summary<f16>, A, G>` with `A` =
//! `max_aggregation`, `softmax_mass_aggregation` or `confidence_weighted_aggregation`
//! (`options::aggregation`), plus the
//! translation to staging slots: the same bound (q+ . max + q- . min), the same kept sinks and
//! recent window, ties to the lower index. Writes a `block_table_view`-shaped table (`refs`,
//! `offsets`; `tables_per_seq` 1 or num_kv_heads) that `cuda::sparse_decode` reads. The same
//! selection runs over a `device_quantized_minmax_summary` (the counterpart of
//! `lookahead_predictor<quantized_minmax_summary, A, G>`: its int8 bound with the query-rounding
//! term, the host's score up to f32 rounding).
//!
//! Max aggregation takes the highest bound over lookahead tokens, GQA members (and KV heads for
//! a shared selection). Softmax mass takes, per (sequence, KV head, query row), the softmax over
//! the sequence's blocks of `scale * bound` (`scale` = 1/sqrt(head_dim)), the bounds clamped to
//! finite values first as the host's `softmax_mass` does (an empty entry gets no mass, an
//! overflowed `+inf` or NaN bound the row's mass), and sums it over rows, the group's q heads and,
//! for a shared selection, the KV heads. Every lookahead token weighs the same (the host's
//! `softmax_mass_aggregation`) unless the aggregation is `confidence_weighted`: then each row's
//! mass, `e / sum` over the blocks, is multiplied by its token's weight before it is summed, as
//! the host's `confidence_weighted_aggregation` does (`add_scaled(acc, e, w / sum)`), so a token
//! of weight 0 moves nothing. The sums run in another order than the host's and `expf` is not the
//! host's `exp`, so scores agree to rounding, not bits: a near-tie at the budget's edge may resolve
//! differently.
//!
//! All kernels run on fixed grids sized from `num_seqs` and `max_blocks`; lengths are read on
//! the device, so a step (select, gather the misses, decode) can be captured in a CUDA graph once
//! `reserve` has allocated the workspace. A fixed budget only (`validate` judges the
//! `selection_params`). Models `device_selector` over both device summaries.
class topk_selector {
 public:
  //! @brief What `select` takes (`device_selector`'s request).
  using request = topk_request;

  struct options {
    cudaStream_t stream = nullptr;
    bool per_kv_head = false;    //!< one table per KV head (`per_kv_head_selection`)
    bool check_pointers = true;  //!< cudaPointerGetAttributes on every pointer of the request
    //! How query rows fold into one score per block; softmax mass (plain or confidence
    //! weighted) needs a workspace of
    //! `num_seqs * num_kv_heads * num_tokens * group_size * max_blocks` floats.
    selection_aggregation aggregation = selection_aggregation::max;
  };

  topk_selector() : topk_selector(options{}) {}
  explicit topk_selector(options o) : options_(o), state_(std::make_shared<state>()) {}

  const options& config() const noexcept { return options_; }
  //! @brief Sets the stream later calls enqueue on (and `check_status` synchronises).
  void set_stream(cudaStream_t s) noexcept { options_.stream = s; }
  std::uint32_t tables_per_seq(const kv_layout& l) const noexcept {
    return options_.per_kv_head ? l.num_kv_heads : 1;
  }

  //! @brief Throws unless this selector takes `sp` over summaries of layout `l`, without touching
  //! the driver: `errc::unsupported` for a head_dim other than 64 or 128 or an adaptive budget
  //! (`target_mass` not 0: the GPU selection takes a fixed budget), `errc::invalid_argument` for a
  //! budget below `sink_blocks + max(recent_blocks, 1)` (the kept blocks). `select` checks it too.
  static void validate(const kv_layout& l, const selection_params& sp) {
    if (l.head_dim != 64 && l.head_dim != 128) [[unlikely]] {
      oasiskv::detail::raise(errc::unsupported, "cuda::topk_selector: head_dim = ", l.head_dim,
                             " (supported: 64, 128)");
    }
    if (sp.target_mass != 0.0f) [[unlikely]] {
      oasiskv::detail::raise(errc::unsupported, "selection_params.target_mass = ", sp.target_mass,
                             ": the GPU selection takes a fixed budget only");
    }
    const std::uint64_t kept = min_budget_blocks(sp.sink_blocks, sp.recent_blocks);
    if (sp.budget_blocks < kept) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument,
                             "selection_params.budget_blocks = ", sp.budget_blocks,
                             " is below sink_blocks + max(recent_blocks, 1) = ", kept);
    }
  }

  //! @brief Allocates the workspace for requests up to this size (before a graph capture);
  //! `max_tokens` (lookahead tokens, 1..16) matters to the softmax-mass aggregation only.
  void reserve(const kv_layout& l, std::uint32_t num_seqs, std::uint32_t max_blocks,
               std::uint32_t max_tokens = max_query_tokens) const {
    if (max_tokens == 0 || max_tokens > max_query_tokens) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument,
                             "cuda::topk_selector::reserve: max_tokens = ", max_tokens,
                             " must be in [1, 16]");
    }
    std::lock_guard lock(state_->mutex);
    ensure(l, num_seqs, max_blocks, max_tokens, false);
  }

  //! @brief Enqueues the scoring and the top-k on the stream. Throws before any launch when the
  //! request is malformed (`errc::invalid_argument` naming a non-device pointer, `weights`
  //! included, when `check_pointers`). Asynchronous: `check_status` reports sequences longer
  //! than max_blocks and negative or non-finite weights.
  void select(const device_minmax_summary& s, const topk_request& r) const {
    enqueue(s.layout(), r, [&](detail::select_kernel_args& a, dim3 grid, cudaStream_t st) {
      a.bounds = s.bounds();
      a.tokens = s.tokens();
      a.capacity = s.capacity();
      if (a.layout.head_dim == 64) {
        detail::score_minmax_kernel<64><<<grid, detail::score_threads, 0, st>>>(a);
      } else {
        detail::score_minmax_kernel<128><<<grid, detail::score_threads, 0, st>>>(a);
      }
    });
  }

  //! @brief `select` over int8 bounds: the GPU counterpart of
  //! `lookahead_predictor<quantized_minmax_summary, A>`. Each block's score is the host summary's
  //! `score` (the query quantized to u8 codes, `dp4a` against the codes, plus the error term) up to
  //! f32 rounding; aggregation, kept blocks, ties and the table are as for `device_minmax_summary`.
  //! Throws as that overload.
  void select(const device_quantized_minmax_summary& s, const topk_request& r) const {
    enqueue(s.layout(), r, [&](detail::select_kernel_args& a, dim3 grid, cudaStream_t st) {
      a.qcodes = s.codes();
      a.qscale = s.scales();
      a.qnorm = s.norms();
      a.qbias = s.biases();
      a.tokens = s.tokens();
      a.capacity = s.capacity();
      if (a.layout.head_dim == 64) {
        detail::score_qminmax_kernel<64><<<grid, detail::score_threads, 0, st>>>(a);
      } else {
        detail::score_qminmax_kernel<128><<<grid, detail::score_threads, 0, st>>>(a);
      }
    });
  }

  //! @brief Synchronises the stream and reports what the device found since the last check,
  //! then clears it: `errc::out_of_range` if a sequence had more blocks than `max_blocks` (its
  //! tail was left out), else `errc::invalid_argument` if a weight was negative or not finite
  //! (it counted as 0), naming the first such weight by sequence and token and its value.
  void check_status() const {
    std::lock_guard lock(state_->mutex);
    if (state_->status == nullptr) {
      return;
    }
    std::uint32_t bad = 0;
    unsigned long long weight_key = detail::no_bad_weight;
    detail::check(cudaStreamSynchronize(options_.stream), "cuda::topk_selector: the kernels");
    detail::check(cudaMemcpy(&bad, state_->status, sizeof(bad), cudaMemcpyDeviceToHost),
                  "cuda::topk_selector: reading the status word");
    if (bad == 0) [[likely]] {
      return;
    }
    detail::check(
        cudaMemcpy(&weight_key, state_->bad_weight, sizeof(weight_key), cudaMemcpyDeviceToHost),
        "cuda::topk_selector: reading the bad weight");
    clear_status();
    const detail::bad_weight_report w = detail::decode_bad_weight(weight_key);
    if ((bad & detail::select_status_too_long) != 0) [[unlikely]] {
      if ((bad & detail::select_status_bad_weight) != 0) {
        oasiskv::detail::raise(errc::out_of_range,
                               "cuda::topk_selector: a sequence has more blocks than max_blocks; "
                               "also topk_request.weights[",
                               w.seq, "][", w.token, "] = ", w.value,
                               " is negative or not finite (counted as 0)");
      }
      oasiskv::detail::raise(errc::out_of_range,
                             "cuda::topk_selector: a sequence has more blocks than max_blocks");
    }
    oasiskv::detail::raise(errc::invalid_argument, "cuda::topk_selector: topk_request.weights[",
                           w.seq, "][", w.token, "] = ", w.value,
                           " must be finite and >= 0 (counted as 0)");
  }

 private:
  // Validates, fills the request's part of the kernel arguments, lets `score` set the summary's
  // part and launch its scoring kernel, then launches the aggregation and the top-k.
  template <class Score>
  void enqueue(const kv_layout& l, const topk_request& r, Score&& score) const {
    check_request(l, r);
    std::lock_guard lock(state_->mutex);
    const int device = detail::current_device();
    if (options_.check_pointers) {
      detail::require_device_pointer(r.queries, device, "topk_request.queries");
      if (r.weights != nullptr) {
        detail::require_device_pointer(r.weights, device, "topk_request.weights");
      }
      detail::require_device_pointer(r.seq_lens, device, "topk_request.seq_lens");
      detail::require_device_pointer(r.summary_ids, device, "topk_request.summary_ids");
      detail::require_device_pointer(r.staged_slots, device, "topk_request.staged_slots");
      detail::require_device_pointer(r.refs, device, "topk_request.refs");
      detail::require_device_pointer(r.offsets, device, "topk_request.offsets");
      if (r.misses != nullptr) {
        detail::require_device_pointer(r.misses, device, "topk_request.misses");
        detail::require_device_pointer(r.miss_counts, device, "topk_request.miss_counts");
      }
    }
    ensure(l, r.num_seqs, r.max_blocks, r.num_tokens, detail::is_capturing(options_.stream));
    detail::select_kernel_args a;
    a.layout = l;
    a.queries = r.queries;
    a.num_tokens = r.num_tokens;
    a.seq_lens = r.seq_lens;
    a.summary_ids = r.summary_ids;
    a.staged = r.staged_slots;
    a.refs = r.refs;
    a.offsets = r.offsets;
    a.misses = r.misses;
    a.miss_counts = r.miss_counts;
    a.scores = state_->scores;
    a.keys = state_->keys;
    a.status = state_->status;
    a.bad_weight = state_->bad_weight;
    a.weights = r.weights;
    a.num_seqs = r.num_seqs;
    a.max_blocks = r.max_blocks;
    a.tables_per_seq = tables_per_seq(l);
    a.sp = r.params;
    a.softmax_mass = options_.aggregation != selection_aggregation::max;
    a.weighted = options_.aggregation == selection_aggregation::confidence_weighted;
    a.scale = 1.0f / std::sqrt(static_cast<float>(l.head_dim));  // the host predictor's
    a.raw = state_->raw;
    cudaStream_t st = options_.stream;
    const std::uint32_t tables = r.num_seqs * a.tables_per_seq;
    if (r.misses != nullptr) {
      detail::clear_counts_kernel<><<<(tables + 255) / 256, 256, 0, st>>>(r.miss_counts, tables);
      detail::check(cudaGetLastError(), "cuda::topk_selector: launch", errc::invalid_argument);
    }
    const dim3 grid(
        (r.max_blocks + detail::score_entries_per_cta - 1) / detail::score_entries_per_cta,
        l.num_kv_heads, r.num_seqs);
    score(a, grid, st);
    detail::check(cudaGetLastError(), "cuda::topk_selector: score launch", errc::invalid_argument);
    if (a.softmax_mass) {
      detail::softmax_mass_kernel<>
          <<<dim3(l.num_kv_heads, r.num_seqs), detail::mass_threads, 0, st>>>(a);
      detail::check(cudaGetLastError(), "cuda::topk_selector: softmax mass launch",
                    errc::invalid_argument);
    }
    detail::topk_select_kernel<><<<tables, detail::topk_threads, 0, st>>>(a);
    detail::check(cudaGetLastError(), "cuda::topk_selector: top-k launch", errc::invalid_argument);
  }

  struct state {
    std::mutex mutex;
    int device = -1;
    float* scores = nullptr;        // [num_seqs][num_kv_heads][max_blocks]
    std::uint32_t* keys = nullptr;  // [num_seqs * tables_per_seq][max_blocks]
    float* raw = nullptr;           // softmax mass: [num_seqs][num_kv_heads][rows][max_blocks]
    std::size_t score_elems = 0, key_elems = 0, raw_elems = 0;
    std::uint32_t* status = nullptr;           // flags (select_status_*), in `words`
    unsigned long long* bad_weight = nullptr;  // the lowest bad_weight_key, in `words`
    void* words = nullptr;                     // 16 bytes: status, padding, bad_weight
    state() = default;
    state(const state&) = delete;
    state& operator=(const state&) = delete;
    ~state() {
      if (device < 0) {
        return;
      }
      int previous = -1;
      const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device &&
                            cudaSetDevice(device) == cudaSuccess;
      (void)cudaFree(scores);
      (void)cudaFree(keys);
      (void)cudaFree(raw);
      (void)cudaFree(words);
      if (switched) {
        (void)cudaSetDevice(previous);
      }
    }
  };

  void check_request(const kv_layout& l, const topk_request& r) const {
    validate(l, r.params);
    if (r.num_tokens == 0 || r.num_tokens > max_query_tokens) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "topk_request.num_tokens = ", r.num_tokens,
                             " must be in [1, 16]");
    }
    if (r.num_seqs == 0 || r.num_seqs > 65535 || r.max_blocks == 0) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument, "topk_request.num_seqs = ", r.num_seqs,
                             " must be in [1, 65535] and max_blocks = ", r.max_blocks, " >= 1");
    }
    if (r.queries == nullptr || r.seq_lens == nullptr || r.summary_ids == nullptr ||
        r.staged_slots == nullptr || r.refs == nullptr || r.offsets == nullptr ||
        (r.misses == nullptr) != (r.miss_counts == nullptr)) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument,
                             "topk_request: a required pointer is null (misses and miss_counts "
                             "come together)");
    }
  }

  void ensure(const kv_layout& l, std::uint32_t num_seqs, std::uint32_t max_blocks,
              std::uint32_t num_tokens, bool capturing) const {
    state& st = *state_;
    const int device = detail::current_device();
    if (st.device >= 0 && st.device != device) [[unlikely]] {
      oasiskv::detail::raise(errc::invalid_argument,
                             "cuda::topk_selector: its workspace lives on device ", st.device);
    }
    const std::size_t scores = std::size_t{num_seqs} * l.num_kv_heads * max_blocks;
    const std::size_t keys = std::size_t{num_seqs} * tables_per_seq(l) * max_blocks;
    const std::size_t raw = options_.aggregation != selection_aggregation::max
                                ? scores * num_tokens * l.group_size()
                                : 0;
    if (st.status != nullptr && st.score_elems >= scores && st.key_elems >= keys &&
        st.raw_elems >= raw) {
      return;
    }
    if (capturing) [[unlikely]] {
      oasiskv::detail::raise(errc::unsupported,
                             "cuda::topk_selector: the workspace must grow during a graph "
                             "capture; call reserve() first");
    }
    st.device = device;
    auto grow = [](auto*& p, std::size_t& have, std::size_t need) {
      if (have >= need) {
        return;
      }
      (void)cudaFree(p);
      p = nullptr;
      have = 0;
      void* m = nullptr;
      detail::check(cudaMalloc(&m, need * sizeof(*p)), "cuda::topk_selector: workspace",
                    errc::out_of_memory);
      p = static_cast<std::remove_reference_t<decltype(p)>>(m);
      have = need;
    };
    grow(st.scores, st.score_elems, scores);
    grow(st.keys, st.key_elems, keys);
    grow(st.raw, st.raw_elems, raw);
    if (st.status == nullptr) {
      detail::check(cudaMalloc(&st.words, 16), "cuda::topk_selector: status", errc::out_of_memory);
      st.status = static_cast<std::uint32_t*>(st.words);
      st.bad_weight = reinterpret_cast<unsigned long long*>(static_cast<char*>(st.words) + 8);
      clear_status();
    }
  }

  // Zeroes the status flags and resets the bad weight.
  void clear_status() const {
    state& st = *state_;
    const unsigned long long none = detail::no_bad_weight;
    detail::check(cudaMemset(st.status, 0, sizeof(std::uint32_t)),
                  "cuda::topk_selector: cudaMemset");
    detail::check(cudaMemcpy(st.bad_weight, &none, sizeof(none), cudaMemcpyHostToDevice),
                  "cuda::topk_selector: resetting the bad weight");
    // Finished before this returns: the selection may run on a stream that does not wait for
    // the legacy default stream.
    detail::check(cudaStreamSynchronize(nullptr), "cuda::topk_selector: clearing the status");
  }

  options options_;
  std::shared_ptr<state> state_;
};

static_assert(device_selector<topk_selector, device_minmax_summary>);
static_assert(device_selector<topk_selector, device_quantized_minmax_summary>);

}  // namespace oasiskv::cuda
