# SPDX-License-Identifier: Apache-2.0
# oasiskv::cuda: the CUDA models (every include/oasiskv/**/*.cuh: each concept's cuda/ folder, and
# the runtime helpers of include/oasiskv/cuda/), for consumers compiling with nvcc.
# An interface target over the toolkit: it sets no CUDA architecture or standard of its own, so
# a consumer's .cu targets keep the CMAKE_CUDA_ARCHITECTURES that the consumer chose.
find_package(CUDAToolkit REQUIRED)

file(GLOB_RECURSE _oasiskv_cuda_headers CONFIGURE_DEPENDS
     RELATIVE "${PROJECT_SOURCE_DIR}" "${PROJECT_SOURCE_DIR}/include/oasiskv/*.cuh")

add_library(oasiskv_cuda INTERFACE)
add_library(oasiskv::cuda ALIAS oasiskv_cuda)
target_link_libraries(oasiskv_cuda INTERFACE oasiskv CUDA::cudart)
target_compile_options(oasiskv_cuda INTERFACE
  $<$<COMPILE_LANGUAGE:CUDA>:--extended-lambda --expt-relaxed-constexpr>)
target_sources(oasiskv_cuda INTERFACE
  FILE_SET HEADERS BASE_DIRS "${PROJECT_SOURCE_DIR}/include" FILES ${_oasiskv_cuda_headers})
set_target_properties(oasiskv_cuda PROPERTIES EXPORT_NAME cuda)

# The settings of the project's own CUDA binaries (tests, benchmarks): defined only when those
# are built, never applied to a consumer's targets.
if(_oasiskv_own_binaries)
  set(OASISKV_CUDA_ARCHITECTURES "80;90" CACHE STRING
      "CUDA architectures of the project's own CUDA binaries (-gencode pairs)")

  # oasiskv_cuda_target(<target>): the project's settings for one of its CUDA binaries.
  function(oasiskv_cuda_target target)
    set_target_properties(${target} PROPERTIES
      CUDA_ARCHITECTURES "${OASISKV_CUDA_ARCHITECTURES}"
      CUDA_EXTENSIONS OFF)
    # CMake 3.25 does not know nvcc 13's C++20 flag; pass it directly for CUDA sources only.
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
    target_link_libraries(${target} PRIVATE oasiskv_cuda)
  endfunction()

  # FlashInfer's headers (optional): cuda::flashinfer_decode's test and benchmark rows are built
  # only where they are found. scripts/fetch-flashinfer.sh puts them in third_party_cache/.
  if(OASISKV_FLASHINFER_INCLUDE_DIR AND
     NOT EXISTS "${OASISKV_FLASHINFER_INCLUDE_DIR}/flashinfer/attention/decode.cuh")
    # Found once, removed since (a cleaned third_party_cache/): look again.
    unset(OASISKV_FLASHINFER_INCLUDE_DIR CACHE)
  endif()
  find_path(OASISKV_FLASHINFER_INCLUDE_DIR
    NAMES flashinfer/attention/decode.cuh
    PATHS "${PROJECT_SOURCE_DIR}/third_party_cache/flashinfer/include"
    NO_DEFAULT_PATH
    DOC "FlashInfer's include folder (holds flashinfer/attention/decode.cuh), for the optional "
        "cuda::flashinfer_decode test and benchmark rows")
  if(OASISKV_FLASHINFER_INCLUDE_DIR)
    add_library(oasiskv_flashinfer_headers INTERFACE)
    target_include_directories(oasiskv_flashinfer_headers SYSTEM INTERFACE
      "${OASISKV_FLASHINFER_INCLUDE_DIR}")
    # FlashInfer's decode kernel uses sm_80 instructions (cp.async): its binaries leave out the
    # older architectures of OASISKV_CUDA_ARCHITECTURES.
    set(OASISKV_FLASHINFER_ARCHITECTURES "")
    foreach(_arch IN LISTS OASISKV_CUDA_ARCHITECTURES)
      string(REGEX MATCH "^[0-9]+" _arch_number "${_arch}")
      if(_arch_number AND _arch_number GREATER_EQUAL 80)
        list(APPEND OASISKV_FLASHINFER_ARCHITECTURES "${_arch}")
      endif()
    endforeach()
    if(OASISKV_FLASHINFER_ARCHITECTURES)
      message(STATUS "FlashInfer headers: ${OASISKV_FLASHINFER_INCLUDE_DIR} "
                     "(cuda::flashinfer_decode test and benchmark rows built)")
    else()
      message(STATUS "FlashInfer headers found but no architecture >= 80 in "
                     "OASISKV_CUDA_ARCHITECTURES: the FlashInfer test is not built")
    endif()
  else()
    message(STATUS "FlashInfer headers not found: the cuda::flashinfer_decode test and benchmark "
                   "rows are not built (run scripts/fetch-flashinfer.sh, or set "
                   "-DOASISKV_FLASHINFER_INCLUDE_DIR=<folder holding flashinfer/>)")
  endif()
endif()
