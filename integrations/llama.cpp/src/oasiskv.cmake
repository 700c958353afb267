# SPDX-License-Identifier: Apache-2.0
# Included by llama.cpp's src/CMakeLists.txt (patches/0001): puts OasisKV's memory type into
# libllama. LLAMA_OASISKV_DIR is an OasisKV checkout, brought in with FetchContent as any engine
# would (its tests, apps and install rules stay off in a consumer's build).
if(NOT LLAMA_OASISKV_DIR OR NOT EXISTS "${LLAMA_OASISKV_DIR}/include/oasiskv/kv_cache.hpp")
  message(FATAL_ERROR "llama.cpp with OasisKV: set LLAMA_OASISKV_DIR to an OasisKV checkout "
                      "(integrations/llama.cpp/build.sh does)")
endif()

include(FetchContent)
FetchContent_Declare(oasiskv SOURCE_DIR "${LLAMA_OASISKV_DIR}")
FetchContent_MakeAvailable(oasiskv)

set(_oasiskv_llama_src "${LLAMA_OASISKV_DIR}/integrations/llama.cpp/src")

# The OasisKV side: C++20, in its own static library behind the narrow interface of
# oasiskv-bridge.h (libllama stays C++17). One translation unit per capacity tier, so that a
# parallel build compiles the two sets of cache instantiations at once.
add_library(llama-oasiskv STATIC
  "${_oasiskv_llama_src}/oasiskv-bridge.cpp"
  "${_oasiskv_llama_src}/oasiskv-bridge-host.cpp"
  "${_oasiskv_llama_src}/oasiskv-bridge-file.cpp")
target_link_libraries(llama-oasiskv PRIVATE oasiskv::oasiskv)
target_include_directories(llama-oasiskv PUBLIC "${_oasiskv_llama_src}")
set_target_properties(llama-oasiskv PROPERTIES POSITION_INDEPENDENT_CODE ON)

# The llama.cpp side: the memory type, the graph input and the custom operations (C++17).
set(_oasiskv_llama_sources
  "${_oasiskv_llama_src}/llama-memory-oasis.cpp"
  "${_oasiskv_llama_src}/llama-memory-oasis-seq.cpp"
  "${_oasiskv_llama_src}/llama-memory-oasis-graph.cpp")
target_sources(llama PRIVATE ${_oasiskv_llama_sources})
set_source_files_properties(${_oasiskv_llama_sources} PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
target_include_directories(llama PRIVATE "${_oasiskv_llama_src}")
target_link_libraries(llama PRIVATE llama-oasiskv)
