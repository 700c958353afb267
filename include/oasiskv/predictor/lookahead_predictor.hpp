// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `lookahead_predictor`, the OasisKV predictor: the drafted tokens' queries score every
//! block from its summary a step early, and the top blocks under the budget are prefetched.
#pragma once

#include "oasiskv/concepts/block_summary.hpp"
#include "oasiskv/concepts/score_aggregation.hpp"
#include "oasiskv/core/selection.hpp"
#include "oasiskv/predictor/aggregation.hpp"
#include "oasiskv/predictor/summary_scoring_predictor.hpp"
#include "oasiskv/summary/cascade_summary.hpp"
#include "oasiskv/summary/qminmax_int2_summary.hpp"

namespace oasiskv {

//! @brief The OasisKV predictor: scores every block from `Summary` against the queries of the
//! lookahead (drafted) tokens, 1 to 16 of them, and of every q head of each KV head's GQA group;
//! `Aggregation` folds them (`softmax_mass_aggregation`, the default; `max_aggregation`,
//! `confidence_weighted_aggregation`), and `Granularity` says whether KV heads share one table.
//! Mass is the default because it is what the next step's attention covers: with several
//! drafts a max lets one draft's peak outrank blocks every draft wants (docs/accuracy.md: mass
//! beats max by 8-17 points of top-k agreement with the min/max summary, and max misses every
//! recall target). With a `log_mass_summary` (e.g. `int8_key_summary`) a mass aggregation reads
//! the summary's `score_log_mass`, the exact block mass, instead of `score`.
//! Its queries exist a step before the step it predicts, so its selection is prefetched.
//! `Summary` defaults to `qminmax_int2_summary`: the int8 min/max bounds rule out all but four
//! times the budget, and 2-bit codes of those blocks' keys between the bounds score their block
//! mass (docs/accuracy.md: at 8k context its agreement with dense matches the int4 cascade's and
//! its perplexity is within 1% of dense's, in 9.6% of the KV bytes against the cascade's 17.4%).
//! Cost per call: one pass over the summaries of the sequence, `O(blocks x rows x head_dim)`,
//! and `O(blocks)` per table for the top-k.
template <block_summary Summary = qminmax_int2_summary,
          score_aggregation Aggregation = softmax_mass_aggregation,
          selection_granularity Granularity = shared_selection>
class lookahead_predictor
    : public detail::summary_scoring_predictor<Summary, Aggregation, Granularity> {
 public:
  static constexpr prediction_timing timing = prediction_timing::lookahead;
};

}  // namespace oasiskv
