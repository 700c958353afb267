// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Closes what `kernel_begin.hpp` opened. No include guard: each kernel file includes it
//! once, after its code.

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
