"""The copies back of the paged state: while the backward pass computes, a share at each
streamed block so that the copies leave the link to the executor's weight transfers most of
the time (all at once, an 8B's backward pass got 0.4 s slower on an H200), a group at a time
and only as far as the device has room for them beside what the rest of the backward pass
needs (the spill decision's estimate of a block's backward working set, the restores in
flight and the margin: strata.torch._spill.Spiller.backward_reserve). With a large batch the
blocks' checkpoints hold the device through the streamed blocks' backward: at 148 x 1024 an
8B's whole paged state (31 GB) arriving there ran out of memory."""

import torch

from .groups import aligned, nbytes


class Inbound:
    """The groups on their way back to `device`, their memory from `buffers` (FlatBuffers),
    copied on `stream` (None: the CPU, copied at once). `reserve`: what the backward pass may
    still allocate beyond what it holds when a block's backward begins (a callable giving
    bytes or None; None: unknown, and the copies back follow the schedule alone)."""

    def __init__(self, buffers, device, stream, reserve):
        self.buffers = buffers
        self.device = device
        self.stream = stream
        self.reserve = reserve
        self.coming = []  # the pieces not yet queued back: [(group index, [(tensor, host)])]
        self.arrived = None  # event after the copies back, for the step to wait on

    def queue(self, share, room, paged_bytes):
        """Queue copies back, a group at a time, until `share` of the `paged_bytes` are
        queued (the device memory allocated on the current stream, which the backward pass
        uses). `room`: the bytes the device may give them now (None: no limit); a group that
        does not fit waits for a later call. The share counts bytes copied, as the copies out
        do; the room, the device memory a group's buffer takes (each tensor in it aligned)."""
        left = sum(nbytes(h) for _, pairs in self.coming for _, h in pairs)
        quota = None if share >= 1.0 else left - paged_bytes * (1.0 - max(0.0, share))
        batch = []
        try:
            while self.coming and (quota is None or quota > 0):
                g, pairs = self.coming[0]
                size = sum(aligned(nbytes(h)) for _, h in pairs)
                if room is not None and size > room:
                    break
                # Queued once its memory is there: an allocation that fails (out of memory,
                # in a backward pass) leaves the group to come, and the groups allocated
                # before it are copied all the same (finally), not lost to the step.
                self.buffers.allocate(g, pairs)
                self.coming.pop(0)
                batch.extend(pairs)
                if room is not None:
                    room -= size
                if quota is not None:
                    quota -= sum(nbytes(h) for _, h in pairs)
        finally:
            self._copy_in(batch)

    def _copy_in(self, batch):
        """Queue the copies back of `batch` [(device tensor, host copy)] (their memory
        allocated on the current stream) on the copy stream; `arrived` follows them."""
        if not batch:
            return
        if self.stream is None:
            for t, h in batch:
                t.copy_(h)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for t, h in batch:
                t.copy_(h, non_blocking=True)
            self.arrived = torch.cuda.Event()
            self.arrived.record(self.stream)

    def wait(self):
        """The current stream waits for the copies back queued so far: whether they were
        still under way (the host did not wait)."""
        if self.arrived is None:
            return False
        late = not self.arrived.query()
        torch.cuda.current_stream(self.device).wait_event(self.arrived)
        self.arrived = None
        return late

    def room(self):
        """The device memory the copies back may take now: what torch could still allocate
        (free on the device, and cached by torch but unused) less what the rest of the
        backward pass may need (`reserve`); None where that is not known (the CPU, or no
        estimate: the schedule alone decides, as before the estimate existed)."""
        if self.stream is None or self.reserve is None:
            return None
        reserve = self.reserve()
        if reserve is None:
            return None
        free, _ = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - \
            torch.cuda.memory_allocated(self.device)
        return free + cached - reserve
