# SPDX-License-Identifier: Apache-2.0
# What this project must and must not see once OasisKV is added, and one program per component.
# Each check is switched on by the run script (run_consumer.cmake); a violation stops the
# configure step with the reason.

function(consumer_fail)
  string(CONCAT _what ${ARGN})
  message(FATAL_ERROR "consumer check failed: ${_what}")
endfunction()

# consumer_targets_under(<dir> <out>): the build-system targets of <dir> and its subdirectories.
function(consumer_targets_under dir out)
  get_property(_targets DIRECTORY "${dir}" PROPERTY BUILDSYSTEM_TARGETS)
  get_property(_subdirs DIRECTORY "${dir}" PROPERTY SUBDIRECTORIES)
  foreach(_sub IN LISTS _subdirs)
    consumer_targets_under("${_sub}" _more)
    list(APPEND _targets ${_more})
  endforeach()
  set(${out} "${_targets}" PARENT_SCOPE)
endfunction()

# Adding OasisKV (subdirectory or FetchContent) leaves nothing of its own build in this project:
# no target but the library's (each with an oasiskv:: alias), none of its CUDA settings, and,
# where this project did not enable CUDA, no CUDA at all.
if(OASISKV_CHECK_HYGIENE)
  if(NOT OASISKV_CONSUME MATCHES "^(subdirectory|fetchcontent)$")
    consumer_fail("OASISKV_CHECK_HYGIENE needs the subdirectory or fetchcontent mode")
  endif()
  if(TARGET oasiskv_project_options)
    consumer_fail("the project's own target oasiskv_project_options exists here")
  endif()
  consumer_targets_under("${oasiskv_SOURCE_DIR}" _oasiskv_targets)
  set(_library_targets oasiskv oasiskv_fmt oasiskv_file oasiskv_ucx oasiskv_cuda)
  foreach(_target IN LISTS _oasiskv_targets)
    if(NOT _target IN_LIST _library_targets)
      consumer_fail("OasisKV defined the target '${_target}' in this project")
    endif()
  endforeach()
  if(COMMAND oasiskv_cuda_target)
    consumer_fail("oasiskv_cuda_target(), for the project's own CUDA binaries, is defined here")
  endif()
  if(DEFINED CACHE{OASISKV_CUDA_ARCHITECTURES})
    consumer_fail("OASISKV_CUDA_ARCHITECTURES is in this project's cache")
  endif()
  if(NOT OASISKV_CONSUMER_CUDA)
    foreach(_var IN ITEMS CMAKE_CUDA_COMPILER CMAKE_CUDA_ARCHITECTURES)
      if(DEFINED CACHE{${_var}})
        consumer_fail("${_var} is in the cache of a project that never enabled CUDA: "
                      "'$CACHE{${_var}}'")
      endif()
    endforeach()
    get_property(_languages GLOBAL PROPERTY ENABLED_LANGUAGES)
    if("CUDA" IN_LIST _languages)
      consumer_fail("CUDA is enabled in a project that never enabled it")
    endif()
    if(TARGET oasiskv::cuda)
      consumer_fail("oasiskv::cuda exists in a project that never enabled CUDA")
    endif()
  elseif(NOT TARGET oasiskv::cuda)
    consumer_fail("a project with CUDA enabled gets no oasiskv::cuda")
  endif()
endif()

# This project's own fmt, declared after OasisKV was added: FetchContent takes the first
# declaration of a name, so the marker target exists only if OasisKV declared no fmt of its own.
if(OASISKV_CHECK_OWN_FMT)
  include(FetchContent)
  FetchContent_Declare(fmt SOURCE_DIR "${OASISKV_OWN_FMT_DIR}")
  FetchContent_MakeAvailable(fmt)
  if(NOT TARGET own_fmt_marker)
    consumer_fail("FetchContent_MakeAvailable(fmt) did not use this project's declaration "
                  "(another FetchContent_Declare(fmt) came first)")
  endif()
endif()

# Components (find_package mode): each required one is found and links into a program.
foreach(_comp IN LISTS OASISKV_COMPONENTS)
  if(NOT oasiskv_${_comp}_FOUND OR NOT TARGET oasiskv::${_comp})
    consumer_fail("required component '${_comp}' has no oasiskv_${_comp}_FOUND or no target")
  endif()
  add_executable(consumer_${_comp} components/${_comp}.cpp)
  target_link_libraries(consumer_${_comp} PRIVATE oasiskv::${_comp})
  target_compile_options(consumer_${_comp} PRIVATE -Wall -Wextra -Werror)
endforeach()
foreach(_comp IN LISTS OASISKV_EXPECT_MISSING)
  if(NOT DEFINED oasiskv_${_comp}_FOUND)
    consumer_fail("oasiskv_${_comp}_FOUND is not set")
  elseif(oasiskv_${_comp}_FOUND)
    consumer_fail("component '${_comp}' was found, though the installed build lacks it")
  endif()
endforeach()
if("cuda" IN_LIST OASISKV_COMPONENTS)
  # The installed headers of oasiskv::cuda, through its header set.
  get_target_property(_dirs oasiskv::cuda HEADER_DIRS)
  get_target_property(_headers oasiskv::cuda HEADER_SET)
  if(NOT _dirs OR NOT _headers)
    consumer_fail("oasiskv::cuda has no header set")
  endif()
  foreach(_path IN LISTS _dirs _headers)
    if(NOT EXISTS "${_path}")
      consumer_fail("oasiskv::cuda names '${_path}', which does not exist")
    endif()
  endforeach()
  list(TRANSFORM _dirs APPEND "/oasiskv/cuda/cuda.cuh" OUTPUT_VARIABLE _umbrella)
  if(NOT EXISTS "${_umbrella}")
    consumer_fail("oasiskv::cuda's include directory has no oasiskv/cuda/cuda.cuh")
  endif()
endif()

# Where this project enabled CUDA: a .cu of its own compiles against oasiskv::cuda, with the
# CUDA architectures this project chose (OasisKV sets none on a consumer's targets).
if(OASISKV_CONSUMER_CUDA)
  add_executable(consumer_cuda_device components/cuda_device.cu)
  target_link_libraries(consumer_cuda_device PRIVATE oasiskv::cuda)
  # CMake 3.25 does not know nvcc 13's C++20 flag.
  target_compile_options(consumer_cuda_device PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
  get_target_property(_archs consumer_cuda_device CUDA_ARCHITECTURES)
  if(NOT "${_archs}" STREQUAL "${OASISKV_EXPECT_CUDA_ARCHITECTURES}"
     OR NOT "${CMAKE_CUDA_ARCHITECTURES}" STREQUAL "${OASISKV_EXPECT_CUDA_ARCHITECTURES}")
    consumer_fail("CUDA architectures are '${_archs}' (target) and '${CMAKE_CUDA_ARCHITECTURES}' "
                  "(project), not this project's '${OASISKV_EXPECT_CUDA_ARCHITECTURES}'")
  endif()
endif()
