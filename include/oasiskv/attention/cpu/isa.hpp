// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The instruction sets the CPU kernels are compiled for, and the run-time choice among
//! them. Kernels are compiled with function-level target attributes, so a consumer builds with
//! no `-march` flag and one binary uses AVX-512 where the machine has it.
#pragma once

#include <cstdint>
#include <string_view>

#include "oasiskv/core/cpu_features.hpp"
#include "oasiskv/core/error.hpp"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define OASISKV_X86_KERNELS 1
#include <immintrin.h>
// AVX2 + FMA + F16C: every x86 server since Haswell; the generic head-dim path everywhere.
#define OASISKV_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
// AVX-512 F/BW/DQ/VL: Skylake-SP and later, Zen 4 and later.
#define OASISKV_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))
#else
#define OASISKV_X86_KERNELS 0
#endif

namespace oasiskv::cpu {

//! @brief A code path of the CPU kernels. `best` picks the widest one the machine runs.
enum class cpu_isa : std::uint8_t { scalar, avx2, avx512, best };

constexpr std::string_view to_string(cpu_isa i) noexcept {
  switch (i) {
    case cpu_isa::scalar:
      return "scalar";
    case cpu_isa::avx2:
      return "avx2";
    case cpu_isa::avx512:
      return "avx512";
    case cpu_isa::best:
      return "best";
  }
  return "unknown";
}

//! @brief Whether this build and this machine can run `i` (`scalar` and `best` always can).
inline bool isa_supported(cpu_isa i) noexcept {
#if OASISKV_X86_KERNELS
  // __builtin_cpu_supports also checks that the OS saves the wide registers (XCR0).
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    oasiskv::detail::cpu_has_f16c();
  switch (i) {
    case cpu_isa::avx2:
      return avx2;
    case cpu_isa::avx512:
      return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    default:
      return true;
  }
#else
  return i == cpu_isa::scalar || i == cpu_isa::best;
#endif
}

//! @brief `i` itself, or for `best` the widest supported path. Throws `errc::unsupported` when
//! `i` is a path this build or machine cannot run.
inline cpu_isa resolve_isa(cpu_isa i) {
  if (i == cpu_isa::best) {
    static const cpu_isa detected = isa_supported(cpu_isa::avx512) ? cpu_isa::avx512
                                    : isa_supported(cpu_isa::avx2) ? cpu_isa::avx2
                                                                   : cpu_isa::scalar;
    return detected;
  }
  if (!isa_supported(i)) [[unlikely]] {
    detail::raise(errc::unsupported, "cpu_isa ", to_string(i),
                  " is not supported by this build or CPU");
  }
  return i;
}

}  // namespace oasiskv::cpu
