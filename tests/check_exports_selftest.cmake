# Proves check_exports.cmake catches what it is for: it runs the checker on the real library with
# copies of lib/strata.map and strata.h broken in one way each, and fails unless every run fails
# with the message that names the problem.
# Run as: cmake -DLIB=... -DNM=nm -DMAP=lib/strata.map -DHEADER=strata.h
#               -DCHECKER=check_exports.cmake -DWORK=scratch-dir -P check_exports_selftest.cmake
cmake_minimum_required(VERSION 3.25)

file(READ "${MAP}" map)
file(READ "${HEADER}" header)
file(MAKE_DIRECTORY "${WORK}")
set(failures "")

# expect_failure(<case> <map text> <header text> <regex the checker's output must match>)
function(expect_failure name map_text header_text regex)
  file(WRITE "${WORK}/${name}.map" "${map_text}")
  file(WRITE "${WORK}/${name}.h" "${header_text}")
  execute_process(
    COMMAND ${CMAKE_COMMAND} -DLIB=${LIB} -DNM=${NM} -DMAP=${WORK}/${name}.map
            -DHEADER=${WORK}/${name}.h -P ${CHECKER}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(REGEX REPLACE "[ \n]+" " " flat "${out}${err}")  # CMake wraps long messages
  if(rc EQUAL 0)
    set(failures "${failures}\n  ${name}: the checker passed" PARENT_SCOPE)
  elseif(NOT flat MATCHES "${regex}")
    set(failures "${failures}\n  ${name}: no '${regex}' in:\n${out}${err}" PARENT_SCOPE)
  endif()
endfunction()

function(replace_once text from to out_var)
  string(FIND "${text}" "${from}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "check_exports_selftest: '${from}' not found; update this test")
  endif()
  string(REPLACE "${from}" "${to}" text "${text}")
  set(${out_var} "${text}" PARENT_SCOPE)
endfunction()

# A 1.1 function slipped into STRATA_1.0.
replace_once("${map}" "    strata_step_abort;\n" "" m)
replace_once("${m}" "    strata_version;\n" "    strata_version;\n    strata_step_abort;\n" m)
expect_failure(moved_into_1_0 "${m}" "${header}"
  "declares strata_step_abort STRATA_API_SINCE\\(1, 1\\), so it belongs to STRATA_1.1, but lib/strata.map first lists it under STRATA_1.0")

# A 1.1 function declared as if it were 1.0.
replace_once("${header}" "STRATA_API_SINCE(1, 1) strata_status_t strata_step_abort("
             "STRATA_API strata_status_t strata_step_abort(" h)
expect_failure(declared_as_1_0 "${map}" "${h}"
  "strata_step_abort STRATA_API, so it belongs to STRATA_1.0, but lib/strata.map first lists it under STRATA_1.1")

# A function the library exports that the map does not list.
replace_once("${map}" "    strata_trace_stop;\n" "" m)
expect_failure(unlisted "${m}" "${header}"
  "libstrata.so exports strata_trace_stop@@STRATA_1.0, which lib/strata.map does not list")

# A compat symbol the map lists in its old node only.
replace_once("${map}" "STRATA_1.2 {\n  global:\n    strata_optimizer_config_init;\n"
             "STRATA_1.2 {\n  global:\n" m)
expect_failure(compat_unlisted "${m}" "${header}"
  "libstrata.so exports strata_optimizer_config_init@@STRATA_1.2, which lib/strata.map does not list that way")

# A pattern instead of names.
replace_once("${map}" "    strata_version;\n" "    strata_version;\n    strata_*;\n" m)
expect_failure(pattern "${m}" "${header}" "lists 'strata_\\*' under STRATA_1.0: list exported functions by name")

# A node for a release after the header's version.
string(APPEND m2 "${map}" "\nSTRATA_1.99 {\n  global:\n    strata_trace_stop;\n} STRATA_1.2;\n")
expect_failure(future_node "${m2}" "${header}" "has node STRATA_1.99, not a release of ABI")

# A listed function the header does not declare.
replace_once("${map}" "    strata_version;\n" "    strata_version;\n    strata_no_such_function;\n" m)
expect_failure(undeclared "${m}" "${header}"
  "lists strata_no_such_function, which strata.h does not declare")

if(NOT failures STREQUAL "")
  message(FATAL_ERROR "check_exports.cmake missed a broken ABI record:${failures}")
endif()
message(STATUS "check_exports.cmake caught all 7 broken records")
