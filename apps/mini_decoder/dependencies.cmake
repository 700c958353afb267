# SPDX-License-Identifier: Apache-2.0
# What the mini-decoder needs beyond the library: OpenBLAS (cblas.h; the ops and model parts),
# CLI11 and fmt (the CLI, the throughput benchmark), nlohmann/json (the server part), cpp-httplib
# (the server's tests, as their HTTP client; the server has its own event loop), and OpenMP
# (tools/accuracy and bench/matvec.bench.cpp).
# Included by apps/mini_decoder, tools/accuracy and tests/ (tests are configured first); sets
# MINI_DECODER_DEPS_FOUND. Where something is missing the engine, the tools on it and their
# tests are skipped, never the rest of the tree.
if(NOT DEFINED MINI_DECODER_DEPS_FOUND)
  find_package(OpenMP QUIET COMPONENTS CXX)
  set(BLA_VENDOR OpenBLAS)
  find_package(BLAS QUIET)
  find_path(MINI_DECODER_CBLAS_INCLUDE cblas.h PATH_SUFFIXES openblas)
  find_package(CLI11 CONFIG QUIET)
  find_package(nlohmann_json 3 CONFIG QUIET)
  # Debian's cpp-httplib is a shared library whose header must see the defines it was built
  # with (TLS, zlib, brotli): pkg-config gives both. One global target for every directory.
  find_package(PkgConfig QUIET)
  if(PkgConfig_FOUND AND NOT TARGET PkgConfig::MINI_DECODER_HTTPLIB)
    pkg_check_modules(MINI_DECODER_HTTPLIB QUIET IMPORTED_TARGET GLOBAL cpp-httplib)
  endif()
  if(OpenMP_CXX_FOUND AND BLAS_FOUND AND MINI_DECODER_CBLAS_INCLUDE AND TARGET CLI11::CLI11
     AND TARGET fmt::fmt AND TARGET nlohmann_json::nlohmann_json
     AND TARGET PkgConfig::MINI_DECODER_HTTPLIB)
    set(MINI_DECODER_DEPS_FOUND TRUE)
  else()
    set(MINI_DECODER_DEPS_FOUND FALSE)
    message(STATUS "mini_decoder skipped: needs OpenMP, OpenBLAS (libopenblas-dev), "
                   "CLI11 (libcli11-dev), fmt (libfmt-dev), cpp-httplib (libcpp-httplib-dev, "
                   "pkg-config) and nlohmann/json (nlohmann-json3-dev)")
  endif()
endif()
