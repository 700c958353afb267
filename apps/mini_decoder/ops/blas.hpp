// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief Which OpenBLAS kernels the prefill's products run on.
//!
//! Debian's OpenBLAS (0.3.21, built for every x86 core) picks its kernels from the CPU model in
//! its own constructor, before `main`, reading `OPENBLAS_CORETYPE` there; on the CPUs this
//! project measures on, its own pick runs the prefill's sgemm about 3x slower than its Haswell
//! kernels (34 against 103 prefill tokens/s at 8k). Setting the variable from the program cannot
//! work in-process: the libraries' constructors run before `main`, and one set earlier (an
//! executable's `.preinit_array`) is undone when the C library's own initialisation resets the
//! environment. So `choose_blas_kernels` starts the program again with it set.
#pragma once

#include <string>

namespace mini_decoder {

//! Where `OPENBLAS_CORETYPE` is unset and the CPU has AVX2 and FMA: sets it to Haswell and
//! executes `/proc/self/exe` with `argv` again (so returns only where it did nothing, or where
//! the exec failed: then OpenBLAS keeps its own pick). A value the user set wins. Call first
//! thing in `main`, before any thread starts.
void choose_blas_kernels(char** argv);

//! The kernels OpenBLAS runs ("Haswell", "SkylakeX", ...) and who chose them: "(chosen for this
//! AVX2 CPU)", "(OPENBLAS_CORETYPE)" or "(OpenBLAS's own pick)".
std::string blas_kernels();

}  // namespace mini_decoder
