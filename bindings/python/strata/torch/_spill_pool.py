"""The host buffers of spilled block checkpoints (strata.torch._spill): one per block position,
kept from step to step, buffers of the session's runtime under its one host budget."""

import torch

from . import _planning


class HostPool:
    """The host buffers of spilled checkpoints, one per block position, reused from step to
    step: buffers of the session's runtime (strata.h "Host buffers"), charged against its host
    budget (`budget`: the session's strata.torch._planning.HostBudget) and pinned by it on
    CUDA (ordinary memory on the CPU). Without a budget (a pool outside a session, as the
    tests make one) its buffers are torch's own unpinned memory, counted by nobody."""

    def __init__(self, budget=None):
        self.budget = budget
        self.buffers = {}  # position -> uint8 tensor over its host buffer (keeping it alive)
        self.charged = {}  # position -> the bytes its buffer is charged
        self.refused = 0  # buffers refused for lack of host memory
        self.over_budget = 0  # buffers refused because host_budget had no room left
        self.wanted = 0  # the bytes of the last buffer refused for the budget
        self.last_refusal = None  # why the last refusal: "host" or "budget"

    @property
    def nbytes(self):
        return sum(b.numel() for b in self.buffers.values())

    @property
    def host_bytes(self):
        """What a HostBudget counts: the buffers' charges."""
        return sum(self.charged.values())

    def holds(self, position, nbytes):
        buf = self.buffers.get(position)
        return buf is not None and buf.numel() >= nbytes

    def reserve(self, position, nbytes):
        """Buffer `position` holds at least `nbytes`; False when the host budget has no room
        for it (the runtime's figure) or the machine would keep less than its reserve
        available (the runtime's rule)."""
        if self.holds(position, nbytes):
            return True
        self.release(position)
        if self.budget is None:  # outside a session: torch's own memory, counted by nobody
            self.buffers[position] = torch.empty(nbytes, dtype=torch.uint8)
            self.charged[position] = nbytes
            return True
        buf, why = self.budget.allocate(nbytes, "spilled checkpoint %d" % position)
        if buf is None:
            if why == "budget":
                self.wanted = nbytes
            return self._refuse(why)
        self.buffers[position] = _planning.tensor(buf)
        self.charged[position] = buf.charged
        return True

    def host_refusal(self):
        """Why the host refused a buffer, for messages: the runtime's reserve rule."""
        if self.budget is None:
            return "no host budget to take them from"
        return ("less than the runtime's reserve of the machine's memory, %.2f GiB, would have "
                "stayed available, or the memory could not be pinned"
                % (self.budget.reserve() / (1 << 30)))

    def _refuse(self, why):
        if why == "budget":
            self.over_budget += 1
        else:
            self.refused += 1
        self.last_refusal = why
        return False

    def view(self, position, t):
        """Buffer `position` as a tensor of t's shape and dtype (None when there is none or it
        is too small)."""
        buf = self.buffers.get(position)
        nbytes = t.numel() * t.element_size()
        if buf is None or buf.numel() < nbytes:
            return None
        return buf[:nbytes].view(t.dtype).view(t.shape)

    def release(self, position):
        """Let go of buffer `position`: the runtime frees it once no view of it is left."""
        self.buffers.pop(position, None)
        self.charged.pop(position, None)

    def close(self):
        for position in list(self.buffers):
            self.release(position)
