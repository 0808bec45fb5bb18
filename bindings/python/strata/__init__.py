"""Strata: a memory-tiering runtime for training models larger than GPU memory.

Python bindings over the stable C ABI (libstrata.so, loaded with ctypes: no compiled
extension, no libtorch linkage). strata.torch streams a PyTorch model's blocks through HBM."""
from .core import (Executor, Optimizer, Runtime, Tensor, version, dtype_size,  # noqa: F401
                   FORWARD, BACKWARD, VIEW_WEIGHT, VIEW_GRAD, VIEW_ACTIVATION)
from .errors import (StrataError, InvalidArgument, OutOfMemory, NotFound,  # noqa: F401
                     InvalidState, DataCorruption)

__version__ = version()  # the library's (strata_version_string): one source of truth
