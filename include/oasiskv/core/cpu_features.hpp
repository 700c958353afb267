// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Host-only: x86 CPU features that the compilers' `__builtin_cpu_supports` does not name
//! everywhere (clang 14 has no "f16c").
#pragma once

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

namespace oasiskv::detail {

//! @brief Whether the CPU converts between f16 and f32 in vector registers (F16C, CPUID leaf 1,
//! ECX bit 29). Whether the OS saves the registers is checked with AVX by the callers.
inline bool cpu_has_f16c() noexcept {
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
#else
  return false;
#endif
}

}  // namespace oasiskv::detail
