# SPDX-License-Identifier: Apache-2.0
# oasiskv::cuda: the CUDA models (include/oasiskv/cuda/*.cuh), for consumers compiling with nvcc.
# An interface target over the toolkit: it sets no CUDA architecture or standard of its own, so
# a consumer's .cu targets keep the CMAKE_CUDA_ARCHITECTURES that the consumer chose.
find_package(CUDAToolkit REQUIRED)

file(GLOB_RECURSE _oasiskv_cuda_headers CONFIGURE_DEPENDS
     RELATIVE "${PROJECT_SOURCE_DIR}" "${PROJECT_SOURCE_DIR}/include/oasiskv/cuda/*.cuh")

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
endif()
