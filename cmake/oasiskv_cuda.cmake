# oasiskv::cuda: the CUDA models (include/oasiskv/cuda/*.cuh), for consumers compiling with nvcc.
find_package(CUDAToolkit REQUIRED)

set(OASISKV_CUDA_ARCHITECTURES "80;90" CACHE STRING
    "CUDA architectures of the project's own CUDA binaries (-gencode pairs)")

add_library(oasiskv_cuda INTERFACE)
add_library(oasiskv::cuda ALIAS oasiskv_cuda)
target_link_libraries(oasiskv_cuda INTERFACE oasiskv CUDA::cudart)
target_compile_options(oasiskv_cuda INTERFACE
  $<$<COMPILE_LANGUAGE:CUDA>:--extended-lambda --expt-relaxed-constexpr>)
set_target_properties(oasiskv_cuda PROPERTIES EXPORT_NAME cuda)

# oasiskv_cuda_target(<target>): the project's settings for one of its CUDA binaries.
function(oasiskv_cuda_target target)
  set_target_properties(${target} PROPERTIES
    CUDA_ARCHITECTURES "${OASISKV_CUDA_ARCHITECTURES}"
    CUDA_EXTENSIONS OFF)
  # CMake 3.25 does not know nvcc 13's C++20 flag; pass it directly for CUDA sources only.
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
  target_link_libraries(${target} PRIVATE oasiskv_cuda)
endfunction()
