#!/usr/bin/env bash
# Installs what building and testing Strata needs on Debian/Ubuntu, skipping what is present.
# The CUDA toolkit is not installed here: it is used where present (/usr/local/cuda).
set -euo pipefail

packages=(build-essential cmake ninja-build pkg-config liburing-dev libhwloc-dev libnuma-dev libisal-dev catch2 fio)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} > 0)); then
  echo "strata: installing ${missing[*]}"
  sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
