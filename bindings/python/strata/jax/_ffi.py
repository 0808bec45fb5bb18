"""The XLA FFI custom calls of strata.jax: beginning and ending the executor's step, acquiring
and releasing a streamed layer, as ops inside the XLA program (csrc/strata_jax_ffi.cc says
what each op does); and the driver copy setup writes device values into Strata's DRAM with.

The library is built on first use with the system C++ compiler against jaxlib's FFI headers
(jax.ffi.include_dir()), strata.h and the libstrata.so.1 this package loaded, and cached under
$STRATA_JAX_FFI_CACHE (default ~/.cache/strata/jax_ffi), keyed by everything that goes into it.
$STRATA_JAX_FFI_LIBRARY names a prebuilt one instead; `python -m strata.jax._ffi [DIR]` builds
it (into DIR) and prints its path. No CUDA toolkit is needed: the CUDA handlers reach the
driver at run time."""
import concurrent.futures
import ctypes
import hashlib
import itertools
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading

import jax
import numpy as np

from .. import _lib
from ..core import BACKWARD, FORWARD

_SOURCE = pathlib.Path(__file__).resolve().parent / "csrc" / "strata_jax_ffi.cc"
ACQUIRE, RELEASE = "strata_jax_acquire", "strata_jax_release"
BEGIN, END = "strata_jax_begin", "strata_jax_end"
TRAIN, EVAL = 0, 1  # the begin and end ops' modes
# The begin op's hook: (session, step, message, capacity) -> 0, or nonzero with the message.
HOOK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p,
                        ctypes.c_size_t)
_TARGETS = ((ACQUIRE, "Acquire"), (RELEASE, "Release"), (BEGIN, "Begin"), (END, "End"))
_lock = threading.Lock()
_state = {"lib": None, "error": None, "build": None}
_sessions = itertools.count(1)


class FfiUnavailable(RuntimeError):
    """The FFI library cannot be built or loaded here (the message says why)."""


def _strata_library():
    """The path of the libstrata the package loaded (a bare name from ctypes.util.find_library
    is looked up in this process's mappings)."""
    name = _lib.lib._name
    if os.path.dirname(name):
        return pathlib.Path(os.path.abspath(name))
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(None, 5)[-1].strip()
                if os.path.basename(path).startswith("libstrata.so"):
                    return pathlib.Path(path)
    except OSError:
        pass
    raise FfiUnavailable("cannot tell where %s was loaded from: set STRATA_LIBRARY" % name)


def _strata_include_dir():
    env = os.environ.get("STRATA_INCLUDE_DIR")
    candidates = [pathlib.Path(env)] if env else []
    lib_dir = _strata_library().resolve().parent
    # This checkout's include/, then beside the library (an install, or build/<preset>/lib).
    candidates += [pathlib.Path(__file__).resolve().parents[4] / "include",
                   lib_dir.parent / "include"] + [p / "include" for p in lib_dir.parents[1:3]] + [
                   pathlib.Path("/usr/local/include"), pathlib.Path("/usr/include")]
    for c in candidates:
        if (c / "strata" / "strata.h").exists():
            return c
    raise FfiUnavailable("strata.h not found (looked in %s): set STRATA_INCLUDE_DIR"
                         % ", ".join(map(str, candidates)))


def _compiler():
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") \
        or shutil.which("clang++")
    if not cxx:
        raise FfiUnavailable("no C++ compiler (c++, g++ or clang++; or set CXX)")
    return cxx


