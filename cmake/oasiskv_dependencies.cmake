# SPDX-License-Identifier: Apache-2.0
# Third-party dependencies of the project's own tests, examples and benchmarks: the system's
# packages through find_package first, FetchContent as the fallback (FIND_PACKAGE_ARGS). The core
# target uses none of them.
#
# In a consumer's build (OasisKV added to another project without its own binaries) nothing is
# declared to FetchContent: the first declaration of a name wins, so one made here would take the
# place of the consumer's own later FetchContent_Declare(fmt ...).
if(_oasiskv_own_binaries)
  include(FetchContent)
endif()

macro(oasiskv_find_fmt)
  if(NOT TARGET fmt::fmt)
    if(_oasiskv_own_binaries)
      FetchContent_Declare(fmt
        GIT_REPOSITORY https://github.com/fmtlib/fmt.git
        GIT_TAG 10.2.1
        GIT_SHALLOW TRUE
        FIND_PACKAGE_ARGS 9 CONFIG)
      FetchContent_MakeAvailable(fmt)
    else()
      # A consumer's build: use fmt (for oasiskv::fmt) only if it is there; never fetch it.
      find_package(fmt 9 QUIET CONFIG)
    endif()
  endif()
endmacro()

macro(oasiskv_find_doctest)
  if(NOT TARGET doctest::doctest)
    FetchContent_Declare(doctest
      GIT_REPOSITORY https://github.com/doctest/doctest.git
      GIT_TAG v2.4.11
      GIT_SHALLOW TRUE
      FIND_PACKAGE_ARGS 2.4 CONFIG)
    FetchContent_MakeAvailable(doctest)
  endif()
endmacro()

macro(oasiskv_find_benchmark)
  if(NOT TARGET benchmark::benchmark)
    set(BENCHMARK_ENABLE_TESTING OFF CACHE BOOL "" FORCE)
    set(BENCHMARK_ENABLE_INSTALL OFF CACHE BOOL "" FORCE)
    FetchContent_Declare(benchmark
      GIT_REPOSITORY https://github.com/google/benchmark.git
      GIT_TAG v1.8.3
      GIT_SHALLOW TRUE
      FIND_PACKAGE_ARGS 1.7 CONFIG)
    FetchContent_MakeAvailable(benchmark)
  endif()
endmacro()
