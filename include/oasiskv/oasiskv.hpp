// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Umbrella header: every host-safe OasisKV header (no CUDA, no third-party dependency).
#pragma once

#include "oasiskv/config.hpp"

#include "oasiskv/core/decode_params.hpp"
#include "oasiskv/core/dtype.hpp"
#include "oasiskv/core/error.hpp"
#include "oasiskv/core/ids.hpp"
#include "oasiskv/core/layout.hpp"
#include "oasiskv/core/selection.hpp"
#include "oasiskv/core/views.hpp"

#include "oasiskv/concepts/block_allocator.hpp"
#include "oasiskv/concepts/block_summary.hpp"
#include "oasiskv/concepts/growable_summary.hpp"
#include "oasiskv/concepts/importance_predictor.hpp"
#include "oasiskv/concepts/loadable_summary.hpp"
#include "oasiskv/concepts/policy_bundle.hpp"
#include "oasiskv/concepts/prefetch_scheduler.hpp"
#include "oasiskv/concepts/row_scoring_summary.hpp"
#include "oasiskv/concepts/sparse_attention_kernel.hpp"
#include "oasiskv/concepts/tier_backend.hpp"
#include "oasiskv/concepts/transfer_engine.hpp"

#include "oasiskv/allocator/free_list_allocator.hpp"
#include "oasiskv/allocator/refcounted_allocator.hpp"
#include "oasiskv/attention/cpu_sparse_decode.hpp"
#include "oasiskv/attention/reference_decode.hpp"
#include "oasiskv/attention/validate.hpp"
#include "oasiskv/tier/composite_tier.hpp"
#include "oasiskv/tier/file_tier.hpp"
#include "oasiskv/tier/host_tier.hpp"
#include "oasiskv/transfer/cpu_copy_engine.hpp"
#include "oasiskv/transfer/routing_engine.hpp"

#include "oasiskv/kv_cache.hpp"
#include "oasiskv/predictor/aggregation.hpp"
#include "oasiskv/predictor/lookahead_predictor.hpp"
#include "oasiskv/predictor/oracle_predictor.hpp"
#include "oasiskv/predictor/recency_predictor.hpp"
#include "oasiskv/scheduler/eviction.hpp"
#include "oasiskv/scheduler/staging_scheduler.hpp"
#include "oasiskv/summary/mean_summary.hpp"
#include "oasiskv/summary/minmax_summary.hpp"
#include "oasiskv/summary/quantized_key_summary.hpp"
#include "oasiskv/summary/quantized_minmax_summary.hpp"
