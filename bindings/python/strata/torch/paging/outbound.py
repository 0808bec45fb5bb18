"""The copies out of the paged state: after the update, copied to host memory on the pager's
own stream while the next forward pass computes, a share issued at each block's forward start
(issued at once, they held a loss.item() after the step behind them on the copy engine); a
group's device memory freed FREE_LAG block starts after the one that issued its last copy (in
stream order, the compute stream waiting for the copies, the host never), the rest when the
forward pass reaches its last streamed block (StatePager.release)."""

import torch

from .groups import nbytes, take


class Outbound:
    """The copies out of one page-out, issued on `stream` (None: the CPU, copied at once) and
    their groups' flat buffers (`buffers`, FlatBuffers) freed as the forward pass goes."""

    # A group's device memory is freed this many forward points (block starts) after the one
    # that issued its last copy out: at a fixed point, so the memory a step uses does not
    # depend on how fast the copies ran and what the activation keeper measures holds in
    # every later step. Freed in stream order: the compute stream waits for the copies'
    # event first, the host never (the host runs blocks ahead of the device, far ahead
    # through the resident blocks, which load nothing: waiting there, 35 times a step, cost
    # an 8B's forward pass 0.14 s on an H200). The copies run at ~53 GB/s there, a share (1
    # GB) in less than a block's forward pass at 32 x 1024 (27 ms): the device rarely waits.
    FREE_LAG = 2

    def __init__(self, buffers, device, stream):
        self.buffers = buffers
        self.device = device
        self.stream = stream
        self.pieces = []  # the page-out's pairs by group: [(group index, [(tensor, host)])]
        self.count = 0  # its pairs
        self.paged_bytes = 0  # their bytes
        self.unsent, self.sent, self.ready = [], 0, None
        self.departed = None  # event after the copies out
        # Groups whose copies out are all issued: [(forward point, event after their copies,
        # [group index])], in issue order; each is freed FREE_LAG forward points after the one
        # that issued it (free_departed), and the groups freed so far (indices). Freed there,
        # not at the forward pass's last block: the blocks that keep their activations after
        # them take the room (an 8B at 32 x 1024: 31 GB held to the end left no room for any
        # streamed block to keep its activations).
        self.departing = []
        self.freed = set()
        self.point = 0  # the forward point whose share send issues

    def start(self, pairs, pieces, paged_bytes, current):
        """A page-out of `pairs` [(tensor, host copy)] (`pieces`: by group) after the update
        queued on the current stream; `current`: the host copies hold their values already
        (nothing to copy: every group may go at the first forward points)."""
        self.pieces, self.count, self.paged_bytes = pieces, len(pairs), paged_bytes
        self.unsent, self.sent = ([], paged_bytes) if current else (list(pairs), 0)
        self.departed = None
        self.departing, self.freed = [], set()
        self.point = 0
        if current:
            self.departing.append((-self.FREE_LAG, None, [g for g, _ in pieces]))
        if self.stream is not None:
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(self.device))

    @torch.no_grad()
    def send(self, share):
        """Issue the copies out until `share` of the paged bytes are issued (all: 1): the
        event before the batch's copies on CUDA (timing them), else None."""
        if not self.unsent:
            return None
        before_count = self.count - len(self.unsent)
        batch, taken = take(self.unsent, None if share >= 1.0
                            else self.paged_bytes * share - self.sent)
        self.sent += taken
        if not batch:
            return None
        done = self.groups_issued(before_count, before_count + len(batch))
        if self.stream is None:
            for t, h in batch:
                h.copy_(t)
            if done:
                self.departing.append((self.point, None, done))
            return None
        self.stream.wait_event(self.ready)
        with torch.cuda.stream(self.stream):
            before = torch.cuda.Event(enable_timing=True)
            before.record(self.stream)
            for t, h in batch:
                h.copy_(t, non_blocking=True)
            self.departed = torch.cuda.Event(enable_timing=True)
            self.departed.record(self.stream)
        if done:
            self.departing.append((self.point, self.departed, done))
        return before

    def groups_issued(self, before, after):
        """The groups whose last pair is among pairs[before:after] (their copies out all issued
        by this batch)."""
        done, end = [], 0
        for g, pairs in self.pieces:
            end += len(pairs)
            if before < end <= after:
                done.append(g)
        return done

    @torch.no_grad()
    def free_departed(self, point):
        """At forward point `point`: free the device memory of the groups issued FREE_LAG or
        more points before, after their copies in stream order. The memory came from the
        current stream's pool (page_in allocates there) and goes back to it: what reuses it
        runs on that stream after the wait, the copies' reads done."""
        while self.departing and self.departing[0][0] <= point - self.FREE_LAG:
            _, event, groups = self.departing.pop(0)
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
            for g in groups:
                self._free_group(g)

    def _free_group(self, g):
        """Free group `g`'s flat buffer, whose memory page_in took from the current stream's
        pool. Tensors not (yet) views of one (the first page-out's, a load's) may come from
        another stream's pool (the optimizer made them elsewhere): release() frees them, after
        the host waited for the copies."""
        pairs = dict(self.pieces)[g]
        if g not in self.buffers.flats or not self.buffers.holds(t for t, _ in pairs):
            return
        self.buffers.free(g)
        self.freed.add(g)

    def cancel(self):
        """A write while still in HBM: the copies not issued are dropped, and no group is
        freed later."""
        self.unsent = []
        self.departing = []

    def all_gone(self, pieces):
        """Every group of `pieces` left the device: nothing more to free."""
        self.departing, self.freed = [], set(g for g, _ in pieces)

    def leaving_bytes(self):
        """The paged bytes still on the device on their way out."""
        pieces = dict(self.pieces)
        return self.paged_bytes - sum(nbytes(t) for g in self.freed for t, _ in pieces[g])
