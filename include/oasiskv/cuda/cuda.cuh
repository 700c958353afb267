// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Umbrella header of the CUDA models (nvcc only). Each lives in the `cuda/` folder of the
//! concept it models, beside its CPU siblings: tiers (`tier/cuda/`), the copy engine and its
//! gather kernel (`transfer/cuda/`), the device summaries (`summary/cuda/`), the GPU block
//! selection (`predictor/cuda/`), decode attention (`attention/cuda/`) and the capturable decode
//! step that composes them (`cache/cuda/`). `oasiskv/cuda/` itself holds the runtime helpers.
//! `attention/cuda/flashinfer_decode.cuh` needs FlashInfer's headers and is not included here.
#pragma once

#include "oasiskv/attention/cuda/sparse_decode.cuh"
#include "oasiskv/cache/cuda/device_decode_step.cuh"
#include "oasiskv/predictor/cuda/topk_selector.cuh"
#include "oasiskv/summary/cuda/device_minmax_summary.cuh"
#include "oasiskv/summary/cuda/device_quantized_minmax_summary.cuh"
#include "oasiskv/tier/cuda/device_tier.cuh"
#include "oasiskv/tier/cuda/pinned_host_tier.cuh"
#include "oasiskv/transfer/cuda/copy_engine.cuh"
#include "oasiskv/transfer/cuda/gather_kernel.cuh"
