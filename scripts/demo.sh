#!/usr/bin/env bash
# The README's first command: Strata's main job, strata-train on its embedded default (a small
# Llama-style model, its tokenizer and a bundled chat dataset: bindings/python/strata/train/
# default), configured by examples/train/default.yaml: fine-tuned with its blocks streamed
# through Strata, on the GPU if there is one and on the CPU through the host backend if not,
# exported to strata-train-out/model and reloaded with from_pretrained, whose logits are
# compared with Strata's. Arguments are strata-train's flags and override the config
# (docs/train.md). Installs what is missing and builds first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake --preset release -DPython3_EXECUTABLE="$(bash scripts/python-env.sh)/bin/python" >/dev/null
cmake --build --preset release --target strata
export STRATA_LIBRARY="$PWD/build/release/lib/libstrata.so.1"
export PYTHONPATH="$PWD/bindings/python${PYTHONPATH:+:$PYTHONPATH}"
exec "$(bash scripts/python-env.sh)/bin/python" -m strata.train --config examples/train/default.yaml "$@"
