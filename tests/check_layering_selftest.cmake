# Proves check_layering.cmake catches what it is for: on a scratch tree it must pass while the
# includes run downwards (between the layers and between the parts of runtime/) and fail, naming
# the file, for each upward include and for a folder of runtime/ that the parts' order lacks.
# Run as: cmake -DCHECKER=check_layering.cmake -DWORK=scratch-dir -P check_layering_selftest.cmake
cmake_minimum_required(VERSION 3.25)

file(REMOVE_RECURSE "${WORK}")
file(WRITE "${WORK}/common/status.h" "#pragma once\n#include <string>\n")
file(WRITE "${WORK}/backends/engine.h" "#pragma once\n#include \"common/status.h\"\n")
file(WRITE "${WORK}/runtime/core.cpp" "#include \"backends/engine.h\"\n#include \"common/status.h\"\n")
file(WRITE "${WORK}/lib/abi.cpp" "#include \"runtime/core.h\"\n")
# Every part of runtime/, each including the parts below it (and its own headers).
file(WRITE "${WORK}/runtime/memory/arena.h" "#pragma once\n#include \"common/status.h\"\n")
file(WRITE "${WORK}/runtime/memory/arena.cpp" "#include \"runtime/memory/arena.h\"\n")
file(WRITE "${WORK}/runtime/nvme/nvme_tier.h"
  "#pragma once\n#include \"backends/engine.h\"\n#include \"runtime/memory/arena.h\"\n")
file(WRITE "${WORK}/runtime/trace/trace.h" "#pragma once\n#include \"common/status.h\"\n")
file(WRITE "${WORK}/runtime/core.h" "#pragma once\n#include \"runtime/memory/arena.h\"\n"
  "#include \"runtime/nvme/nvme_tier.h\"\n#include \"runtime/trace/trace.h\"\n")
file(WRITE "${WORK}/runtime/stream/executor.h" "#pragma once\n#include \"runtime/core.h\"\n"
  "#include \"runtime/memory/arena.h\"\n")
file(WRITE "${WORK}/runtime/optimizer/optimizer.h" "#pragma once\n#include \"runtime/core.h\"\n"
  "#include \"runtime/stream/executor.h\"\n#include \"runtime/nvme/nvme_tier.h\"\n")
file(WRITE "${WORK}/runtime/checkpoint/checkpoint.cpp"
  "#include \"runtime/checkpoint/safetensors.h\"\n#include \"runtime/core.h\"\n"
  "#include \"runtime/optimizer/optimizer.h\"\n")
file(WRITE "${WORK}/runtime/placement/placement.h" "#pragma once\n#include \"common/status.h\"\n")
file(WRITE "${WORK}/runtime/placement/placement.cpp" "#include \"runtime/placement/placement.h\"\n")
file(WRITE "${WORK}/lib/abi_checkpoint.cpp" "#include \"runtime/checkpoint/checkpoint.h\"\n")
file(WRITE "${WORK}/lib/abi_placement.cpp"
  "#include \"runtime/placement/placement.h\"\n#include \"runtime/optimizer/optimizer.h\"\n")
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
# Inside runtime/: an include against the parts' order, one for each kind of step the order has
# (up one part, up several, into the Runtime's own files, out of them upwards, between parts
# beside each other, and into or out of the part that stands apart).
expect_caught(runtime/memory/bad.h "\"runtime/nvme/nvme_tier.h\""
  "runtime/memory/bad.h: # include \"runtime/nvme/nvme_tier.h\" \\(runtime/memory/ may not include runtime/nvme/\\)")
expect_caught(runtime/memory/deep/bad.cpp "<runtime/stream/executor.h>"
  "runtime/memory/deep/bad.cpp: # include <runtime/stream/executor.h> \\(runtime/memory/ may not")
expect_caught(runtime/nvme/bad.cpp "\"runtime/core.h\""
  "runtime/nvme/bad.cpp: # include \"runtime/core.h\" \\(runtime/nvme/ may not include the files directly in runtime/\\)")
expect_caught(runtime/bad.h "\"runtime/stream/executor.h\""
  "runtime/bad.h: # include \"runtime/stream/executor.h\" \\(the files directly in runtime/ may not include runtime/stream/\\)")
expect_caught(runtime/trace/bad.h "\"runtime/memory/arena.h\""
  "runtime/trace/bad.h: # include \"runtime/memory/arena.h\" \\(runtime/trace/ may not include runtime/memory/\\)")
expect_caught(runtime/nvme/bad.h "\"runtime/trace/trace.h\""
  "runtime/nvme/bad.h: # include \"runtime/trace/trace.h\" \\(runtime/nvme/ may not include runtime/trace/\\)")
expect_caught(runtime/stream/bad.cpp "\"runtime/optimizer/optimizer.h\""
  "runtime/stream/bad.cpp: # include \"runtime/optimizer/optimizer.h\" \\(runtime/stream/ may not")
expect_caught(runtime/optimizer/bad.h "\"runtime/placement/placement.h\""
  "runtime/optimizer/bad.h: # include \"runtime/placement/placement.h\" \\(runtime/optimizer/ may not include runtime/placement/\\)")
expect_caught(runtime/placement/bad.cpp "\"runtime/core.h\""
  "runtime/placement/bad.cpp: # include \"runtime/core.h\" \\(runtime/placement/ may not include the files")

# A folder of runtime/ that the order does not name.
file(WRITE "${WORK}/runtime/misc/helper.h" "#pragma once\n#include \"common/status.h\"\n")
run_checker(rc text)
file(REMOVE_RECURSE "${WORK}/runtime/misc")
if(rc EQUAL 0)
  string(APPEND failures "\n  runtime/misc/, in no place of the order: the checker passed")
elseif(NOT text MATCHES "runtime/misc/ is in no place of the order")
  string(APPEND failures "\n  runtime/misc/: not named in: ${text}")
endif()

if(NOT failures STREQUAL "")
  message(FATAL_ERROR "check_layering.cmake missed an upward include:${failures}")
endif()
message(STATUS "check_layering.cmake passed the clean tree and caught all 14 upward includes "
  "and the folder outside the order")
