// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Which integer dot-product kernels (int8 activations against quantized weights) a CPU
//! path runs. The paths are the library's `oasiskv::cpu_isa`, the one ISA layer of the project.
#pragma once

#include "oasiskv/cpu/isa.hpp"

namespace mini_decoder {

//! @brief The integer dot-product kernels that path `isa` runs: `avx512_vnni` (vpdpbusd),
//! `avx2` (maddubs/madd; also on AVX-512 without VNNI) or `scalar` (the reference). `best`
//! gives the widest this machine runs. Throws `decoder_error` for a path this build or CPU
//! cannot run, or a value that names no path.
oasiskv::cpu_isa int_dot_path(oasiskv::cpu_isa isa);

}  // namespace mini_decoder
