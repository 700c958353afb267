// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The portable min/max tile scoring kernel (see `minmax_layout.hpp`): plain C++ for
//! machines (or builds) without the x86 SIMD paths, and the yardstick they are tested against.
#pragma once

#include <cstddef>
#include <cstdint>

#include "oasiskv/cpu/math_scalar.hpp"
#include "oasiskv/summary/cpu/minmax_layout.hpp"
#include "oasiskv/summary/cpu/tiles.hpp"

namespace oasiskv::cpu::detail {

// Lanes [lane0, lane0 + count) of one tile against every row of `split` ([n][q+ (d)][q- (d)]);
// writes entries i0 + k of `out`.
template <class S>
void minmax_lanes_scalar(const S* tile, const float* bias, std::uint32_t d, std::uint32_t lane0,
                         std::uint32_t count, const float* split, std::uint32_t n,
                         const score_sink& out, std::size_t i0) {
  for (std::uint32_t k = 0; k < count; ++k) {
    const std::uint32_t j = lane0 + k;
    for (std::uint32_t r = 0; r < n; ++r) {
      const float* qp = split + std::size_t{r} * 2 * d;
      const float* qn = qp + d;
      float acc[8] = {};
      for (std::uint32_t x = 0; x < d; x += 8) {
        for (std::uint32_t e = 0; e < 8; ++e) {  // the one nonzero term, as the vector paths
          acc[e] += qn[x + e] < 0.0f ? qn[x + e] * widen(tile[minmax_tile_at<S>(x + e, 1, j)])
                                     : qp[x + e] * widen(tile[minmax_tile_at<S>(x + e, 0, j)]);
        }
      }
      out.at(i0 + k, r) =
          (((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))) +
          bias[j];
    }
  }
}

}  // namespace oasiskv::cpu::detail
