"""Which libstrata the package loads (strata._lib._find_library, docs/install.md): $STRATA_LIBRARY
over the library bundled by pip install, that over a build of the checkout; what
strata.core.library_path() / library_source() / include_dir() / cmake_dir() report for each; the
package version taken from strata.h; the strata-bench launcher's refusal outside a wheel.

Each case imports a copy of the package in a fresh interpreter laid out as that case needs (a
wheel's strata/lib/, a checkout's build/release/lib/), the library linked in, not rebuilt."""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import strata
import strata.core

ROOT = pathlib.Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "bindings" / "python" / "strata"
REPORT = """
import json
import strata.core as c

def where(fn):
    try:
        return fn()
    except FileNotFoundError:
        return None

print(json.dumps({"path": c.library_path(), "source": c.library_source(),
                  "include": where(c.include_dir), "cmake": where(c.cmake_dir)}))
"""


def library():
    return pathlib.Path(strata.core.library_path())


def copy_package(root):
    shutil.copytree(PACKAGE, root / "strata", ignore=shutil.ignore_patterns("__pycache__"))
    return root / "strata"


def report(pythonpath, env=None):
    full = {k: v for k, v in os.environ.items() if k not in ("STRATA_LIBRARY", "PYTHONPATH")}
    full.update(env or {})
    full["PYTHONPATH"] = str(pythonpath)
    out = subprocess.run([sys.executable, "-c", REPORT], env=full, cwd=str(pythonpath),
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def wheel_layout(tmp_path):
    """site-packages/strata as pip install . lays it out: lib/libstrata.so.1, include/, the
    CMake package under lib/cmake/strata."""
    package = copy_package(tmp_path / "site-packages")
    (package / "lib" / "cmake" / "strata").mkdir(parents=True)
    (package / "lib" / "libstrata.so.1").symlink_to(library())
    (package / "lib" / "cmake" / "strata" / "strataConfig.cmake").write_text("# test\n")
    (package / "include" / "strata").mkdir(parents=True)
    shutil.copy(ROOT / "include" / "strata" / "strata.h", package / "include" / "strata")
    return package


def test_this_process_loaded_what_the_harness_named():
    env = os.environ.get("STRATA_LIBRARY")
    if not env:
        pytest.skip("STRATA_LIBRARY is not set (the ctest harness sets it)")
    assert strata.core.library_source() == "STRATA_LIBRARY"
    assert library().samefile(env)


def test_the_bundled_library_is_loaded_when_no_variable_names_one(tmp_path):
    package = wheel_layout(tmp_path)
    got = report(package.parent)
    assert got["source"] == "bundled"
    assert got["path"] == str(package / "lib" / "libstrata.so.1")
    assert got["include"] == str((package / "include").resolve())
    assert got["cmake"] == str((package / "lib" / "cmake" / "strata").resolve())


def test_strata_library_overrides_the_bundled_one(tmp_path):
    package = wheel_layout(tmp_path)
    other = tmp_path / "elsewhere" / "libstrata.so.1"
    other.parent.mkdir()
    other.symlink_to(library())
    got = report(package.parent, {"STRATA_LIBRARY": str(other)})
    assert got["source"] == "STRATA_LIBRARY"
    assert got["path"] == str(other)


def test_a_checkout_build_is_found_without_a_bundled_library(tmp_path):
    checkout = tmp_path / "checkout"
    package = copy_package(checkout / "bindings" / "python")
    built = checkout / "build" / "release" / "lib"
    built.mkdir(parents=True)
    (built / "libstrata.so.1").symlink_to(library())
    (checkout / "include" / "strata").mkdir(parents=True)
    shutil.copy(ROOT / "include" / "strata" / "strata.h", checkout / "include" / "strata")
    got = report(package.parent)
    assert got["source"] == "checkout"
    assert got["path"] == str(built / "libstrata.so.1")
    # A build tree has no headers or CMake package of its own: the checkout's include/.
    assert got["include"] == str((checkout / "include").resolve())


def test_no_cmake_package_beside_a_build_tree_is_a_clear_error(tmp_path):
    checkout = tmp_path / "checkout"
    package = copy_package(checkout / "bindings" / "python")
    built = checkout / "build" / "release" / "lib"
    built.mkdir(parents=True)
    (built / "libstrata.so.1").symlink_to(library())
    env = {k: v for k, v in os.environ.items() if k != "STRATA_LIBRARY"}
    env["PYTHONPATH"] = str(package.parent)
    out = subprocess.run([sys.executable, "-c", "import strata.core; strata.core.cmake_dir()"],
                         env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert "no CMake package beside" in out.stderr and "cmake --install" in out.stderr


def test_the_package_version_is_strata_h_version():
    """pyproject.toml takes the version from strata.h with a regex (scikit-build-core's regex
    provider): applied here as it applies it, it gives the header's and the library's version."""
    tomllib = pytest.importorskip("tomllib")
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in settings["project"]["dynamic"]
    provider = settings["tool"]["scikit-build"]["metadata"]["version"]
    assert provider["provider"] == "scikit_build_core.metadata.regex"
    header = (ROOT / provider["input"]).read_text()
    match = re.search(provider["regex"], header, re.MULTILINE)
    assert match, "pyproject.toml's version regex does not match %s" % provider["input"]
    version = provider["result"].format(*match.groups(), **match.groupdict())
    defines = dict(re.findall(r"#define STRATA_VERSION_(MAJOR|MINOR|PATCH) (\d+)", header))
    assert version == "%s.%s.%s" % (defines["MAJOR"], defines["MINOR"], defines["PATCH"])
    assert version == strata.core.version()


def test_strata_bench_launcher_refuses_a_package_without_the_binary(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "STRATA_LIBRARY"}
    env["PYTHONPATH"] = str(copy_package(tmp_path).parent)
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "strata-bench"), "--help"],
                         env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert "bin/strata-bench is missing" in out.stderr and "pip install ." in out.stderr
