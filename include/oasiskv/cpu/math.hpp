// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The dispatcher of the SIMD math that several CPU kernels and policies share:
//! `dot_entries`, `exp_sum`, `clamp_finite_max`, `argmax`, `add_scaled`, `entry_id_stats_of`. Each
//! entry point calls the per-ISA body in `math_scalar.hpp`, `math_avx2.hpp` or `math_avx512.hpp`
//! (compiled with function-level target attributes and chosen at run time, so a consumer builds
//! with no `-march` flag); policies (summaries, `predictor/aggregation.hpp`,
//! `predictor/block_selector.hpp`) and the engine include this header, never the per-ISA ones.
//! The per-ISA files also hold the loads and reductions other kernel families build on.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "oasiskv/cpu/isa.hpp"
#include "oasiskv/cpu/math_avx2.hpp"
#include "oasiskv/cpu/math_avx512.hpp"
#include "oasiskv/cpu/math_scalar.hpp"

namespace oasiskv::cpu::detail {

//! @brief `out[i] = exp(scale * (x[i] - m))` for `i < count` (`x` finite; `out` may be `x`);
//! returns the sum of the `out[i]`. The AVX-512 and AVX2 paths' polynomial is within about 2 ulp
//! of `std::exp` and returns ~1e-38, not 0, below -87.3; the scalar path is `std::exp`.
inline float exp_sum(const float* x, float m, std::size_t count, float scale, float* out) {
#if OASISKV_X86_KERNELS
  static const bool avx512 = isa_supported(cpu_isa::avx512);
  if (avx512) {
    return exp_sum_avx512(x, m, count, scale, out);
  }
  static const bool avx2 = isa_supported(cpu_isa::avx2);
  if (avx2) {
    return exp_sum_avx2(x, m, count, scale, out);
  }
#endif
  return exp_sum_scalar(x, m, count, scale, out);
}

//! @brief `out[i]` = `x[i]` clamped to the finite floats (`+inf` and NaN to the largest, `-inf`
//! to the lowest) for `i < count` (`out` may be `x`); returns the largest `out[i]`, or the lowest
//! finite float when `count` is 0.
inline float clamp_finite_max(const float* x, std::size_t count, float* out) {
#if OASISKV_X86_KERNELS
  static const bool avx512 = isa_supported(cpu_isa::avx512);
  if (avx512) {
    return clamp_finite_max_avx512(x, count, out);
  }
  static const bool avx2 = isa_supported(cpu_isa::avx2);
  if (avx2) {
    return clamp_finite_max_avx2(x, count, out);
  }
#endif
  return clamp_finite_max_scalar(x, count, out);
}

//! @brief The index of the first largest of `x[0..count)`, NaN never the largest (0 when
//! `count` is 0 or every value is NaN). Greedy sampling over a vocabulary.
inline std::size_t argmax(const float* x, std::size_t count) {
#if OASISKV_X86_KERNELS
  static const bool avx512 = isa_supported(cpu_isa::avx512);
  if (avx512 && count < (std::size_t{1} << 31)) {  // the vector kernel's indices are int32
    return argmax_avx512(x, count);
  }
#endif
  return argmax_scalar(x, count);
}

//! @brief `acc[i] += k * x[i]` for `i < count`.
inline void add_scaled(float* acc, const float* x, float k, std::size_t count) {
#if OASISKV_X86_KERNELS
  static const bool avx512 = isa_supported(cpu_isa::avx512);
  if (avx512) {
    add_scaled_avx512(acc, x, k, count);
    return;
  }
  static const bool avx2 = isa_supported(cpu_isa::avx2);
  if (avx2) {
    add_scaled_avx2(acc, x, k, count);
    return;
  }
#endif
  add_scaled_scalar(acc, x, k, count);
}

//! @brief `out[i * n + r] = dot(rows[r], base[ids[i] * entry_stride .. + len])` for every entry
//! id and query row. `rows` is `[n][len]`; `len` is a multiple of 8. `isa` is already resolved.
template <class S>
void dot_entries(cpu_isa isa, const S* base, std::size_t entry_stride,
                 std::span<const std::uint32_t> ids, const float* rows, std::uint32_t n,
                 std::uint32_t len, float* out) {
#if OASISKV_X86_KERNELS
  if (isa_includes(isa, cpu_isa::avx512)) {
    dot_entries_avx512(base, entry_stride, ids, rows, n, len, out);
    return;
  }
  if (isa_includes(isa, cpu_isa::avx2)) {
    dot_entries_avx2(base, entry_stride, ids, rows, n, len, out);
    return;
  }
#endif
  (void)isa;
  dot_entries_scalar(base, entry_stride, ids, rows, n, len, out);
}

//! @brief `entry_id_stats` of `ids` (not empty).
inline entry_id_stats entry_id_stats_of(std::span<const std::uint32_t> ids) {
#if OASISKV_X86_KERNELS
  static const bool avx512 = isa_supported(cpu_isa::avx512);
  if (avx512) {
    return entry_id_stats_avx512(ids);
  }
#endif
  return entry_id_stats_scalar(ids);
}

}  // namespace oasiskv::cpu::detail
