"""Filling Strata's tensors with a streamed model's values at setup (and at set_params), as
strata.torch does: straight into the runtime's DRAM (pinned) memory, converted on the way, with
no host copy of the model in between.

- A host value (numpy, or a JAX array on the CPU) is cast into the tensor's memory by numpy
  (np.copyto with the cast, over a view of the pinned memory) in chunks on a few threads, which
  release the GIL: one pass reads the values and writes the converted ones.
- A value on a GPU is converted there (one small jitted astype) and copied by the driver
  straight into the pinned memory (a D2H DMA at the link's rate: the FFI library's
  strata_jax_ffi_copy_to_host); without that library, through a host copy.

A tensor not in DRAM (NVMe) takes the host copy and strata_tensor_write."""
import ctypes
import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from .. import core

_CHUNK = 32 << 20  # bytes of source per task: large enough for numpy's loops, small for balance
_convert = jax.jit(lambda x, dtype: x.astype(dtype), static_argnums=1)


def _threads():
    return max(1, min(8, os.cpu_count() or 1))


def _is_host(value):
    """Whether `value`'s memory can be read by numpy without a transfer."""
    if isinstance(value, np.ndarray):
        return True
    return isinstance(value, jax.Array) and all(d.platform == "cpu" for d in value.devices())


class Writer:
    """Writes values into registered tensors (see the module's docstring). device: the
    trainer's JAX device; copy_to_host: the FFI library's D2H copy, or None. Use as a context
    manager (it owns a thread pool)."""

    def __init__(self, device, copy_to_host=None):
        self.device = device
        self.copy_to_host = copy_to_host if device.platform == "gpu" else None
        self._pool = ThreadPoolExecutor(_threads(), thread_name_prefix="strata-jax-weights")

    def close(self):
        self._pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def stage(self, value, dtype):
        """`value` ready to be written as `dtype`: host values as they are (cast while written),
        device values converted on their device (asynchronously: the write waits)."""
        if _is_host(value):
            return value
        if value.dtype != dtype:
            value = _convert(value, jnp.dtype(dtype))
        return value

    def write(self, tensor, value, dtype):
        """`value` (a staged value of the tensor's element count) into `tensor` as `dtype`."""
        dtype = np.dtype(dtype)
        count = int(np.prod(value.shape))
        nbytes = count * dtype.itemsize
        if nbytes == 0:
            return
        if tensor.info().tier != core.TIERS["dram"]:
            host = np.ascontiguousarray(np.asarray(value).astype(dtype, copy=False))
            tensor.write_pointer(host.ctypes.data, nbytes)
            return
        address = tensor.data_pointer()
        if not _is_host(value):
            if value.dtype != dtype:
                value = _convert(value, dtype)
            if self.copy_to_host is not None and len(value.devices()) == 1:
                value.block_until_ready()
                try:
                    self.copy_to_host(address, value.unsafe_buffer_pointer(), nbytes)
                    return
                except RuntimeError as e:
                    # Correct either way: the rest go through host memory, slower.
                    warnings.warn("strata.jax: the driver's copy into Strata's memory failed "
                                  "(%s); setup copies through host memory instead" % e,
                                  RuntimeWarning, stacklevel=3)
                    self.copy_to_host = None
            value = np.asarray(value)  # through host memory (XLA's own D2H)
        src = np.asarray(value).reshape(-1)
        dst = np.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=dtype)
        step = max(1, _CHUNK // max(src.itemsize, 1))
        if count <= step:
            np.copyto(dst, src, casting="unsafe")
            return
        # numpy releases the GIL in its copy and cast loops: the chunks run in parallel.
        list(self._pool.map(lambda b: np.copyto(dst[b:b + step], src[b:b + step],
                                                casting="unsafe"), range(0, count, step)))
