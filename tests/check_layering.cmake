# The include graph runs one way: lib/ -> runtime/ -> backends/ -> common/ (docs/architecture.md),
# and inside runtime/, runtime/checkpoint/ sits above the rest (the core never includes it).
# Fails, naming file, line and include, when a lower layer's source includes a header of a
# higher one, so the layering cannot rot one convenient include at a time.
# Run as: cmake -DROOT=<source dir> -P check_layering.cmake
cmake_minimum_required(VERSION 3.25)

if(NOT ROOT)
  message(FATAL_ERROR "check_layering: pass -DROOT=<source dir>")
endif()

# layer|the directories it must not include from. A file inside a forbidden directory may include
# from that directory (runtime/checkpoint/ includes its own headers).
set(rules
  "common|runtime|backends|lib"
  "backends|runtime|lib"
  "runtime|lib|runtime/checkpoint")

set(violations "")
set(files_checked 0)
foreach(rule IN LISTS rules)
  string(REPLACE "|" ";" parts "${rule}")
  list(POP_FRONT parts layer)
  file(GLOB_RECURSE sources LIST_DIRECTORIES false
    "${ROOT}/${layer}/*.h" "${ROOT}/${layer}/*.hpp" "${ROOT}/${layer}/*.cpp" "${ROOT}/${layer}/*.cu")
  foreach(source IN LISTS sources)
    math(EXPR files_checked "${files_checked} + 1")
    file(RELATIVE_PATH rel "${ROOT}" "${source}")
    set(applicable "")
    foreach(dir IN LISTS parts)
      string(FIND "${rel}" "${dir}/" at)
      if(NOT at EQUAL 0)
        list(APPEND applicable "${dir}")
      endif()
    endforeach()
    list(JOIN applicable "|" forbidden)
    file(STRINGS "${source}" includes REGEX "^[ \t]*#[ \t]*include[ \t]*[\"<](${forbidden})/")
    foreach(line IN LISTS includes)
      string(STRIP "${line}" line)
      string(APPEND violations "\n  ${rel}: ${line} (${layer}/ may not include ${forbidden}/)")
    endforeach()
  endforeach()
endforeach()

if(files_checked EQUAL 0)
  message(FATAL_ERROR "check_layering: no sources under ${ROOT}; wrong ROOT?")
endif()
if(NOT violations STREQUAL "")
  message(FATAL_ERROR "check_layering: a lower layer includes a higher one:${violations}")
endif()
message(STATUS "check_layering: ${files_checked} files, the include graph runs one way")
