// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Library-wide configuration: version, host/device annotations, branch hints.
#pragma once

#define OASISKV_VERSION_MAJOR 0
#define OASISKV_VERSION_MINOR 1
#define OASISKV_VERSION_PATCH 0
#define OASISKV_VERSION \
  (OASISKV_VERSION_MAJOR * 10000 + OASISKV_VERSION_MINOR * 100 + OASISKV_VERSION_PATCH)

// Functions that kernels call are annotated so that nvcc compiles them for both sides; without
// nvcc the annotation collapses to `inline`, so every header stays a plain C++20 header.
#if defined(__CUDACC__)
#define OASISKV_HOST_DEVICE __host__ __device__ inline
#define OASISKV_DEVICE __device__ inline
#else
#define OASISKV_HOST_DEVICE inline
#endif

#if defined(__GNUC__) || defined(__clang__)
#define OASISKV_RESTRICT __restrict__
#define OASISKV_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define OASISKV_RESTRICT
#define OASISKV_ALWAYS_INLINE inline
#endif

namespace oasiskv {

//! @brief The library version as {major, minor, patch}.
struct version_info {
  int major, minor, patch;
};
inline constexpr version_info version{OASISKV_VERSION_MAJOR, OASISKV_VERSION_MINOR,
                                      OASISKV_VERSION_PATCH};

}  // namespace oasiskv
