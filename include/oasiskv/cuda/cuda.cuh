// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Umbrella header of the CUDA models (nvcc only): tiers, copy engine, decode attention,
//! the GPU block selection and the capturable decode step.
#pragma once

#include "oasiskv/cuda/copy_engine.cuh"
#include "oasiskv/cuda/device_decode_step.cuh"
#include "oasiskv/cuda/device_quantized_summary.cuh"
#include "oasiskv/cuda/device_tier.cuh"
#include "oasiskv/cuda/pinned_host_tier.cuh"
#include "oasiskv/cuda/sparse_decode.cuh"
#include "oasiskv/cuda/topk_selector.cuh"
