"""The runtime and its registered tensors: Runtime (the device backend and the HBM, DRAM and
NVMe tiers) and Tensor. Re-exported by strata.core."""
import ctypes
import os

from . import _lib
from ._abi import BACKENDS, DTYPES, LINKS, ROLES, TIERS
from .dlpack import capsule_from_managed
from .errors import check

L = _lib.lib


class Runtime:
    """A Strata runtime: the device backend and the HBM, DRAM (pinned, budgeted) and NVMe tiers.

    backend: "auto" (cuda where a GPU is usable, host otherwise), "cuda" or "host".
    Budgets in bytes; nvme: list of file paths (striped) or None. dram_fault_threads: threads
    that fault the DRAM arena in at creation (0: the library's default, one per core up to its
    cap)."""

    def __init__(self, backend="auto", hbm_budget=0, dram_budget=0, nvme=None, nvme_budget=0,
                 device=0, dram_fault_threads=0, dram_pinned=0):
        # dram_pinned: the DRAM arena's pinned part (strata_runtime_config_t.dram_pinned_bytes),
        # 0 = all of it.
        config = _lib.RuntimeConfig()
        check(L.strata_runtime_config_init(ctypes.byref(config)))
        config.dram_pinned_bytes = int(dram_pinned)
        config.device_backend = BACKENDS[backend]
        config.device_ordinal = device
        config.dram_fault_threads = int(dram_fault_threads)
        config.hbm_budget_bytes = int(hbm_budget)
        config.dram_budget_bytes = int(dram_budget)
        config.nvme_budget_bytes = int(nvme_budget)
        self._paths = None
        if isinstance(nvme, (str, bytes, os.PathLike)):
            nvme = [nvme]  # one path, not a sequence of characters
        if nvme:
            self._paths = (ctypes.c_char_p * len(nvme))(*[os.fsencode(p) for p in nvme])
            config.nvme_paths = self._paths
            config.nvme_path_count = len(nvme)
        handle = ctypes.c_void_p()
        check(L.strata_runtime_create(ctypes.byref(config), ctypes.byref(handle)))
        self._handle = handle
        self._owned = []  # graphs, plans, executors, optimizers: closed before the runtime

    @property
    def handle(self):
        if self._handle is None:
            raise ValueError("the runtime is closed")
        return self._handle

    def capabilities(self):
        caps = _lib.Capabilities()
        check(L.strata_runtime_capabilities(self.handle, ctypes.byref(caps)))
        return caps

    @property
    def backend(self):
        return {v: k for k, v in BACKENDS.items()}[self.capabilities().device_backend]

    def tier_usage(self, tier):
        u = _lib.TierUsage()
        check(L.strata_runtime_tier_usage(self.handle, TIERS[tier], ctypes.byref(u)))
        return {"budget": u.budget_bytes, "used": u.used_bytes, "largest_free": u.largest_free_bytes,
                "tensors": u.tensor_count, "pinned_budget": u.pinned_budget_bytes,
                "pinned_used": u.pinned_used_bytes, "dram_fallbacks": u.dram_fallbacks}

    def link_stats(self):
        out = {}
        for i, name in enumerate(LINKS):
            s = _lib.LinkStats()
            check(L.strata_runtime_link_stats(self.handle, i, ctypes.byref(s)))
            out[name] = {"bytes": s.bytes, "transfers": s.transfers, "busy_seconds": s.busy_ns * 1e-9}
        return out

    def reset_stats(self):
        check(L.strata_runtime_reset_stats(self.handle))

    def register(self, name, shape, dtype="float32", role="other", tier="dram"):
        shape = [int(d) for d in shape]
        dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        desc = _lib.TensorDesc(name=name.encode(), dtype=DTYPES[dtype], ndim=len(shape),
                               shape=dims, role=ROLES[role], home_tier=TIERS[tier])
        handle = ctypes.c_void_p()
        check(L.strata_tensor_register(self.handle, ctypes.byref(desc), ctypes.byref(handle)))
        return Tensor(self, handle)

    def trace_start(self):
        check(L.strata_trace_start(self.handle, None))

    def trace_flush(self, path):
        check(L.strata_trace_stop(self.handle))
        check(L.strata_trace_flush(self.handle, str(path).encode()))

    def save_checkpoint(self, path, optimizer=None):
        check(L.strata_checkpoint_save(self.handle, optimizer.handle if optimizer else None,
                                       str(path).encode()))

    def load_checkpoint(self, path, optimizer=None):
        check(L.strata_checkpoint_load(self.handle, optimizer.handle if optimizer else None,
                                       str(path).encode()))

    def close(self):
        if self._handle is None:
            return
        for obj in reversed(self._owned):
            obj.close()
        self._owned.clear()
        handle, self._handle = self._handle, None
        check(L.strata_runtime_destroy(handle))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Tensor:
    """A registered tensor (the handle stays valid until unregister())."""

    def __init__(self, runtime, handle):
        self.runtime = runtime
        self.handle = handle

    def info(self):
        i = _lib.TensorInfo()
        check(L.strata_tensor_get_info(self.runtime.handle, self.handle, ctypes.byref(i)))
        return i

    @property
    def name(self):
        return self.info().name.decode()

    @property
    def nbytes(self):
        return self.info().nbytes

    def write(self, data, offset=0):
        """Copy a bytes-like or contiguous buffer (anything with the buffer protocol) in."""
        view = memoryview(data).cast("B")
        buf = (ctypes.c_char * len(view)).from_buffer_copy(view) if view.readonly else \
            (ctypes.c_char * len(view)).from_buffer(view)
        check(L.strata_tensor_write(self.runtime.handle, self.handle, offset, buf, len(view)))

    def write_pointer(self, pointer, nbytes, offset=0):
        check(L.strata_tensor_write(self.runtime.handle, self.handle, offset, pointer, nbytes))

    def read(self, nbytes=None, offset=0):
        n = self.nbytes - offset if nbytes is None else nbytes
        buf = ctypes.create_string_buffer(n)
        check(L.strata_tensor_read(self.runtime.handle, self.handle, offset, buf, n))
        return buf.raw

    def data_pointer(self):
        """The address of the data in its tier (a pinned host pointer in DRAM, a device pointer
        in HBM on cuda); valid until the tensor moves or is unregistered."""
        out = ctypes.c_void_p()
        check(L.strata_tensor_data_pointer(self.runtime.handle, self.handle, ctypes.byref(out)))
        return out.value

    def read_pointer(self, pointer, nbytes, offset=0):
        check(L.strata_tensor_read(self.runtime.handle, self.handle, offset, pointer, nbytes))

    def __dlpack__(self, stream=None, max_version=None, **kwargs):
        out = ctypes.POINTER(_lib.DLManagedTensorVersioned)()
        check(L.strata_tensor_export_dlpack(self.runtime.handle, self.handle, ctypes.byref(out)))
        return capsule_from_managed(out, max_version)

    def __dlpack_device__(self):
        out = ctypes.POINTER(_lib.DLManagedTensorVersioned)()
        check(L.strata_tensor_export_dlpack(self.runtime.handle, self.handle, ctypes.byref(out)))
        device = (out.contents.dl_tensor.device.device_type, out.contents.dl_tensor.device.device_id)
        out.contents.deleter(out)
        return device

    def unregister(self):
        check(L.strata_tensor_unregister(self.runtime.handle, self.handle))
