#!/usr/bin/env bash
# Builds the libFuzzer harnesses (preset fuzz: clang, ASan+UBSan) and runs each for SECONDS
# (default 60) from its seed corpus in tests/fuzz/corpus/<name>. New inputs go to a scratch
# corpus, never into the repository; a crash leaves its input in build/fuzz/artifacts/.
# Usage: scripts/fuzz.sh [SECONDS] [harness ...]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
shift || true
harnesses=("$@")
[ ${#harnesses[@]} -gt 0 ] || harnesses=(fuzz_safetensors fuzz_plan fuzz_abi_sequence)
cmake --preset fuzz >/dev/null
cmake --build --preset fuzz --target "${harnesses[@]}"
out=build/fuzz
mkdir -p "$out/artifacts"
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:allocator_may_return_null=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
status=0
for h in "${harnesses[@]}"; do
  name="${h#fuzz_}"
  work="$out/corpus-$name"
  mkdir -p "$work"
  echo "== $h for ${seconds}s =="
  # -rss_limit_mb: a bounded-memory promise; -timeout: no single input may hang.
  rc=0
  (cd "$out" && "./tests/fuzz/$h" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=2048 \
    -max_len=65536 -print_final_stats=1 -artifact_prefix=artifacts/ \
    "corpus-$name" "../../tests/fuzz/corpus/$name") >"$out/$name.log" 2>&1 || rc=$?
  grep -E "^#[0-9]+.*DONE|stat::number_of_executed_units|stat::peak_rss_mb|ERROR|SUMMARY" \
    "$out/$name.log" | tail -n 8 || true
  echo "$h: exit $rc, corpus $(ls "$work" | wc -l) inputs"
  [ "$rc" = 0 ] || { tail -n 40 "$out/$name.log"; status=1; }
done
if ls "$out/artifacts" | grep -q .; then echo "crash inputs in $out/artifacts"; status=1; fi
exit $status
