// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Pitched copies and clears of `[height][pitch]` arrays on a stream, row by row where a
//! pitch is beyond what the runtime's 2D calls take.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace oasiskv::cuda::detail {

//! @brief The widest pitch handed to a 2D copy or set: `cudaDevAttrMaxPitch` of current devices
//! (2^31 - 1 bytes). Arrays with wider rows are copied row by row.
inline constexpr std::size_t max_copy_pitch = 0x7fffffff;

//! @brief `height` rows of `width` bytes from `src` (rows `spitch` apart) to `dst` (rows `dpitch`
//! apart) on `stream`: one `cudaMemcpy2DAsync`, or one `cudaMemcpyAsync` per row where a pitch
//! is beyond `max_copy_pitch`. The first error, if any.
inline cudaError_t copy_rows_async(void* dst, std::size_t dpitch, const void* src,
                                   std::size_t spitch, std::size_t width, std::size_t height,
                                   cudaMemcpyKind kind, cudaStream_t stream) {
  if (dpitch <= max_copy_pitch && spitch <= max_copy_pitch) {
    return cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream);
  }
  for (std::size_t r = 0; r < height; ++r) {
    if (const cudaError_t e =
            cudaMemcpyAsync(static_cast<std::byte*>(dst) + r * dpitch,
                            static_cast<const std::byte*>(src) + r * spitch, width, kind, stream);
        e != cudaSuccess) {
      return e;
    }
  }
  return cudaSuccess;
}

//! @brief Zeroes `height` rows of `width` bytes at `dst`, rows `pitch` apart, on `stream`
//! (`cudaMemset2DAsync`, or row by row beyond `max_copy_pitch`). The first error, if any.
inline cudaError_t clear_rows_async(void* dst, std::size_t pitch, std::size_t width,
                                    std::size_t height, cudaStream_t stream) {
  if (pitch <= max_copy_pitch) {
    return cudaMemset2DAsync(dst, pitch, 0, width, height, stream);
  }
  for (std::size_t r = 0; r < height; ++r) {
    if (const cudaError_t e =
            cudaMemsetAsync(static_cast<std::byte*>(dst) + r * pitch, 0, width, stream);
        e != cudaSuccess) {
      return e;
    }
  }
  return cudaSuccess;
}

}  // namespace oasiskv::cuda::detail
