// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The dispatcher of `quantized_minmax_summary`'s scoring kernels (`qminmax_scalar.hpp`,
//! `qminmax_avx512_vnni.hpp`; tiles: `qminmax_layout.hpp`): `qminmax_run`.
#pragma once

#include <cstddef>
#include <cstdint>

#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/summary/cpu/qminmax_avx512_vnni.hpp"
#include "oasiskv/summary/cpu/qminmax_layout.hpp"
#include "oasiskv/summary/cpu/qminmax_scalar.hpp"
#include "oasiskv/summary/cpu/tiles.hpp"

namespace oasiskv::cpu::detail {

//! @brief Lanes `[lane0, lane0 + count)` of one `quantized_minmax_summary` tile against every
//! row: entry `i0 + k`, row `r` of `out` = `dot * (scale * t[r]) + slack[r] * norm + bias`. `isa`
//! is already resolved: `cpu_isa::avx512_vnni` runs the VNNI kernel, every other path the
//! portable one (the same integers).
inline void qminmax_run(cpu_isa isa, const std::int8_t* tile, const float* scale, const float* norm,
                        const float* bias, std::uint32_t d, std::uint32_t lane0,
                        std::uint32_t count, const std::uint32_t* qw, const float* t,
                        const float* slack, std::uint32_t n, const score_sink& out,
                        std::size_t i0) {
#if OASISKV_X86_KERNELS
  if (isa_includes(isa, cpu_isa::avx512_vnni)) {
    qminmax_run_avx512_vnni(tile, scale, norm, bias, d, lane0, count, qw, t, slack, n, out, i0);
    return;
  }
#endif
  (void)isa;
  qminmax_run_scalar(tile, scale, norm, bias, d, lane0, count, qw, t, slack, n, out, i0);
}

}  // namespace oasiskv::cpu::detail
