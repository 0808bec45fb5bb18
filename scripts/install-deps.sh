#!/usr/bin/env bash
# Installs what building and testing Strata needs on Debian/Ubuntu, skipping what is present.
# The CUDA toolkit is not installed here: it is used where present (/usr/local/cuda).
set -euo pipefail

packages=(build-essential cmake ninja-build pkg-config liburing-dev libhwloc-dev libnuma-dev libisal-dev nlohmann-json3-dev catch2 fio python3 python3-pip)
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
# Python tools (strata-prof) and their tests.
python_missing=()
for m in pytest matplotlib; do
  python3 -c "import $m" 2>/dev/null || python_missing+=("$m")
done
if ((${#python_missing[@]} > 0)); then
  echo "strata: installing Python packages ${python_missing[*]}"
  # pip where it may install (a virtual environment, pyenv); Debian's packages where the
  # system Python refuses pip (PEP 668).
  if ! python3 -m pip install -q "${python_missing[@]}"; then
    $sudo apt-get install -y -q --no-install-recommends "${python_missing[@]/#/python3-}"
  fi
fi
