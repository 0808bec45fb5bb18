#!/usr/bin/env bash
# The pip road on a clean machine (issue 37; CI runs it after the README's test command):
# `pip install .` from this checkout into a fresh virtual environment, then, with no
# STRATA_LIBRARY and no PYTHONPATH and from outside the checkout, import strata.torch, train the
# tiny model a few steps with a trace, read the trace with strata-prof and run the bundled
# strata-bench. Fails if the library loaded is not the one the package bundles, or if the
# installed distribution is not strata-tiering (docs/install.md, "Names") with the commands.
# torch is not downloaded again: the new environment sees the test environment's packages
# (scripts/python-env.sh) through a .pth file, after its own, so the pip-installed strata wins.
set -euo pipefail
cd "$(dirname "$0")/.."
checkout="$PWD"
base="$(bash scripts/python-env.sh)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
unset STRATA_LIBRARY PYTHONPATH

"$base/bin/python" -m venv "$work/venv"
py="$work/venv/bin/python"
"$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
  > "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/strata-test-env.pth"

start=$SECONDS
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
  "$py" -m pip install --quiet --disable-pip-version-check "$checkout"
echo "pip install . took $((SECONDS - start)) s"

# The example and its model copied out of the checkout: nothing of the checkout's is importable
# (examples/train.py puts <its root>/bindings/python first on sys.path, which here is absent).
mkdir -p "$work/run/examples" "$work/run/bench"
cp -r examples/train.py examples/data "$work/run/examples/"
cp -r bench/llama_zoo "$work/run/bench/"
cd "$work/run"

"$py" - <<'PY'
import pathlib
import runpy
import sys
from importlib import metadata

import strata
import strata.core
import strata.torch  # noqa: F401

# The distribution pip installed is strata-tiering (PyPI's strata is another project), it owns
# the strata package and the two commands, and its version is the library's.
dist = metadata.distribution("strata-tiering")
files = [str(f) for f in dist.files or ()]
missing = [n for n in ("strata/__init__.py", "bin/strata-prof", "bin/strata-bench")
           if not any(f == n or f.endswith("/" + n) for f in files)]
print("distribution %s %s" % (dist.metadata["Name"], dist.version))
if dist.metadata["Name"] != "strata-tiering" or dist.version != strata.__version__ or missing:
    sys.exit("FAIL: distribution %s %s (library %s), its RECORD lacks %s"
             % (dist.metadata["Name"], dist.version, strata.__version__, missing))

bundled = pathlib.Path(strata.__file__).resolve().parent / "lib" / "libstrata.so.1"
loaded = pathlib.Path(strata.core.library_path())
print("strata %s from %s, library %s (%s)" % (strata.__version__, pathlib.Path(strata.__file__).parent,
                                               loaded, strata.core.library_source()))
if strata.core.library_source() != "bundled" or not loaded.samefile(bundled):
    sys.exit("FAIL: the pip-installed strata loaded %s (%s), not its bundled %s"
             % (loaded, strata.core.library_source(), bundled))
if not (pathlib.Path(strata.core.include_dir()) / "strata" / "strata.h").exists():
    sys.exit("FAIL: include_dir() %s has no strata/strata.h" % strata.core.include_dir())
if not (pathlib.Path(strata.core.cmake_dir()) / "strataConfig.cmake").exists():
    sys.exit("FAIL: cmake_dir() %s has no strataConfig.cmake" % strata.core.cmake_dir())
# The tiny model, a few steps, in this process: the library checked above is the one it uses.
sys.argv = ["train.py", "--steps", "3", "--device", "cpu", "--trace", "trace.json"]
runpy.run_path("examples/train.py", run_name="__main__")
PY

bin="$work/venv/bin"
"$bin/strata-prof" trace.json
"$bin/strata-bench" stream --backend host --layers 4 --layer-bytes 4M --steps 2

# A C program built against the wheel's CMake package (find_package(strata), strata::strata),
# as docs/install.md says, runs with the bundled library.
mkdir app
cat > app/CMakeLists.txt <<'CMAKE'
cmake_minimum_required(VERSION 3.25)
project(app C)
find_package(strata REQUIRED)
add_executable(app app.c)
target_link_libraries(app PRIVATE strata::strata)
CMAKE
cat > app/app.c <<'C'
#include <stdio.h>
#include <strata/strata.h>
int main(void) { printf("C program linked to libstrata %s\n", strata_version_string()); return 0; }
C
cmake -S app -B app/build -Dstrata_DIR="$("$py" -c 'import strata.core as c; print(c.cmake_dir())')" >/dev/null
cmake --build app/build >/dev/null
app/build/app
echo "pip install: passed"
