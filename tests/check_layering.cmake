# The include graph runs one way: lib/ -> runtime/ -> backends/ -> common/ (docs/architecture.md),
# and inside runtime/ its parts (folders) run one way too, in the order `runtime_parts` gives.
# Fails, naming file, line and include, when a lower layer's source includes a header of a
# higher one, so the layering cannot rot one convenient include at a time.
# Run as: cmake -DROOT=<source dir> -P check_layering.cmake
cmake_minimum_required(VERSION 3.25)

if(NOT ROOT)
  message(FATAL_ERROR "check_layering: pass -DROOT=<source dir>")
endif()

# layer|the directories it must not include from.
set(rules
  "common|runtime|backends|lib"
  "backends|runtime|lib"
  "runtime|lib")

# The parts of runtime/, bottom first, each with the parts it may include besides itself (and
# common/, backends/). Every other part is forbidden to it. `runtime` stands for the files
# directly in runtime/ (the Runtime object, which ties the tiers together); every folder of
# runtime/ must be named here, so a new folder takes its place in the order when it is made.
# The order is the include graph as it was drawn into folders; widen a line deliberately.
set(runtime_parts
  "runtime/memory|"
  "runtime/nvme|runtime/memory"
  "runtime/trace|"
  "runtime|runtime/memory|runtime/nvme|runtime/trace"
  "runtime/stream|runtime/memory|runtime/nvme|runtime/trace|runtime"
  "runtime/optimizer|runtime/memory|runtime/nvme|runtime/trace|runtime|runtime/stream"
  "runtime/checkpoint|runtime/memory|runtime/nvme|runtime/trace|runtime|runtime/stream|runtime/optimizer"
  # A model apart: it includes no other part and no other part includes it (lib/ joins it to
  # the probes that measure its rates).
  "runtime/placement|"
  # The step-memory plan: a model apart too (it decides from a profile the binding measured).
  "runtime/step|")

set(source_globs "*.h" "*.hpp" "*.cpp" "*.cu")
set(violations "")
set(files_checked 0)

# check_includes(<sources> <layer as shown> ["<what is forbidden, as shown>=<regex>"]...)
# Appends to `violations` each include in `sources` whose path matches a forbidden regex.
function(check_includes sources layer)
  foreach(source IN LISTS sources)
    file(RELATIVE_PATH rel "${ROOT}" "${source}")
    foreach(entry IN LISTS ARGN)
      string(FIND "${entry}" "=" eq)
      string(SUBSTRING "${entry}" 0 ${eq} shown)
      math(EXPR from "${eq} + 1")
      string(SUBSTRING "${entry}" ${from} -1 regex)
      file(STRINGS "${source}" includes REGEX "^[ \t]*#[ \t]*include[ \t]*[\"<](${regex})")
      foreach(line IN LISTS includes)
        string(STRIP "${line}" line)
        string(APPEND violations "\n  ${rel}: ${line} (${layer} may not include ${shown})")
      endforeach()
    endforeach()
  endforeach()
  set(violations "${violations}" PARENT_SCOPE)
endfunction()

foreach(rule IN LISTS rules)
  string(REPLACE "|" ";" parts "${rule}")
  list(POP_FRONT parts layer)
  list(TRANSFORM source_globs PREPEND "${ROOT}/${layer}/" OUTPUT_VARIABLE globs)
  file(GLOB_RECURSE sources LIST_DIRECTORIES false ${globs})
  list(LENGTH sources count)
  math(EXPR files_checked "${files_checked} + ${count}")
  set(forbidden "")
  foreach(dir IN LISTS parts)
    list(APPEND forbidden "${dir}/=${dir}/")
  endforeach()
  check_includes("${sources}" "${layer}/" ${forbidden})
endforeach()

# The parts of runtime/: the files of each, and how an include of it is recognized.
set(part_names "")
foreach(rule IN LISTS runtime_parts)
  string(REPLACE "|" ";" allowed "${rule}")
  list(POP_FRONT allowed part)
  list(APPEND part_names "${part}")
endforeach()
function(part_shown part out)
  if(part STREQUAL "runtime")
    set(${out} "the files directly in runtime/" PARENT_SCOPE)
  else()
    set(${out} "${part}/" PARENT_SCOPE)
  endif()
endfunction()
function(part_regex part out)
  if(part STREQUAL "runtime")
    set(${out} "runtime/[^/\"<>]+[\">]" PARENT_SCOPE)  # a file directly in runtime/
  else()
    set(${out} "${part}/" PARENT_SCOPE)
  endif()
endfunction()

if(IS_DIRECTORY "${ROOT}/runtime")
  file(GLOB entries LIST_DIRECTORIES true "${ROOT}/runtime/*")
  foreach(entry IN LISTS entries)
    file(RELATIVE_PATH rel "${ROOT}" "${entry}")
    if(IS_DIRECTORY "${entry}" AND NOT rel IN_LIST part_names)
      string(APPEND violations
        "\n  ${rel}/ is in no place of the order: add it to runtime_parts in check_layering.cmake")
    endif()
  endforeach()
  foreach(rule IN LISTS runtime_parts)
    string(REPLACE "|" ";" allowed "${rule}")
    list(POP_FRONT allowed part)
    if(part STREQUAL "runtime")
      list(TRANSFORM source_globs PREPEND "${ROOT}/runtime/" OUTPUT_VARIABLE globs)
      file(GLOB sources LIST_DIRECTORIES false ${globs})
    else()
      list(TRANSFORM source_globs PREPEND "${ROOT}/${part}/" OUTPUT_VARIABLE globs)
      file(GLOB_RECURSE sources LIST_DIRECTORIES false ${globs})
    endif()
    set(forbidden "")
    foreach(other IN LISTS part_names)
      if(NOT other STREQUAL part AND NOT other IN_LIST allowed)
        part_shown("${other}" shown)
        part_regex("${other}" regex)
        list(APPEND forbidden "${shown}=${regex}")
      endif()
    endforeach()
    part_shown("${part}" layer)
    check_includes("${sources}" "${layer}" ${forbidden})
  endforeach()
endif()

if(files_checked EQUAL 0)
  message(FATAL_ERROR "check_layering: no sources under ${ROOT}; wrong ROOT?")
endif()
if(NOT violations STREQUAL "")
  message(FATAL_ERROR "check_layering: a lower layer includes a higher one:${violations}")
endif()
message(STATUS "check_layering: ${files_checked} files, the include graph runs one way")