def build(out_dir=None):
    """Compile the FFI library (if not cached) and return its path."""
    strata_lib = _strata_library()
    include = _strata_include_dir()
    jax_include = pathlib.Path(jax.ffi.include_dir())
    if not (jax_include / "xla" / "ffi" / "api" / "ffi.h").exists():
        raise FfiUnavailable("jaxlib's FFI headers are missing from %s" % jax_include)
    cxx = _compiler()
    cmd = [cxx, "-std=c++17", "-O2", "-shared", "-fPIC", "-fvisibility=hidden",
           "-I" + str(include), "-I" + str(jax_include), str(_SOURCE),
           "-L" + str(strata_lib.parent), "-l:" + strata_lib.name,
           "-Wl,-rpath," + str(strata_lib.parent), "-ldl"]
    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), (include / "strata" / "strata.h").read_bytes(),
                 (jax_include / "xla" / "ffi" / "api" / "ffi.h").read_bytes(),
                 (jax_include / "xla" / "ffi" / "api" / "c_api.h").read_bytes(),
                 " ".join(cmd).encode()):
        key.update(part)
    digest = key.hexdigest()[:16]
    if out_dir is None:
        cache = os.environ.get("STRATA_JAX_FFI_CACHE",
                               os.path.join(os.path.expanduser("~"), ".cache", "strata",
                                            "jax_ffi"))
        out_dir = os.path.join(cache, digest)
    out_dir = pathlib.Path(out_dir)
    target = out_dir / "libstrata_jax_ffi.so"
    stamp = out_dir / "libstrata_jax_ffi.key"
    if target.exists() and stamp.exists() and stamp.read_text() == digest:
        return str(target)
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".libstrata_jax_ffi.", suffix=".so", dir=str(out_dir))
    os.close(fd)
    try:
        proc = subprocess.run(cmd + ["-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise FfiUnavailable("compiling %s failed (%s):\n%s" % (_SOURCE.name, " ".join(cmd),
                                                                     proc.stderr[-4000:]))
        os.replace(tmp, target)
        stamp.write_text(digest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return str(target)


def _platforms():
    try:
        return {d.platform for d in jax.devices()}
    except RuntimeError:
        return {"cpu"}


def start_build():
    """Start compiling the library on a thread (unless it is loaded, prebuilt, failed or being
    built): load() waits for it. The compile is a subprocess (about 15 s the first time on a
    machine), so it overlaps the trainer's setup (reading the blocks, creating the runtime)."""
    with _lock:
        if any(_state[k] is not None for k in ("lib", "error", "build")) or \
                os.environ.get("STRATA_JAX_FFI_LIBRARY"):
            return
        future = concurrent.futures.Future()

        def run():
            try:
                future.set_result(build())
            except BaseException as e:  # noqa: BLE001: load() raises it
                future.set_exception(e)

        _state["build"] = future
        threading.Thread(target=run, name="strata-jax-ffi-build", daemon=True).start()


def load():
    """The loaded FFI library with its targets registered with JAX (once per process).
    Raises FfiUnavailable with the reason when it cannot be had."""
    with _lock:
        if _state["lib"] is not None:
            return _state["lib"]
        if _state["error"] is not None:
            raise FfiUnavailable(_state["error"])
        try:
            building = _state["build"]
            path = os.environ.get("STRATA_JAX_FFI_LIBRARY") or (
                building.result() if building is not None else build())
            lib = ctypes.CDLL(path)
            lib.strata_jax_ffi_strata_version_address.restype = ctypes.c_void_p
            ours = ctypes.cast(_lib.lib.strata_version, ctypes.c_void_p).value
            theirs = lib.strata_jax_ffi_strata_version_address()
            if ours != theirs:
                raise FfiUnavailable(
                    "%s resolved another libstrata than the one strata loaded (%s): rebuild it "
                    "against that library" % (path, _lib.lib._name))
            lib.strata_jax_ffi_error.restype = ctypes.c_char_p
            lib.strata_jax_ffi_bind.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint32,
                                                ctypes.c_uint32,
                                                ctypes.POINTER(ctypes.c_uint64)]
            lib.strata_jax_ffi_unbind.argtypes = [ctypes.c_uint64]
            lib.strata_jax_ffi_set_hook.argtypes = [ctypes.c_uint64, HOOK]
            lib.strata_jax_ffi_state.argtypes = [ctypes.c_uint64] + [ctypes.c_void_p] * 3
            lib.strata_jax_ffi_set_steps.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
            lib.strata_jax_ffi_abandon.argtypes = [ctypes.c_uint64, ctypes.c_void_p]
            lib.strata_jax_ffi_copy_to_host.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                                        ctypes.c_uint64]
            gpu = "gpu" in _platforms()
            for target, name in _TARGETS:
                jax.ffi.register_ffi_target(
                    target, jax.ffi.pycapsule(getattr(lib, "StrataJax%sHost" % name)),
                    platform="cpu")
                if gpu:
                    jax.ffi.register_ffi_target(
                        target, jax.ffi.pycapsule(getattr(lib, "StrataJax%sCuda" % name)),
                        platform="CUDA")
        except FfiUnavailable as e:
            _state["error"] = str(e)
            raise
        except Exception as e:  # noqa: BLE001: any failure means the host-synchronised path
            _state["error"] = "%s: %s" % (type(e).__name__, e)
            raise FfiUnavailable(_state["error"]) from e
        _state["lib"] = lib
        return lib


