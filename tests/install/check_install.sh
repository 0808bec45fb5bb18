#!/usr/bin/env bash
# Installs the build into a scratch prefix, then builds a consumer with find_package(strata)
# and another with pkg-config, and runs both. Args: BUILD_DIR SOURCE_DIR SCRATCH_DIR
set -euo pipefail
build=$1 source=$2 scratch=$3
rm -rf "$scratch" && mkdir -p "$scratch"
cmake --install "$build" --prefix "$scratch/prefix" >/dev/null
libdir=$(ls -d "$scratch"/prefix/lib*/ | head -n1)

cmake -S "$source/tests/install/consumer" -B "$scratch/cmake-consumer" -G Ninja \
  -DCMAKE_PREFIX_PATH="$scratch/prefix" >/dev/null
cmake --build "$scratch/cmake-consumer" >/dev/null
LD_LIBRARY_PATH="$libdir" "$scratch/cmake-consumer/consumer"

PKG_CONFIG_PATH="$libdir/pkgconfig" pkg-config --exists strata
# shellcheck disable=SC2046
cc -std=c99 -o "$scratch/pc-consumer" "$source/tests/install/consumer/consumer.c" \
  $(PKG_CONFIG_PATH="$libdir/pkgconfig" pkg-config --cflags --libs strata)
LD_LIBRARY_PATH="$libdir" "$scratch/pc-consumer"
echo "install check: find_package and pkg-config consumers both work"
