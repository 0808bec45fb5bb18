#!/usr/bin/env bash
# Soak (issue 15): randomized executor graphs and steps with new seeds, and the storage fault
# tests (short reads/writes, EIO, ENOSPC, flipped bits, concurrent ranges) with the fault
# campaigns, over and over under each sanitizer preset until MINUTES have passed. A soak of 10
# minutes or more runs the campaigns' full sweep (every fault at every transfer) on one storage
# variant per round, in turn (STRATA_FAULT_CAMPAIGN=full:N); a shorter one (CI's slice) the
# default campaigns, as ctest does. Every test run has a watchdog (the executor tests' own
# per-graph watchdog, the campaigns' per-run watchdog, plus `timeout` around each run): a hang
# is a failure. Any sanitizer report or failure stops the soak with the command that
# reproduces it.
#   bash scripts/soak.sh [MINUTES=30] [PRESETS="tsan asan-ubsan"]
set -euo pipefail
cd "$(dirname "$0")/.."
minutes=${1:-30}
presets=${2:-"tsan asan-ubsan"}
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export TSAN_OPTIONS=halt_on_error=1 STRATA_TEST_BACKEND=host
for preset in $presets; do  # incremental: a stale binary would soak old code
  [[ -f build/$preset/build.ninja ]] || cmake --preset "$preset" >/dev/null
  cmake --build --preset "$preset" --target strata_executor_tests strata_storage_tests
done
end=$((SECONDS + minutes * 60))
runs=0
campaigns=0
: >/tmp/strata-soak-campaigns.log
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
    filter="[nvme]~[slow]"
    ((minutes >= 10)) && filter="[nvme]~[slow]~[campaign]"
    if ! timeout 900 "build/$preset/tests/strata_storage_tests" "$filter" \
        >/tmp/strata-soak.log 2>&1; then
      tail -40 /tmp/strata-soak.log
      echo "soak: FAILED after $runs runs: build/$preset/tests/strata_storage_tests '$filter'"
      exit 1
    fi
    runs=$((runs + 2))
    if ((minutes >= 10)); then
      variant=$((campaigns % 4))
      campaigns=$((campaigns + 1))
      cmd="STRATA_FAULT_CAMPAIGN=full:$variant build/$preset/tests/strata_storage_tests '[campaign]'"
      if ! timeout 900 env STRATA_FAULT_CAMPAIGN=full:$variant \
          "build/$preset/tests/strata_storage_tests" "[campaign]" >/tmp/strata-soak.log 2>&1; then
        tail -40 /tmp/strata-soak.log
        echo "soak: FAILED after $runs runs: $cmd"
        exit 1
      fi
      grep "^fault campaign" /tmp/strata-soak.log >>/tmp/strata-soak-campaigns.log || true
      runs=$((runs + 1))
    fi
  done
done
echo "soak: $runs runs in $minutes min ($presets), $campaigns full fault-campaign sweeps" \
  "(their counts in /tmp/strata-soak-campaigns.log), no failure, no sanitizer report, no hang"