def _check(lib, rc, what):
    if rc != 0:
        raise RuntimeError("strata.jax ffi: %s: %s" % (what, lib.strata_jax_ffi_error().decode()))


def copy_to_host(dst, src, nbytes):
    """Copy nbytes from device address src to host address dst (synchronous; the driver's
    cuMemcpy in the context owning src)."""
    lib = load()
    _check(lib, lib.strata_jax_ffi_copy_to_host(dst, src, nbytes), "copy_to_host")


class Session:
    """One trainer's binding of its executor to the ops of its compiled step."""

    def __init__(self):
        self.lib = load()
        self.id = next(_sessions)
        self._hook = None  # the ctypes callback, kept alive while the library may call it

    def bind(self, executor, layer_bytes):
        """layer_bytes: per layer, each weight's size in bytes (in the ops' result order)."""
        layers, leaves = len(layer_bytes), len(layer_bytes[0])
        flat = (ctypes.c_uint64 * (layers * leaves))(*[b for row in layer_bytes for b in row])
        _check(self.lib, self.lib.strata_jax_ffi_bind(self.id, executor.handle, layers, leaves,
                                                      flat), "bind")

    def set_hook(self, fn):
        """fn(step) runs in the begin op of each training step, before the executor's step
        begins (on XLA's thread, holding the GIL); an exception fails the op with its text."""
        def hook(_session, step, message, capacity):
            try:
                fn(int(step))
                return 0
            except BaseException as e:  # noqa: BLE001: reported through the op's error
                text = ("%s: %s" % (type(e).__name__, e)).encode()[:capacity - 1]
                ctypes.memmove(message, text, len(text))
                return 1

        self._hook = HOOK(hook)
        _check(self.lib, self.lib.strata_jax_ffi_set_hook(self.id, self._hook), "set_hook")

    def state(self):
        """(steps ended, steps abandoned, whether a step is open)."""
        steps, abandoned, open_ = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_int()
        _check(self.lib, self.lib.strata_jax_ffi_state(self.id, ctypes.byref(steps),
                                                       ctypes.byref(abandoned),
                                                       ctypes.byref(open_)), "state")
        return steps.value, abandoned.value, bool(open_.value)

    def set_steps(self, steps):
        _check(self.lib, self.lib.strata_jax_ffi_set_steps(self.id, int(steps)), "set_steps")

    def abandon(self):
        """Abandon a step left open by a failed program; True if there was one."""
        out = ctypes.c_int()
        _check(self.lib, self.lib.strata_jax_ffi_abandon(self.id, ctypes.byref(out)), "abandon")
        return bool(out.value)

    def close(self):
        if self.lib is not None:
            self.lib.strata_jax_ffi_unbind(self.id)
            self.lib = None

    # -- the ops (call them inside a traced function) ------------------------------------
    def acquire(self, token, dep, phase, shapes, layer=-1):
        """(token, weights): the layer's weights as arrays of `shapes` ([ShapeDtypeStruct])."""
        out = jax.ffi.ffi_call(ACQUIRE, [jax.ShapeDtypeStruct((), np.uint32)] + list(shapes),
                               has_side_effect=True)(
            token, dep, session=np.uint64(self.id), layer=np.int64(layer),
            phase=np.int32(FORWARD if phase == FORWARD else BACKWARD))
        return out[0], list(out[1:])

    def begin(self, token, mode=TRAIN):
        """The executor's step begins (mode EVAL: a forward-only one); returns the token."""
        return jax.ffi.ffi_call(BEGIN, jax.ShapeDtypeStruct((), np.uint32),
                                has_side_effect=True)(token, session=np.uint64(self.id),
                                                      mode=np.int32(mode))

    def end(self, token, mode=TRAIN):
        """The executor's step ends (mode EVAL: is abandoned); returns the token."""
        return jax.ffi.ffi_call(END, jax.ShapeDtypeStruct((), np.uint32),
                                has_side_effect=True)(token, session=np.uint64(self.id),
                                                      mode=np.int32(mode))

    def release(self, token, grads):
        """Hand the acquired backward layer its grads and release it; returns the token."""
        return jax.ffi.ffi_call(RELEASE, jax.ShapeDtypeStruct((), np.uint32),
                                has_side_effect=True)(token, *grads,
                                                      session=np.uint64(self.id))


if __name__ == "__main__":
    print(build(sys.argv[1] if len(sys.argv) > 1 else None))
