# SPDX-License-Identifier: Apache-2.0
# Builds and runs tests/package/consumer against OasisKV in one of four ways (MODE):
#   find_package  - install this build tree into a prefix, then find_package(oasiskv)
#   fetchcontent  - FetchContent from a file:// clone of this repository at its HEAD commit
#   subdirectory  - add_subdirectory(<this source tree>)
#   lean          - configure this source tree alone without tests, apps, examples, benchmarks, UCX
#                   or CUDA, install that, then find_package(oasiskv) from it
# Optional:
#   CHECKS               - consumer checks to switch on, comma-separated: hygiene, own_fmt
#                          (consumer/checks.cmake)
#   COMPONENTS           - components find_package must find, comma-separated; each links into
#                          a program, which then runs
#   OPTIONAL_COMPONENTS  - components find_package may find, comma-separated
#   EXPECT_MISSING       - optional components that must not be found, comma-separated
#   CONSUMER_MAIN=OFF    - skip the engine program (main.cpp), for checks of the configure step
#   NVCC                 - nvcc, put on PATH and in CUDACXX where a CUDA compiler is looked for
#   CONSUMER_CUDA=ON     - the consumer enables CUDA itself (architecture 86) and compiles a .cu
#   EXPECT_FAIL          - the consumer's configure step must fail, its output matching this regex
cmake_minimum_required(VERSION 3.25)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE r OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT r EQUAL 0)
    string(REPLACE ";" " " cmd "${ARGN}")
    message(FATAL_ERROR "failed (${r}): ${cmd}\n${out}\n${err}")
  endif()
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

# configure_consumer(<build dir> <extra args...>): configures the consumer; with EXPECT_FAIL it
# must fail with matching output instead.
function(configure_consumer dir)
  set(cmd ${CMAKE_COMMAND} ${args} -B "${dir}" ${ARGN})
  if(NOT DEFINED EXPECT_FAIL)
    run(${cmd})
    return()
  endif()
  execute_process(COMMAND ${cmd} RESULT_VARIABLE r OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(r EQUAL 0)
    message(FATAL_ERROR "the consumer's configure step succeeded; it should have failed with "
                        "'${EXPECT_FAIL}':\n${out}\n${err}")
  endif()
  # CMake wraps the lines of its messages: match against the text with its spacing collapsed.
  string(REGEX REPLACE "[ \t\r\n]+" " " text "${out}${err}")
  if(NOT text MATCHES "${EXPECT_FAIL}")
    message(FATAL_ERROR "the consumer's configure step failed without '${EXPECT_FAIL}':\n"
                        "${out}\n${err}")
  endif()
  message(STATUS "${MODE}: failed as expected, naming '${EXPECT_FAIL}'")
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(args -S "${CONSUMER_DIR}" -G "${GENERATOR}"
         -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_BUILD_TYPE=Release)

if(NVCC)
  # Where a CUDA compiler is looked for (check_language, enable_language), this one is found.
  get_filename_component(nvcc_dir "${NVCC}" DIRECTORY)
  set(ENV{PATH} "${nvcc_dir}:$ENV{PATH}")
  set(ENV{CUDACXX} "${NVCC}")
endif()
if(CONSUMER_CUDA)
  list(APPEND args -DOASISKV_CONSUMER_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=86
                   -DOASISKV_EXPECT_CUDA_ARCHITECTURES=86)
endif()
string(REPLACE "," ";" CHECKS "${CHECKS}")
if("hygiene" IN_LIST CHECKS)
  list(APPEND args -DOASISKV_CHECK_HYGIENE=ON)
endif()
if("own_fmt" IN_LIST CHECKS)
  list(APPEND args -DOASISKV_CHECK_OWN_FMT=ON "-DOASISKV_OWN_FMT_DIR=${CONSUMER_DIR}/../own_fmt")
endif()
if(DEFINED CONSUMER_MAIN AND NOT CONSUMER_MAIN)
  list(APPEND args -DOASISKV_CONSUMER_MAIN=OFF)
else()
  set(CONSUMER_MAIN ON)
endif()
foreach(list_arg IN ITEMS COMPONENTS OPTIONAL_COMPONENTS EXPECT_MISSING)  # comma-separated
  if(DEFINED ${list_arg})
    list(APPEND args "-DOASISKV_${list_arg}=${${list_arg}}")
  endif()
endforeach()

if(MODE STREQUAL "find_package" OR MODE STREQUAL "lean")
  set(installed "${BUILD_DIR}")
  if(MODE STREQUAL "lean")
    set(installed "${WORK_DIR}/oasiskv-build")
    run(${CMAKE_COMMAND} -S "${SOURCE_DIR}" -B "${installed}" -G "${GENERATOR}"
        -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_BUILD_TYPE=Release -DOASISKV_INSTALL=ON
        -DOASISKV_BUILD_TESTS=OFF -DOASISKV_BUILD_EXAMPLES=OFF -DOASISKV_BUILD_APPS=OFF
        -DOASISKV_BUILD_BENCHMARKS=OFF
        -DOASISKV_ENABLE_UCX=OFF -DOASISKV_ENABLE_CUDA=OFF)
  endif()
  run(${CMAKE_COMMAND} --install "${installed}" --prefix "${WORK_DIR}/prefix")
  if(NOT EXISTS "${WORK_DIR}/prefix/include/oasiskv/oasiskv.hpp")
    message(FATAL_ERROR "install did not place include/oasiskv/oasiskv.hpp")
  endif()
  list(APPEND args -DOASISKV_CONSUME=find_package "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix")
elseif(MODE STREQUAL "fetchcontent")
  find_package(Git REQUIRED)
  run(${GIT_EXECUTABLE} -C "${SOURCE_DIR}" rev-parse HEAD)
  string(STRIP "${last_output}" head)
  list(APPEND args -DOASISKV_CONSUME=fetchcontent
                   "-DOASISKV_GIT_URL=file://${SOURCE_DIR}" "-DOASISKV_GIT_TAG=${head}")
elseif(MODE STREQUAL "subdirectory")
  list(APPEND args -DOASISKV_CONSUME=subdirectory "-DOASISKV_SOURCE_DIR=${SOURCE_DIR}")
else()
  message(FATAL_ERROR "unknown MODE '${MODE}'")
endif()

configure_consumer("${WORK_DIR}/build")
if(DEFINED EXPECT_FAIL)
  return()
endif()
run(${CMAKE_COMMAND} --build "${WORK_DIR}/build")
# The component programs run too: each reports what it linked (none needs a device or a peer).
string(REPLACE "," ";" programs "${COMPONENTS}")
if(CONSUMER_CUDA)
  list(APPEND programs cuda_device)
endif()
foreach(program IN LISTS programs)
  run("${WORK_DIR}/build/consumer_${program}")
  if(NOT last_output MATCHES "^${program}: ")
    message(FATAL_ERROR "consumer_${program} did not report itself:\n${last_output}")
  endif()
  message(STATUS "${MODE}: ${last_output}")
endforeach()
if(CONSUMER_MAIN)
  run("${WORK_DIR}/build/consumer")
  if(NOT last_output MATCHES "consumer ok")
    message(FATAL_ERROR "consumer ran but did not report success:\n${last_output}")
  endif()
  message(STATUS "${MODE}: ${last_output}")
else()
  message(STATUS "${MODE}: consumer configured and built (checks: ${CHECKS}; "
                 "components: ${COMPONENTS})")
endif()
