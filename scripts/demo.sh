#!/usr/bin/env bash
# The README's first command: install what is missing, build, run Strata's main job.
# Extra arguments go to strata-demo (e.g. --layers 24 --hidden 2048 --backend host).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake --preset release >/dev/null
cmake --build --preset release --target strata-demo
exec ./build/release/examples/strata-demo "$@"
