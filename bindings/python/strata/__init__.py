"""Strata: a memory-tiering runtime for training models larger than GPU memory.

Python bindings over the stable C ABI (libstrata.so, loaded with ctypes: no compiled
extension, no libtorch linkage). strata.torch streams a PyTorch model's blocks through HBM."""
from .core import (Executor, Optimizer, Runtime, Tensor, version, FORWARD, BACKWARD,  # noqa: F401
                   VIEW_WEIGHT, VIEW_GRAD, VIEW_ACTIVATION)
from .errors import (StrataError, InvalidArgument, OutOfMemory, NotFound,  # noqa: F401
                     InvalidState, DataCorruption)

__version__ = "1.0.0"
