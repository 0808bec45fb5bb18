"""The blocks all-gathered for their passes under data parallelism: per block and pass the
executor loads this rank's chunks into a slot (1/shard_size of the block over this rank's PCIe
link); an all-gather over the shard group assembles the whole block in a gathered buffer (two,
alternating), the block's parameters point into it, and the slot is released at once in the
forward pass. The forward pass gathers block i+1 while block i computes; the backward pass
gathers block i-1 as block i releases. With pieces, the forward gather first gathers every
replica's piece (across the hosts) and keeps the chunks in the host replica for the backward
gather."""

import torch

from ...core import BACKWARD, FORWARD, VIEW_WEIGHT
from .replica import HostReplica
from .streams import handle, on, record


class BlockGathers:
    """The gathered blocks of a ShardedLayout over `mesh`, on its communication stream `comm`
    (None on the CPU). Every method takes the session whose blocks they are."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.pieces = mesh.pieces
        self.layer_elements = []  # per block: elements of its gathered buffer
        self.buffers = [None, None]  # gathered blocks, alternating (even / odd blocks)
        self.chunk_elements = []  # with pieces, per block: its chunks' elements
        self.chunk_buffers = [None, None]  # with pieces: the block's chunks, alternating
        self.replica = None  # with pieces: the HostReplica of this rank's chunks
        self.free = [None, None]  # per buffer: event after the last compute that read it
        self.holding = [None, None]  # per buffer: (step_id, block) it holds
        self.ready = {}  # block -> (buffer, event): gathered, waiting for its compute
        self.comm = None  # the communication stream on CUDA (ShardedLayout.attach)

    def lay_out(self, s):
        """Each parameter's place in its block's gathered buffer and chunks, and with pieces
        the host replica (charged against the session's host budget)."""
        for entries in s.layers:
            offset = chunks = 0
            for sp in entries:
                sp.offset, sp.chunk_offset = offset, chunks
                offset += self.mesh.shard_size * sp.chunk
                chunks += sp.chunk
            self.layer_elements.append(offset)
            self.chunk_elements.append(chunks)
        if self.pieces > 1:
            self.replica = HostReplica(self.chunk_elements, s.dtype, s.host_budget)
            if s.host_budget is not None:
                s.host_budget.add("host replica of the weights", self.replica)

    def _buffer(self, s, b):
        if self.buffers[b] is None:
            self.buffers[b] = torch.empty(max(self.layer_elements), dtype=s.dtype,
                                          device=s.device)
        return self.buffers[b]

    def _chunk_buffer(self, s, b):
        if self.chunk_buffers[b] is None:
            self.chunk_buffers[b] = torch.empty(max(self.chunk_elements), dtype=s.dtype,
                                                device=s.device)
        return self.chunk_buffers[b]

    def _chunks(self, s, index, phase, b, what):
        """With pieces, on the communication stream: block `index`'s chunks of this rank, whole,
        in a chunk buffer (its parameters' chunks at their chunk_offset). The forward pass
        gathers every replica's updated piece (across the hosts) and keeps the chunks in the
        host replica for the backward pass, which copies them back from there: the same stream
        orders the two copies, and a forward pass always precedes its backward pass."""
        chunks = self._chunk_buffer(s, b)
        n = self.chunk_elements[index]
        host = self.replica.blocks[index]
        if phase == BACKWARD:
            chunks[:n].copy_(host, non_blocking=True)
            return chunks
        works = []
        for sp in s.layers[index]:
            piece = torch.from_dlpack(s.executor.view(index, phase, VIEW_WEIGHT, sp.index))
            out = chunks[sp.chunk_offset:sp.chunk_offset + sp.chunk]
            works.append(self.mesh.gather_pieces(out, piece, what + " across the replicas"))
            del piece
        for work in works:
            self.mesh.wait(work, what + " across the replicas")
        host.copy_(chunks[:n], non_blocking=True)
        return chunks

    def gather(self, s, index, phase):
        """Acquire block `index` (this rank's chunks) and all-gather it into its buffer, on the
        communication stream; the forward pass releases the slot at once."""
        b = index % 2
        buf = self._buffer(s, b)
        what = "gathering block %d (%s)" % (index, "forward" if phase == FORWARD else "backward")
        shards = self.mesh.shard_size
        with on(self.comm):
            if self.free[b] is not None:
                self.comm.wait_event(self.free[b])
            s.executor.acquire(index, phase, handle(self.comm))
            chunks = self._chunks(s, index, phase, b, what) if self.pieces > 1 else None
            works = []
            for sp in s.layers[index]:
                if chunks is None:
                    chunk = torch.from_dlpack(s.executor.view(index, phase, VIEW_WEIGHT,
                                                              sp.index))
                else:
                    chunk = chunks[sp.chunk_offset:sp.chunk_offset + sp.chunk]
                out = buf[sp.offset:sp.offset + shards * sp.chunk]
                works.append(self.mesh.all_gather(out, chunk, what))
                del chunk
            for work in works:
                self.mesh.wait(work, what)
            if phase == FORWARD:
                s.executor.release(index, FORWARD, handle(self.comm))
            event = record(self.comm)
        self.holding[b] = (s.step_id, index)
        self.ready[index] = (b, event)

    def acquire(self, s, index, phase):
        """Block `index` gathered for `phase` (the next one's gather issued in the forward
        pass) and its parameters pointing into its buffer, the current stream waiting for it."""
        if phase == FORWARD:
            if index not in self.ready:
                self.gather(s, index, FORWARD)
            if index + 1 < len(s.layers):
                self.gather(s, index + 1, FORWARD)  # overlaps block index's compute
        elif index not in self.ready:
            b = index % 2
            if self.holding[b] == (s.step_id, index):
                # The turnaround: the last block's forward gather is still in its buffer.
                with on(self.comm):
                    s.executor.acquire(index, BACKWARD, handle(self.comm))
                    self.ready[index] = (b, record(self.comm))
            else:
                self.gather(s, index, BACKWARD)
        b, event = self.ready.pop(index)
        if event is not None:
            torch.cuda.current_stream(s.device).wait_event(event)
        buf = self.buffers[b]
        for sp in s.layers[index]:
            sp.check_untouched()
            sp.param.data = buf[sp.offset:sp.offset + sp.numel].view(sp.shape)

    def computed(self, s, index):
        """Block `index`'s compute is queued: its buffer is free once that has run."""
        if s.cuda:
            self.free[index % 2] = record(torch.cuda.current_stream(s.device))
