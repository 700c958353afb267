// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief What a `cuda::device_decode_step` is built for (`device_decode_step_options`), what one
//! step takes (`device_decode_step_io`) and where its pinned staging area's parts lie
//! (`device_step_staging_layout`): plain data, apart from the step that runs them.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "oasiskv/core/ids.hpp"
#include "oasiskv/core/selection.hpp"
#include "oasiskv/core/views.hpp"
#include "oasiskv/predictor/cuda/topk_selector.cuh"

namespace oasiskv::cuda {

//! @brief The largest `selection_params::budget_blocks` a `device_decode_step` takes (the
//! residency kernel keeps two words per staging slot of a sequence in shared memory).
inline constexpr std::uint32_t max_step_budget = 4096;

//! @brief What a `device_decode_step` is built for. Sizes are maxima: every buffer is allocated
//! once, at construction, so that its address is the same in every replay of a capture.
struct device_decode_step_options {
  //! Sequences a step may take (1..65535).
  std::uint32_t max_seqs = 0;
  //! Blocks a sequence may have (the selection's grid bound and the rows of the block maps).
  std::uint32_t max_blocks = 0;
  //! The selection: `budget_blocks` (1..`max_step_budget`) is also the number of staging slots
  //! each sequence owns. A fixed budget only (`target_mass` 0).
  selection_params selection{};
  //! The most query tokens per sequence a step decodes (1..16).
  std::uint32_t max_q_len = 1;
  //! The most lookahead tokens per sequence a step selects with (1..16).
  std::uint32_t max_lookahead = 1;
  //! How the selection folds query rows into one score per block (the step passes no draft
  //! weights: `confidence_weighted` weighs every lookahead token 1, as `softmax_mass`).
  selection_aggregation aggregation = selection_aggregation::max;
  //! The fast pool (device memory of the current device) holding the staging slots.
  block_pool_view fast{};
  //! Sequence `s` owns fast slots `[first_slot + s * budget_blocks, + budget_blocks)`; all of
  //! `max_seqs` sequences' slots must lie in the pool, and nothing else may write them.
  slot_id first_slot = 0;
  //! The capacity pool the gather reads (pinned host memory, read through UVA, or device
  //! memory); the layout must be the fast pool's.
  block_pool_view capacity{};
  //! The decode's score scale; 0: 1/sqrt(head_dim).
  float scale = 0.0f;
  //! CTAs of the gather kernel.
  unsigned gather_ctas = 16;
  //! Splits of the decode kernel (0: what `sparse_decode` picks for `max_seqs` sequences and the
  //! budget). Fixed at construction, so the decode workspace is allocated once.
  std::uint32_t decode_splits = 0;
  //! Check with `cudaPointerGetAttributes` that the pointers of each `device_decode_step_io`
  //! are device memory of the current device (before anything is enqueued).
  bool check_pointers = true;
  //! Check the staging area on the host before each `enqueue` and `replay` (it is host memory:
  //! no device data is read): every length at least `q_len` and within `max_blocks` blocks,
  //! every summary id and capacity slot of a block in range. O(blocks) per step.
  bool check_staging = true;
  //! The capture mode `capture` begins with.
  cudaStreamCaptureMode capture_mode = cudaStreamCaptureModeThreadLocal;
};

//! @brief One step's device buffers and shape. The pointers are device memory the caller owns;
//! a capture records them, so they must stay valid (and are read anew) in every replay.
struct device_decode_step_io {
  const float* q = nullptr;          //!< [num_seqs][q_len][num_q_heads][head_dim], 16-byte aligned
  const float* lookahead = nullptr;  //!< [num_seqs][lookahead_tokens][num_q_heads][head_dim]
  float* out = nullptr;              //!< [num_seqs][q_len][num_q_heads][head_dim]
  float* lse = nullptr;        //!< [num_seqs][q_len][num_q_heads], or null: the step's own buffer
  std::uint32_t num_seqs = 0;  //!< sequences of this step, 1..max_seqs
  std::uint32_t q_len = 1;     //!< query tokens per sequence, 1..max_q_len
  std::uint32_t lookahead_tokens = 1;  //!< lookahead tokens per sequence, 1..max_lookahead
};

//! @brief Where each part of the pinned staging area (and of its device mirror) lies, in
//! 32-bit words: `seq_lens` `[max_seqs]`, then `summary_ids` and `capacity_slots`, each
//! `[max_seqs][max_blocks]`, every part starting on a 16-byte boundary. Host-only arithmetic.
struct device_step_staging_layout {
  std::uint32_t max_seqs = 0;    //!< rows of the block maps
  std::uint32_t max_blocks = 0;  //!< words per row

  //! @brief `n` rounded up to whole 16-byte groups of words.
  static constexpr std::size_t round_words(std::size_t n) noexcept { return (n + 3) / 4 * 4; }
  //! @brief Word offset of `seq_lens`.
  constexpr std::size_t lens_offset() const noexcept { return 0; }
  //! @brief Word offset of `summary_ids`.
  constexpr std::size_t ids_offset() const noexcept { return round_words(max_seqs); }
  //! @brief Words of one block map.
  constexpr std::size_t map_words() const noexcept {
    return round_words(std::size_t{max_seqs} * max_blocks);
  }
  //! @brief Word offset of `capacity_slots`.
  constexpr std::size_t caps_offset() const noexcept { return ids_offset() + map_words(); }
  //! @brief Words of the whole area.
  constexpr std::size_t words() const noexcept { return caps_offset() + map_words(); }
  //! @brief Word offset of sequence `s`'s row in a block map starting at `map`.
  constexpr std::size_t row(std::size_t map, std::uint32_t s) const noexcept {
    return map + std::size_t{s} * max_blocks;
  }
};

}  // namespace oasiskv::cuda
