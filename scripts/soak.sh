#!/usr/bin/env bash
# Soak (issue 15): randomized executor graphs and steps with new seeds, and the storage fault
# campaigns (short reads/writes, EIO, ENOSPC, flipped bits, concurrent ranges), over and over
# under each sanitizer preset until MINUTES have passed. Every test run has a watchdog (the
# executor tests' own per-graph watchdog, plus `timeout` around each run): a hang is a failure.
# Any sanitizer report or failure stops the soak with the command that reproduces it.
#   bash scripts/soak.sh [MINUTES=30] [PRESETS="tsan asan-ubsan"]
set -euo pipefail
cd "$(dirname "$0")/.."
minutes=${1:-30}
presets=${2:-"tsan asan-ubsan"}
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export TSAN_OPTIONS=halt_on_error=1 STRATA_TEST_BACKEND=host
for preset in $presets; do
  [[ -x build/$preset/tests/strata_executor_tests ]] || {
    cmake --preset "$preset" >/dev/null
    cmake --build --preset "$preset" --target strata_executor_tests strata_storage_tests
  }
done
end=$((SECONDS + minutes * 60))
runs=0
seed=$(( $(date +%s) % 100000 ))
while ((SECONDS < end)); do
  for preset in $presets; do
    seed=$((seed + 1))
    cmd="STRATA_TEST_SEED=$seed STRATA_TEST_TRIALS=4 build/$preset/tests/strata_executor_tests '[executor]'"
    if ! timeout 900 env STRATA_TEST_SEED=$seed STRATA_TEST_TRIALS=4 \
        "build/$preset/tests/strata_executor_tests" "[executor]" >/tmp/strata-soak.log 2>&1; then
      tail -40 /tmp/strata-soak.log
      echo "soak: FAILED after $runs runs: $cmd"
      exit 1
    fi
    if ! timeout 900 "build/$preset/tests/strata_storage_tests" "[nvme]~[slow]" \
        >/tmp/strata-soak.log 2>&1; then
      tail -40 /tmp/strata-soak.log
      echo "soak: FAILED after $runs runs: build/$preset/tests/strata_storage_tests '[nvme]~[slow]'"
      exit 1
    fi
    runs=$((runs + 2))
  done
done
echo "soak: $runs runs in $minutes min ($presets), no failure, no sanitizer report, no hang"
