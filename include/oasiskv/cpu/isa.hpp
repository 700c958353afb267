// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Host-only: the one CPU instruction-set layer of the library. Every CPU kernel
//! (attention, summary scoring, block selection, the mini-decoder's matmuls) is compiled with
//! the function-level target attributes defined here and chosen at run time with `resolve_isa`,
//! so a consumer builds with no `-march` flag and one binary uses AVX-512 (and AVX512_VNNI)
//! where the machine has it. The CPU is probed once per process.
#pragma once

#include <cstdint>
#include <string_view>

#include "oasiskv/core/error.hpp"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define OASISKV_X86_KERNELS 1
#include <cpuid.h>
#include <immintrin.h>
// AVX2 + FMA + F16C: every x86 server since Haswell; the generic head-dim path everywhere.
#define OASISKV_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
// AVX-512 F/BW/DQ/VL: Skylake-SP and later, Zen 4 and later.
#define OASISKV_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))
// AVX-512 + AVX512_VNNI (int8 dot products): Cascade Lake and later, Zen 4 and later.
#define OASISKV_TARGET_AVX512VNNI \
  __attribute__((target("avx512vnni,avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))
#else
#define OASISKV_X86_KERNELS 0
#endif

//! @brief Stringizes its argument (for `OASISKV_UNROLL`).
#define OASISKV_UNROLL_STR(x) #x
//! @brief `#pragma GCC unroll n` where the compiler takes it; nothing in CUDA translation units
//! (nvcc's front end rejects the pragma, and .cu files include the CPU kernels' headers through
//! the predictors).
#if defined(__CUDACC__)
#define OASISKV_UNROLL(n)
#else
#define OASISKV_UNROLL(n) _Pragma(OASISKV_UNROLL_STR(GCC unroll n))
#endif

namespace oasiskv {

//! @brief A code path of the CPU kernels; each level has the instructions of the levels before
//! it. `avx512_vnni` is `avx512` plus AVX512_VNNI's int8 and int16 dot products: a kernel family
//! that has VNNI kernels runs them there, every other family its AVX-512 kernels. `best` asks
//! for the widest path the machine runs (see `resolve_isa`).
enum class cpu_isa : std::uint8_t { scalar, avx2, avx512, avx512_vnni, best };

constexpr std::string_view to_string(cpu_isa i) noexcept {
  switch (i) {
    case cpu_isa::scalar:
      return "scalar";
    case cpu_isa::avx2:
      return "avx2";
    case cpu_isa::avx512:
      return "avx512";
    case cpu_isa::avx512_vnni:
      return "avx512_vnni";
    case cpu_isa::best:
      return "best";
  }
  return "unknown";
}

//! @brief What this build and this machine can run, probed once.
struct cpu_features {
  bool avx2 = false;         //!< AVX2 + FMA + F16C, with the OS saving the YMM registers
  bool avx512 = false;       //!< `avx2` + AVX-512 F/BW/DQ/VL, with the OS saving ZMM registers
  bool avx512_vnni = false;  //!< `avx512` + AVX512_VNNI
};

namespace cpu::detail {

inline cpu_features probe_cpu_features() noexcept {
  cpu_features f;
#if OASISKV_X86_KERNELS
  // __builtin_cpu_supports also checks that the OS saves the wide registers (XCR0). clang 14
  // does not name "f16c", so F16C is read from CPUID leaf 1, ECX bit 29.
  __builtin_cpu_init();
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
  f.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
  f.avx512 = f.avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  f.avx512_vnni = f.avx512 && __builtin_cpu_supports("avx512vnni");
#endif
  return f;
}

}  // namespace cpu::detail

//! @brief The features of this machine that this build has kernels for (all false off x86).
inline const cpu_features& detected_cpu_features() noexcept {
  static const cpu_features f = cpu::detail::probe_cpu_features();
  return f;
}

//! @brief Whether this build and this machine can run `i` (`scalar` and `best` always can; a
//! value that names no path never).
inline bool isa_supported(cpu_isa i) noexcept {
  const cpu_features& f = detected_cpu_features();
  switch (i) {
    case cpu_isa::scalar:
    case cpu_isa::best:
      return true;
    case cpu_isa::avx2:
      return f.avx2;
    case cpu_isa::avx512:
      return f.avx512;
    case cpu_isa::avx512_vnni:
      return f.avx512_vnni;
  }
  return false;
}

//! @brief Whether the resolved path `i` has the instructions of `level` (`avx512_vnni` has
//! those of `avx512`, which has those of `avx2`). How a dispatcher picks a kernel: the widest
//! one whose level `i` includes.
constexpr bool isa_includes(cpu_isa i, cpu_isa level) noexcept {
  return i != cpu_isa::best && i >= level;
}

//! @brief The path that a kernel family whose widest kernels are `widest` (a level, not `best`)
//! runs for a request of `i`. `best`: the widest path this machine supports, up to `widest`.
//! `avx512`: `avx512_vnni` where `widest` is and the machine has VNNI (it extends AVX-512, so a
//! family with VNNI kernels takes them on any AVX-512 request, as the engine's int8 products
//! do). Any other path: `i` itself, capped at `widest`. Throws `errc::unsupported` when `i` is a
//! path this build or machine cannot run. The default suits every family without VNNI kernels.
inline cpu_isa resolve_isa(cpu_isa i, cpu_isa widest = cpu_isa::avx512) {
  if (i == cpu_isa::best) {
    for (const cpu_isa c : {cpu_isa::avx512_vnni, cpu_isa::avx512, cpu_isa::avx2}) {
      if (c <= widest && isa_supported(c)) {
        return c;
      }
    }
    return cpu_isa::scalar;
  }
  if (!isa_supported(i)) [[unlikely]] {
    detail::raise(errc::unsupported, "cpu_isa ", to_string(i),
                  " is not supported by this build or CPU");
  }
  if (i == cpu_isa::avx512 && widest >= cpu_isa::avx512_vnni &&
      isa_supported(cpu_isa::avx512_vnni)) {
    return cpu_isa::avx512_vnni;
  }
  return i <= widest ? i : widest;
}

}  // namespace oasiskv
