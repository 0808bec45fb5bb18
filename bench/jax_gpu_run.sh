#!/usr/bin/env bash
# strata.jax's FFI path on a GPU machine: build the FFI library there (the machine's compiler
# and jaxlib headers), run the JAX tests on the GPU, and bench against resident JAX. Logs and
# JSON go to $OUT. Stages (arguments, in order; default "tests 1b"):
#   tests        tests/python/jax/test_jax_{ffi,api,stream}.py (the FFI path, the default)
#   tests-host   tests/python/jax/test_jax_{api,stream}.py with STRATA_JAX_FFI=0 (the fallback)
#   1b           bench/jax_bench.py --model 1b: ffi, ffi-unrolled, resident
#   1b-host      bench/jax_bench.py --model 1b: hostloop (the host-synchronised loop)
#   8b           bench/jax_bench.py --model 8b: ffi, resident (which is expected not to fit)
# STRATA_LIBRARY defaults to .gpubuild-jax/libstrata.so.1 (a gpu-preset build of this tree);
# .gpubuild-jax/pylib (optax, absl: pure Python) is appended to PYTHONPATH where the machine
# lacks optax. Each stage has its own timeout, so a stage that hangs leaves the others' logs.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export STRATA_LIBRARY=${STRATA_LIBRARY:-$PWD/.gpubuild-jax/libstrata.so.1}
export PYTHONPATH=$PWD/bindings/python${PYTHONPATH:+:$PYTHONPATH}
if ! $PY -c "import optax" 2>/dev/null && [ -d .gpubuild-jax/pylib ]; then
  export PYTHONPATH=$PYTHONPATH:$PWD/.gpubuild-jax/pylib
fi
export STRATA_JAX_FFI_CACHE=${STRATA_JAX_FFI_CACHE:-$PWD/.gpubuild-jax/ffi-cache}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import jax, jaxlib, optax; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'optax', optax.__version__, jax.devices())"
  $PY -c "import strata; print('libstrata', strata.core.version(), '$STRATA_LIBRARY')"
  free -g; nproc
} > "$OUT/env.txt" 2>&1
# The FFI library, built here (about 15 s) and cached for the stages below.
( time $PY -m strata.jax._ffi ) > "$OUT/ffi-build.txt" 2>&1
echo "ffi build: rc $? $(head -c 300 "$OUT/ffi-build.txt")"

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests 1b)
for stage in "${stages[@]}"; do
  t0=$(date +%s)
  case $stage in
    tests)
      timeout 240 $PY -m pytest -q -rs -p no:cacheprovider tests/python/jax/test_jax_ffi.py \
        tests/python/jax/test_jax_api.py tests/python/jax/test_jax_stream.py \
        > "$OUT/tests.txt" 2>&1 ;;
    tests-host)
      STRATA_JAX_FFI=0 timeout 200 $PY -m pytest -q -rs -p no:cacheprovider \
        tests/python/jax/test_jax_api.py tests/python/jax/test_jax_stream.py \
        > "$OUT/tests-host.txt" 2>&1 ;;
    1b)
      timeout 330 $PY bench/jax_bench.py --model 1b --batch 8 --seq 2048 --steps 5 --warmup 2 \
        --modes ffi,ffi-unrolled,resident --timeout 150 --json "$OUT/jax-1b.json" \
        > "$OUT/bench-1b.txt" 2>&1 ;;
    1b-host)
      timeout 200 $PY bench/jax_bench.py --model 1b --batch 8 --seq 2048 --steps 5 --warmup 2 \
        --modes hostloop,resident --timeout 150 --json "$OUT/jax-1b-host.json" \
        > "$OUT/bench-1b-host.txt" 2>&1 ;;
    8b)
      timeout 560 $PY bench/jax_bench.py --model 8b --batch 8 --seq 2048 --steps 3 --warmup 2 \
        --modes ffi,resident --timeout 400 --json "$OUT/jax-8b.json" > "$OUT/bench-8b.txt" 2>&1 ;;
    *) echo "unknown stage $stage"; continue ;;
  esac
  echo "== $stage: rc $? in $(( $(date +%s) - t0 )) s"
done
tail -n 5 "$OUT"/tests*.txt 2>/dev/null
cat "$OUT"/bench-*.txt 2>/dev/null
