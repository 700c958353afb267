// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief `current_query_predictor` (Quest): the true query at attention time scores every
//! block from its summary; the baseline `lookahead_predictor` is measured against.
#pragma once

#include "oasiskv/concepts/block_summary.hpp"
#include "oasiskv/concepts/score_aggregation.hpp"
#include "oasiskv/core/selection.hpp"
#include "oasiskv/predictor/aggregation.hpp"
#include "oasiskv/predictor/summary_scoring_predictor.hpp"

namespace oasiskv {

//! @brief Quest's predictor: the true query at attention time (one token; all of a
//! verification's tokens are accepted too), bounds aggregated by max. Selects the same blocks
//! as `lookahead_predictor` given the same queries, but only once the query exists, so its
//! blocks are fetched on demand: the baseline the lookahead is measured against.
template <block_summary Summary, selection_granularity Granularity = shared_selection>
class current_query_predictor
    : public detail::summary_scoring_predictor<Summary, max_aggregation, Granularity> {
 public:
  static constexpr prediction_timing timing = prediction_timing::at_attention;
};

}  // namespace oasiskv
