#!/usr/bin/env bash
# The README's second command: install what is missing, build, run the test suite.
# GPU tests (label gpu) run where a GPU is present and skip elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake --preset release -DPython3_EXECUTABLE="$(bash scripts/python-env.sh)/bin/python"
cmake --build --preset release
ctest --preset release "$@"
