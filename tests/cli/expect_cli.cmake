# SPDX-License-Identifier: Apache-2.0
# Runs one command line of a CLI and checks how it ends:
#   cmake -DCMD=<;-list> -DEXPECT=ok|error [-DREGEX=<regex>] -P expect_cli.cmake
# ok: exit code 0. error: a non-zero exit code, no crash (no signal, no sanitizer report), and
# exactly one line of stderr that starts with "<program>: error" or names the problem, matching
# REGEX (which should name the offending value).
cmake_minimum_required(VERSION 3.25)
execute_process(COMMAND ${CMD} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err
                TIMEOUT 60)
string(REPLACE ";" " " cmdline "${CMD}")
if(EXPECT STREQUAL "ok")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "'${cmdline}' exited with '${rc}', expected 0\n${out}\n${err}")
  endif()
  if(DEFINED REGEX AND NOT "${out}${err}" MATCHES "${REGEX}")
    message(FATAL_ERROR "'${cmdline}': output does not match '${REGEX}'\n${out}\n${err}")
  endif()
elseif(EXPECT STREQUAL "error")
  if(NOT rc MATCHES "^[0-9]+$" OR rc EQUAL 0 OR rc GREATER 125)
    message(FATAL_ERROR "'${cmdline}' ended with '${rc}', expected an error exit code\n${out}\n${err}")
  endif()
  string(STRIP "${err}" e)
  # The first line is the error; a usage text may follow it.
  string(REGEX MATCH "^[^\n]*" first "${e}")
  if(first STREQUAL "")
    message(FATAL_ERROR "'${cmdline}' failed without a message on stderr\n${out}")
  endif()
  if(e MATCHES "AddressSanitizer|UndefinedBehaviorSanitizer|runtime error|terminate called|Aborted")
    message(FATAL_ERROR "'${cmdline}' crashed\n${err}")
  endif()
  if(DEFINED REGEX AND NOT first MATCHES "${REGEX}")
    message(FATAL_ERROR "'${cmdline}': its error line does not match '${REGEX}':\n${first}")
  endif()
  message(STATUS "${first}")
else()
  message(FATAL_ERROR "EXPECT must be ok or error, not '${EXPECT}'")
endif()
