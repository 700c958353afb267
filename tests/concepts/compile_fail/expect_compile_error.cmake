# SPDX-License-Identifier: Apache-2.0
# Builds TARGET in BUILD_DIR and succeeds only if the build fails with EXPECTED in its output and
# exactly one "error:" from the compiler (one readable diagnostic, not pages of them).
execute_process(
  COMMAND ${CMAKE_COMMAND} --build "${BUILD_DIR}" --target "${TARGET}"
  RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(all "${out}${err}")
if(result EQUAL 0)
  message(FATAL_ERROR "${TARGET} compiled, but it must be rejected with: ${EXPECTED}")
endif()
string(FIND "${all}" "${EXPECTED}" pos)
if(pos EQUAL -1)
  message(FATAL_ERROR "${TARGET} failed without the expected diagnostic '${EXPECTED}':\n${all}")
endif()
string(REGEX MATCHALL "error: " errors "${all}")
list(LENGTH errors n)
if(NOT n EQUAL 1)
  message(FATAL_ERROR "${TARGET}: expected exactly one compiler error, got ${n}:\n${all}")
endif()
message(STATUS "${TARGET}: rejected with one diagnostic: ${EXPECTED}")
