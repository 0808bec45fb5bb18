"""Atomic checkpoint directories through the library (strata.h "Atomic directories"): one
implementation, the runtime's, for every framework that writes its own files beside Strata's
checkpoint. A save calls begin(path), writes into staging(path) and calls commit(path); a load
reads resolve(path), which falls back to "<path>.old" after a crash between the two renames of
a file system without renameat2(RENAME_EXCHANGE)."""
import ctypes
import os

from . import _lib
from .errors import check

L = _lib.lib


def _encoded(path):
    return os.fsencode(os.fspath(path))


def _text(fn, path):
    """A strata_atomic_dir_{staging,resolve} call: the length asked first, then the path."""
    n = ctypes.c_size_t()
    check(fn(_encoded(path), None, 0, ctypes.byref(n)))
    buf = ctypes.create_string_buffer(n.value + 1)
    check(fn(_encoded(path), buf, n.value + 1, ctypes.byref(n)))
    return os.fsdecode(buf.value)


def staging(path):
    """The staging directory a save of `path` writes into (nothing is touched)."""
    return _text(L.strata_atomic_dir_staging, path)


def begin(path):
    """Prepare the staging directory of `path` (a crashed save's leftover removed, parents
    created); returns its path."""
    check(L.strata_atomic_dir_begin(_encoded(path)))
    return staging(path)


def commit(path):
    """Make the written staging directory `path`, durably and atomically; the previous version
    is removed."""
    check(L.strata_atomic_dir_commit(_encoded(path)))


def resolve(path):
    """The directory a load reads: `path`, or "<path>.old" left by an interrupted commit.
    Raises strata.errors.NotFound (a LookupError) when there is neither."""
    return _text(L.strata_atomic_dir_resolve, path)
