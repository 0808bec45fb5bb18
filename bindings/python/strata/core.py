"""Pythonic owners of the C ABI's handles: Runtime, Tensor, Graph, Plan, Executor, Optimizer.
Each frees its handle on close() (or garbage collection) in the order the header requires.

The public face of the ctypes layer: its names live in the modules below it, one job each
(strata._abi: strata.h's constant tables; strata._sizes: what streaming takes of each tier;
strata._placement: place(); strata._tiering: the NVMe tier's budgets checked and its placement
chosen for a binding; strata._runtime: Runtime, Tensor; strata._streaming: Executor,
Optimizer), and are imported here, where users and the bindings find them; this module itself
says which library was loaded and where its header and CMake package are."""
import pathlib

from . import _lib
from ._abi import (BACKENDS, BACKWARD, DTYPES, FORWARD, GRAD_SUMS, LINKS,  # noqa: F401
                   MASTER_LAYOUTS, OPTIMIZERS, ROLES, STATE_PLACEMENTS, STATES, TIERS,
                   UPDATE_MODES, VIEW_ACTIVATION, VIEW_GRAD, VIEW_WEIGHT)
from ._abi import dump_text as _dump  # noqa: F401 (strata.step_plan's name for it)
from ._placement import Placement, place  # noqa: F401
from ._runtime import Runtime, Tensor  # noqa: F401
from ._sizes import (NVME_DRAM_MARGIN, accum_bytes, full_dram, grad_fetch_bytes,  # noqa: F401
                     grads_hbm_bytes, layout_sizes, layout_totals, pinned_dram,
                     placement_layers, state_bytes_per_param, streaming_budgets)
from ._streaming import Executor, Optimizer  # noqa: F401
from ._tiering import (HOST_SHARE, TierPlan, plan_budgets, tier_arguments,  # noqa: F401
                       choose as choose_placement)

L = _lib.lib


def version():
    """The library's version, "MAJOR.MINOR.PATCH" (strata_version_string)."""
    return L.strata_version_string().decode()


def library_path():
    """The file of the libstrata this process loaded (the order in which one is chosen:
    strata._lib._find_library, docs/install.md; library_source() names the rule that chose it)."""
    return _lib.library_file


def library_source():
    """Which rule found the loaded library: "STRATA_LIBRARY", "bundled", "checkout" or
    "system"."""
    return _lib.library_source


def _beside_library(*relatives):
    lib_dir = pathlib.Path(library_path()).parent  # the link's own directory, not its target's
    return [lib_dir / r for r in relatives]


def include_dir():
    """The directory holding strata/strata.h for the loaded library, for C and C++ users
    (-I$(python -c 'import strata.core as c; print(c.include_dir())')): the wheel's strata/include,
    or an install prefix's include/, or this checkout's include/ for a build of it."""
    candidates = _beside_library("../include", "../../include") + [
        pathlib.Path(__file__).resolve().parents[3] / "include"]
    for candidate in candidates:
        if (candidate / "strata" / "strata.h").exists():
            return str(candidate.resolve())
    raise FileNotFoundError("strata/strata.h not found beside %s (looked in %s)"
                            % (library_path(), ", ".join(map(str, candidates))))


def cmake_dir():
    """The directory of the loaded library's CMake package (strataConfig.cmake), to pass as
    strata_DIR or on CMAKE_PREFIX_PATH for find_package(strata): present in the wheel and in a
    cmake --install prefix, not in a build tree."""
    for candidate in _beside_library("cmake/strata"):
        if (candidate / "strataConfig.cmake").exists():
            return str(candidate.resolve())
    raise FileNotFoundError("no CMake package beside %s: pip install . or cmake --install the "
                            "build it comes from" % library_path())


def dtype_size(dtype):
    """Bytes per element of a dtype name ("bfloat16": 2), as the library says."""
    return L.strata_dtype_size(DTYPES[dtype])
