// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The integer dot products' code paths, chosen at run time.
#pragma once

#include <cstdint>

namespace mini_decoder {

//! Integer dot-product code paths: scalar reference, AVX2 (maddubs/madd), AVX-512 with VNNI
//! (vpdpbusd).
enum class dot_isa : std::uint8_t { scalar, avx2, avx512_vnni };

//! "scalar", "avx2" or "avx512_vnni".
const char* to_string(dot_isa i);

//! Whether this build and this CPU can run `i` (`scalar` always can).
bool dot_isa_supported(dot_isa i);

}  // namespace mini_decoder
