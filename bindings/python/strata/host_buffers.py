"""Host memory from libstrata (strata.h "Host buffers", since 1.5): the host bytes a binding
needs beside its tensors (spilled checkpoints, paged optimizer state, host replicas), each a
buffer the runtime maps, places on the device's NUMA node, faults in with its threads and pins
(on CUDA; ordinary memory on the host backend), charged with the runtime's DRAM arena against
one host budget. The rules (the budget's room, the page a buffer is charged to, the reserve of
the machine's memory it must leave available) are the library's; this module only calls it.

A HostBuffer is freed when it is garbage (or free()d), or with its runtime
(strata_runtime_destroy frees the buffers still live: the memory of a view kept past the
runtime's close is gone, so the owners free theirs first)."""

import ctypes
import weakref

from . import _lib
from .errors import check

L = _lib.lib


def set_budget(runtime, total):
    """The runtime's whole host budget: its DRAM arena and every host buffer (bytes)."""
    check(L.strata_runtime_set_host_budget(runtime.handle, int(total)))


def usage(runtime):
    """{budget, arena, buffers, count, room, reserve, available} in bytes (the library's
    strata_host_usage_t): the host budget, the arena's part, what the live buffers are charged,
    how many there are, the room one more may be charged now, the machine memory a buffer must
    leave available and the machine's available memory now (0: unknown)."""
    u = _lib.HostUsage()
    check(L.strata_runtime_host_usage(runtime.handle, ctypes.byref(u)))
    return {"budget": u.budget_bytes, "arena": u.arena_bytes, "buffers": u.buffer_bytes,
            "count": u.buffer_count, "room": u.room_bytes, "reserve": u.reserve_bytes,
            "available": u.available_bytes}


class HostBuffer:
    """One host buffer of `runtime`, `nbytes` long, every byte zero. Raises
    strata.errors.OutOfMemory when the host budget has no room for it or the machine would keep
    less than its reserve (usage() tells which), InvalidArgument for 0 bytes. `name` is for the
    library's messages. `before_free`: called just before the memory goes (a wait for the
    copies that may still read or write it). Attributes: nbytes (as asked), charged (what the
    budget counts), address, pinned (page-locked for the device's copies), numa_node."""

    def __init__(self, runtime, nbytes, name="", before_free=None):
        desc = _lib.HostBufferDesc(bytes=int(nbytes), name=name.encode())
        handle = ctypes.c_void_p()
        check(L.strata_host_buffer_create(runtime.handle, ctypes.byref(desc),
                                          ctypes.byref(handle)))
        self._free = weakref.finalize(self, _free, runtime, handle, before_free)
        self._free.atexit = False  # at exit the runtime's destroy (or the process) frees it
        info = _lib.HostBufferInfo()
        check(L.strata_host_buffer_get_info(runtime.handle, handle, ctypes.byref(info)))
        self.runtime = runtime
        self.nbytes = info.bytes
        self.charged = info.charged_bytes
        self.address = info.data
        self.pinned = bool(info.pinned)
        self.numa_node = info.numa_node

    def buffer(self):
        """The memory as a writable ctypes array (the buffer protocol: torch.frombuffer,
        numpy.frombuffer, memoryview) that keeps this buffer alive while it, or a view made
        from it, is."""
        array = (ctypes.c_uint8 * self.nbytes).from_address(self.address)
        array._owner = self
        return array

    def free(self):
        """Free it now (idempotent); no view of it may be used after."""
        self._free()

    @property
    def live(self):
        return self._free.alive


def _free(runtime, handle, before_free):
    if before_free is not None:
        try:
            before_free()
        except Exception:  # (at exit the device may be gone first)
            pass
    # Closed already: strata_runtime_destroy freed the buffer with the runtime.
    if runtime._handle is not None:
        check(L.strata_host_buffer_free(runtime._handle, handle))
