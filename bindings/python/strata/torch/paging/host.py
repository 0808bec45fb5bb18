"""The host side of the paged state: a host tensor per paged tensor, views of host buffers of
the session's runtime under its one host budget (strata.h "Host buffers"), made at the first
page-out at their exact size (not torch's pinned allocator, which rounds a buffer up to a
power of two) and pinned by the runtime on CUDA."""

import torch

from .. import _planning
from .groups import aligned, nbytes


class HostCopies:
    """The host copies of a StatePager's tensors, keyed (id(master), key). `budget`: the
    session's strata.torch._planning.HostBudget (None: a pager made outside strata.torch.AdamW,
    torch's own memory); `stream`: the pager's copy stream (None: the CPU), which a buffer
    waits for before it is freed."""

    def __init__(self, budget, stream):
        self.budget = budget
        self.stream = stream
        self.host = {}  # (id(master), key) -> host tensor (a view of a host buffer)
        self.registered = []  # (bytes charged, uint8 tensor) of each host buffer (memory)

    @property
    def host_bytes(self):
        """Bytes of host memory the host copies hold (their buffers' charges)."""
        return sum(charged for charged, _ in self.registered)

    def clear(self):
        """Nothing pages any more: the host memory goes."""
        self.host, self.registered = {}, []

    def pairs(self, pending):
        """(tensor, host tensor) for `pending` [(key, tensor)], the host tensors made once, in
        one host buffer for each page-out that meets new tensors (a tensor that changed shape
        gets a new one)."""
        missing = [(k, t) for k, t in pending
                   if k not in self.host or self.host[k].shape != t.shape
                   or self.host[k].dtype != t.dtype]
        if missing:
            buffer = self.memory(sum(aligned(nbytes(t)) for _, t in missing))
            offset = 0
            for k, t in missing:
                n = nbytes(t)
                self.host[k] = buffer[offset:offset + n].view(t.dtype).view(t.shape)
                offset += aligned(n)
        return [(t, self.host[k]) for k, t in pending]

    def memory(self, size):
        """A zero uint8 host tensor of `size` bytes for the host copies, recorded in
        `registered`: a host buffer of the session's runtime under its host budget (pinned by
        the runtime on CUDA; freed once no host copy views it, after the pager's copies), or
        without a budget (a pager made outside strata.torch.AdamW) torch's own memory,
        page-locked by torch's pinned allocator on CUDA."""
        if self.budget is None:
            memory = torch.zeros(size, dtype=torch.uint8, pin_memory=self.stream is not None)
            self.registered.append((memory.numel(), memory))
            return memory
        stream = self.stream
        buf, why = self.budget.allocate(
            size, "paged optimizer state",
            before_free=None if stream is None else stream.synchronize)
        if buf is None:
            raise RuntimeError(
                "strata.torch: no host memory for %d bytes of the resident parameters' "
                "optimizer state: %s; raise host_budget, or set strata.torch.AdamW.PAGED_STATE "
                "= 0 to keep it in HBM"
                % (size, "host_budget has %d bytes of room left" % self.budget.room()
                   if why == "budget" else "the machine's memory would have dropped below "
                   "the runtime's reserve (%d bytes available kept)" % self.budget.reserve()))
        memory = _planning.tensor(buf)
        self.registered.append((buf.charged, memory))
        return memory
