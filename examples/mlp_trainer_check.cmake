# The test mlp_trainer (tests/CMakeLists.txt): runs strata-mlp-trainer (-DTRAINER=path) on the
# host backend four ways.
#  1. As it is: the step plan spills some checkpoints to DRAM, not all; the loss falls by half, and
#     every loss and weight equals the program's plain reference bit for bit (the library's
#     generic AdamW kernel, STRATA_OPTIMIZER_ISA=generic).
#  2. --no-spill at the same HBM budget: every checkpoint on the device does not fit, and the
#     runtime says so (STRATA_ERROR_OUT_OF_MEMORY, nonzero exit).
#  3. --no-spill with a budget that holds them: the same final loss and weights, bit for bit, as 1
#     (spilling is a copy).
#  4. With the library's best kernel (AVX2 / AVX-512, FMAs): within the program's tolerance.
if(NOT TRAINER)
  message(FATAL_ERROR "pass -DTRAINER=<path of strata-mlp-trainer>")
endif()

function(run_trainer out_var rc_var)
  execute_process(COMMAND ${TRAINER} ${ARGN} OUTPUT_VARIABLE out ERROR_VARIABLE err
                  RESULT_VARIABLE rc)
  set(${out_var} "${out}${err}" PARENT_SCOPE)
  set(${rc_var} "${rc}" PARENT_SCOPE)
endfunction()

function(expect what text needle)
  string(FIND "${text}" "${needle}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${what}: no '${needle}' in its output:\n${text}")
  endif()
endfunction()

function(expect_exit what text rc want)
  if(NOT rc EQUAL want)
    message(FATAL_ERROR "${what}: exit status ${rc}, expected ${want}:\n${text}")
  endif()
endfunction()

set(ENV{STRATA_OPTIMIZER_ISA} generic)

run_trainer(spilled rc)
expect_exit("the plan's spills" "${spilled}" "${rc}" 0)
expect("the plan's spills" "${spilled}" "reference: every loss and weight equal bit for bit")
if(NOT spilled MATCHES "spilled ([0-9]+) of ([0-9]+) checkpoints to DRAM")
  message(FATAL_ERROR "the plan's spills: no count of spilled checkpoints:\n${spilled}")
endif()
set(count ${CMAKE_MATCH_1})
set(blocks ${CMAKE_MATCH_2})
if(count EQUAL 0 OR NOT count LESS blocks)
  message(FATAL_ERROR "the plan spilled ${count} of ${blocks} checkpoints: expected some, not all")
endif()
string(REGEX MATCH "final loss [^\n]*" final_spilled "${spilled}")
if(NOT spilled MATCHES "trained: loss ([0-9.]+) -> ([0-9.]+)")
  message(FATAL_ERROR "the plan's spills: no loss curve:\n${spilled}")
endif()
# (Both printed with 6 decimals: as integers without the point, they compare as the losses do.)
string(REPLACE "." "" first "${CMAKE_MATCH_1}")
string(REPLACE "." "" last "${CMAKE_MATCH_2}")
set(curve "${CMAKE_MATCH_1} -> ${CMAKE_MATCH_2}")
math(EXPR twice_last "2 * ${last}")
if(NOT twice_last LESS first)
  message(FATAL_ERROR "the loss did not fall by half: ${curve}")
endif()

run_trainer(refused rc --no-spill)
if(rc EQUAL 0)
  message(FATAL_ERROR "--no-spill at the same budget trained:\n${refused}")
endif()
expect("--no-spill" "${refused}" "STRATA_ERROR_OUT_OF_MEMORY")

run_trainer(in_place rc --no-spill --hbm-kib 8192)
expect_exit("every checkpoint in place" "${in_place}" "${rc}" 0)
expect("every checkpoint in place" "${in_place}" "spilled 0 of ${blocks} checkpoints")
string(REGEX MATCH "final loss [^\n]*" final_in_place "${in_place}")
if(NOT final_spilled STREQUAL final_in_place OR final_spilled STREQUAL "")
  message(FATAL_ERROR "spilled and in-place runs differ:\n  ${final_spilled}\n  ${final_in_place}")
endif()

unset(ENV{STRATA_OPTIMIZER_ISA})
run_trainer(vectorized rc --steps 8)
expect_exit("the best kernel" "${vectorized}" "${rc}" 0)
expect("the best kernel" "${vectorized}" "reference: ")

message(STATUS "${count} of ${blocks} checkpoints spilled, loss ${curve}; ${final_spilled}, the same "
               "in place")
