# SPDX-License-Identifier: Apache-2.0
# What the mini-decoder needs beyond the library: OpenMP, OpenBLAS (cblas.h), CLI11 and fmt.
# Included by apps/mini_decoder, tools/accuracy and tests/ (tests are configured first); sets
# MINI_DECODER_DEPS_FOUND. Where something is missing the engine, the tools on it and their
# tests are skipped, never the rest of the tree.
if(NOT DEFINED MINI_DECODER_DEPS_FOUND)
  find_package(OpenMP QUIET COMPONENTS CXX)
  set(BLA_VENDOR OpenBLAS)
  find_package(BLAS QUIET)
  find_path(MINI_DECODER_CBLAS_INCLUDE cblas.h PATH_SUFFIXES openblas)
  find_package(CLI11 CONFIG QUIET)
  if(OpenMP_CXX_FOUND AND BLAS_FOUND AND MINI_DECODER_CBLAS_INCLUDE AND TARGET CLI11::CLI11
     AND TARGET fmt::fmt)
    set(MINI_DECODER_DEPS_FOUND TRUE)
  else()
    set(MINI_DECODER_DEPS_FOUND FALSE)
    message(STATUS "mini_decoder skipped: needs OpenMP, OpenBLAS (libopenblas-dev), "
                   "CLI11 (libcli11-dev) and fmt (libfmt-dev)")
  endif()
endif()
