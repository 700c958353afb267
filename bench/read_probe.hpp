// SPDX-License-Identifier: Apache-2.0
// The read-bandwidth probe the benchmarks divide by: the sum of every byte of a buffer
// (vpsadbw on AVX-512, a plain loop elsewhere), which reads memory as fast as one core can and
// does nothing else.
#pragma once

#include <cstddef>
#include <cstdint>

#include "oasiskv/cpu/isa.hpp"

namespace oasiskv::bench {

#if OASISKV_X86_KERNELS
OASISKV_TARGET_AVX512 inline std::uint64_t byte_sum_avx512(const std::byte* p, std::size_t n) {
  const __m512i zero = _mm512_setzero_si512();
  __m512i a0 = zero, a1 = zero, a2 = zero, a3 = zero;
  std::size_t i = 0;
  for (; i + 256 <= n; i += 256) {
    a0 = _mm512_add_epi64(a0, _mm512_sad_epu8(_mm512_loadu_si512(p + i), zero));
    a1 = _mm512_add_epi64(a1, _mm512_sad_epu8(_mm512_loadu_si512(p + i + 64), zero));
    a2 = _mm512_add_epi64(a2, _mm512_sad_epu8(_mm512_loadu_si512(p + i + 128), zero));
    a3 = _mm512_add_epi64(a3, _mm512_sad_epu8(_mm512_loadu_si512(p + i + 192), zero));
  }
  alignas(64) std::uint64_t lanes[8];
  _mm512_store_si512(lanes, _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
  std::uint64_t s = 0;
  for (std::uint64_t x : lanes) {
    s += x;
  }
  for (; i < n; ++i) {
    s += static_cast<std::uint8_t>(p[i]);
  }
  return s;
}
#endif

//! The sum of the `n` bytes at `p`, on the widest path this machine runs.
inline std::uint64_t byte_sum(const std::byte* p, std::size_t n) {
#if OASISKV_X86_KERNELS
  if (isa_supported(cpu_isa::avx512)) {
    return byte_sum_avx512(p, n);
  }
#endif
  std::uint64_t s = 0;
  for (std::size_t i = 0; i < n; ++i) {
    s += static_cast<std::uint8_t>(p[i]);
  }
  return s;
}

}  // namespace oasiskv::bench
