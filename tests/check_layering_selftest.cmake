# Proves check_layering.cmake catches what it is for: on a scratch tree it must pass while the
# includes run downwards and fail, naming the file, for each upward include.
# Run as: cmake -DCHECKER=check_layering.cmake -DWORK=scratch-dir -P check_layering_selftest.cmake
cmake_minimum_required(VERSION 3.25)

file(REMOVE_RECURSE "${WORK}")
file(WRITE "${WORK}/common/status.h" "#pragma once\n#include <string>\n")
file(WRITE "${WORK}/backends/engine.h" "#pragma once\n#include \"common/status.h\"\n")
file(WRITE "${WORK}/runtime/core.cpp" "#include \"backends/engine.h\"\n#include \"common/status.h\"\n")
file(WRITE "${WORK}/lib/abi.cpp" "#include \"runtime/core.h\"\n")
file(WRITE "${WORK}/runtime/checkpoint/checkpoint.cpp"
  "#include \"runtime/checkpoint/safetensors.h\"\n#include \"runtime/core.h\"\n")
file(WRITE "${WORK}/lib/abi_checkpoint.cpp" "#include \"runtime/checkpoint/checkpoint.h\"\n")
set(failures "")

function(run_checker out_rc out_text)
  execute_process(COMMAND ${CMAKE_COMMAND} -DROOT=${WORK} -P ${CHECKER}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  set(${out_rc} ${rc} PARENT_SCOPE)
  string(REGEX REPLACE "[ \n]+" " " flat "${out}${err}")
  set(${out_text} "${flat}" PARENT_SCOPE)
endfunction()

run_checker(rc text)
if(NOT rc EQUAL 0)
  string(APPEND failures "\n  a clean tree failed: ${text}")
endif()

# expect_caught(<file> <include line> <regex the message must match>)
function(expect_caught file line regex)
  file(WRITE "${WORK}/${file}" "#pragma once\n  #  include ${line}\n")
  run_checker(rc text)
  file(REMOVE "${WORK}/${file}")
  if(rc EQUAL 0)
    set(failures "${failures}\n  ${file} including ${line}: the checker passed" PARENT_SCOPE)
  elseif(NOT text MATCHES "${regex}")
    set(failures "${failures}\n  ${file}: no '${regex}' in: ${text}" PARENT_SCOPE)
  endif()
endfunction()

expect_caught(backends/bad.h "\"runtime/status.h\"" "backends/bad.h: # include \"runtime/status.h\"")
expect_caught(common/bad.h "\"runtime/types.h\"" "common/bad.h: # include \"runtime/types.h\"")
expect_caught(common/bad.cpp "<backends/device/device_backend.h>" "common/bad.cpp")
expect_caught(runtime/bad.cpp "\"lib/abi_support.h\"" "runtime/bad.cpp")
expect_caught(runtime/optimizer/bad.cpp "\"runtime/checkpoint/checkpoint.h\""
  "runtime/optimizer/bad.cpp: # include \"runtime/checkpoint/checkpoint.h\"")

if(NOT failures STREQUAL "")
  message(FATAL_ERROR "check_layering.cmake missed an upward include:${failures}")
endif()
message(STATUS "check_layering.cmake passed the clean tree and caught all 5 upward includes")
