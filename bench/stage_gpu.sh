#!/usr/bin/env bash
# Stages, on this (CPU) machine, what a GPU machine's benchmark runs need and cannot fetch: a
# folder to `carry` to the device (docs/benchmarks.md, "Running on the GPU machines"):
#   STAGE/lib/            libstrata.so (the gpu preset: sm_90, liburing linked in, stripped) and
#                         the libnuma and libhwloc it links, which the GPU image lacks
#   STAGE/megatrain/src/  MegaTrain's infinity/ and examples/ from a checkout of it (--megatrain
#                         GIT_DIR, e.g. the `fetch` tool's mirror), bench/megatrain_sdpa_mask.patch
#                         applied (bench/megatrain_peer.py refuses a tree without it), its commit
#                         in MEGATRAIN_COMMIT
#   WHEELS/               pytest, DeepSpeed 0.19.8 (pure Python: its CPU Adam compiles on the
#                         device at first use) and what both need; with --datasets also datasets,
#                         pyarrow and theirs (strata-train's reader; ~45 MB: mind the 64 MiB a call)
# Both folders must be ignored by git (.git/info/exclude) and named in the call's `carry`; on the
# device, `source bench/gpu_env.sh STAGE WHEELS` installs the wheels and sets the paths.
#
#   bash bench/stage_gpu.sh --megatrain /work/.mirror/DLYuanGod+MegaTrain/repo [--datasets]
set -euo pipefail
cd "$(dirname "$0")/.."
stage=.stage wheels=.whl megatrain="" datasets=0
while (($#)); do
  case "$1" in
    --stage) stage=$2; shift 2 ;;
    --wheels) wheels=$2; shift 2 ;;
    --megatrain) megatrain=$2; shift 2 ;;
    --datasets) datasets=1; shift ;;
    *) echo "stage_gpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
venv="$(bash scripts/python-env.sh)"
[[ -x $venv/bin/python ]] || { echo "stage_gpu.sh: no Python environment at $venv: run scripts/install-deps.sh first" >&2; exit 2; }
for d in "$stage" "$wheels"; do
  git check-ignore -q "$d/x" || { echo "stage_gpu.sh: $d is not ignored by git: add /$d/ to .git/info/exclude (a staged folder must not be committed)" >&2; exit 2; }
done
mkdir -p "$stage/lib" "$wheels"

echo "== libstrata (gpu preset)"
cmake --preset gpu -DPython3_EXECUTABLE="$venv/bin/python" >/dev/null
cmake --build build/gpu --target strata
cp -L build/gpu/lib/libstrata.so.1 "$stage/lib/libstrata.so"
strip "$stage/lib/libstrata.so"
for so in libnuma.so.1 libhwloc.so.15; do
  path=$(ldd "$stage/lib/libstrata.so" | awk -v n="$so" '$1 == n {print $3}')
  [[ -n $path ]] || { echo "stage_gpu.sh: libstrata does not link $so here" >&2; exit 1; }
  cp -L "$path" "$stage/lib/"
done

if [[ -n $megatrain ]]; then
  echo "== MegaTrain from $megatrain"
  rm -rf "$stage/megatrain/src" && mkdir -p "$stage/megatrain/src"
  # Only its Python packages: the mirror's history holds build outputs for another machine.
  git -C "$megatrain" archive HEAD infinity examples | tar -x -C "$stage/megatrain/src"
  git -C "$megatrain" rev-parse HEAD > "$stage/megatrain/src/MEGATRAIN_COMMIT"
  patch -s -p1 -d "$stage/megatrain/src" < bench/megatrain_sdpa_mask.patch
fi

echo "== wheels"
# The device's Python is 3.12 on x86-64 (the device tool's README); pure-Python wheels and the
# manylinux ones for it.
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$wheels" "$@"
}
download pytest pluggy iniconfig hjson pydantic pydantic-core annotated-types \
  typing-inspection typing_extensions py-cpuinfo einops msgpack psutil tqdm
if ! ls "$wheels"/deepspeed-0.19.8-*.whl >/dev/null 2>&1; then
  "$venv/bin/python" -m pip install -q hjson pydantic py-cpuinfo wheel
  (cd "$(mktemp -d)" && DS_BUILD_OPS=0 "$venv/bin/python" -m pip wheel -q --no-deps \
    --no-build-isolation deepspeed==0.19.8 -w "$OLDPWD/$wheels")
fi
if ((datasets)); then
  download datasets "pyarrow>=24" "dill<0.4.2" "multiprocess<0.70.20" xxhash "fsspec<=2026.9.0"
fi
du -sh "$stage" "$wheels"
