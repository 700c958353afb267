// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Opens the intrinsics of a CPU kernel file; `kernel_end.hpp` closes them. Every x86
//! kernel file (`*_avx2.hpp`, `*_avx512.hpp`, `*_avx512_vnni.hpp`) includes the pair around its
//! code, inside its `#if OASISKV_X86_KERNELS`, so the diagnostics that its compilers report
//! falsely there are silenced in one place. No include guard: each kernel file includes it once.

// gcc 12 before 12.3 (PR 105593) flags the `__m512 __Y = __Y;` inside its own
// `_mm512_undefined_*` helpers, which the unmasked AVX-512 intrinsics start from, as
// (maybe-)uninitialized once they are inlined into a kernel; its AVX2 headers trip the same
// warnings under -O2.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
