#!/usr/bin/env bash
# Installs what building and testing Strata needs on Debian/Ubuntu, skipping what is present.
# The CUDA toolkit is not installed here: it is used where present (/usr/local/cuda).
set -euo pipefail

# clang, libclang-rt-dev (libFuzzer and clang's sanitizer runtimes) and llvm (llvm-symbolizer, for
# readable reports): the fuzz preset, which CI runs (Debian 12's clang 14 is enough).
packages=(build-essential cmake ninja-build pkg-config liburing-dev libhwloc-dev libnuma-dev libisal-dev nlohmann-json3-dev catch2 fio python3 python3-pip python3-venv
  clang libclang-rt-dev llvm)
sudo=""
[[ $(id -u) -eq 0 ]] || sudo="sudo"
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} > 0)); then
  echo "strata: installing ${missing[*]}"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
# Python: the strata package's dependencies (torch), strata-prof, the Python tests, the
# torch peer of `strata-bench optim`. Debian's
# Python refuses pip (PEP 668), so they go into a virtual environment outside the repository,
# made once and reused (scripts/python-env.sh names it: $STRATA_VENV or ~/.cache/strata-venv).
venv="$(bash "$(dirname "$0")/python-env.sh")"
if [[ ! -x "$venv/bin/python" ]]; then
  echo "strata: creating the Python environment $venv"
  python3 -m venv "$venv"
fi
python_missing=()
# torch, transformers, jax: the main job (strata-train), examples/train.py, strata.torch,
# strata.jax and their tests; optax: the plain JAX reference of strata.jax's tests (and its residents' optimizers);
# flax, equinox: strata.jax.offload's parity tests (tests/python/jax/test_jax_nnx.py,
# test_jax_equinox.py; the package's optional extras jax-flax and jax-equinox);
# peft: the LoRA case of strata.torch's parity tests; datasets, pyyaml, tqdm, tokenizers and
# huggingface_hub: strata-train (the main job; pyproject's [train] extra). PyPI's torch wheel
# brings the CUDA libraries (GBs): installed once into the environment, skipped when present.
# Each entry is pip's name, with the import name after a colon where they differ.
for entry in pytest matplotlib numpy safetensors torch transformers jax optax flax equinox peft \
    datasets pyyaml:yaml tqdm tokenizers huggingface_hub; do
  "$venv/bin/python" -c "import ${entry#*:}" 2>/dev/null || python_missing+=("${entry%%:*}")
done
if ((${#python_missing[@]} > 0)); then
  echo "strata: installing Python packages ${python_missing[*]} into $venv"
  # An installed jax stays as it is: flax or equinox installed beside it take releases made
  # for it (a newest flax that wants a newer jax would otherwise upgrade it under torch's
  # and the other tests' feet).
  jax_version="$("$venv/bin/python" -c "import jax; print(jax.__version__)" 2>/dev/null || true)"
  keep=()
  [[ -n "$jax_version" ]] && keep=("jax==$jax_version")
  "$venv/bin/python" -m pip install -q "${python_missing[@]}" "${keep[@]}"
fi
