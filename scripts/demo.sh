#!/usr/bin/env bash
# The README's first command: Strata's main job, an end-to-end streamed training run of a small
# Llama-style model (examples/train.py; arguments are passed on), on the GPU if there is one and
# on the CPU through the host backend if not. Installs what is missing and builds first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake --preset release -DPython3_EXECUTABLE="$(bash scripts/python-env.sh)/bin/python" >/dev/null
cmake --build --preset release --target strata
export STRATA_LIBRARY="$PWD/build/release/lib/libstrata.so.1"
exec "$(bash scripts/python-env.sh)/bin/python" examples/train.py "$@"
