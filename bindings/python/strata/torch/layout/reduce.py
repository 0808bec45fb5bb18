"""The grads under data parallelism: each block's recomputed grads reduce-scattered (averaged)
straight into the slot's grad views, averaged over the replicas where there are several, and
the block released after that on a side stream (which first waits for the compute stream:
without a shard group nothing else orders the two), so the executor's D2H of the chunk and the
optimizer's landing follow while the compute stream goes on with the next block. With the
grads' fp32 sums on the device (offload(grads="device"), grad_dtype float32: the grad views are
the sums, in HBM) the reduction still runs in the compute dtype, into a temporary, and the side
stream adds it into the view before the release. The resident parameters' grads are averaged
over all ranks when the backward pass ends (as DDP does). And the grads' global sums of
squares, cached until a grad changes (CountingOptimizer)."""

import torch
import torch.nn.functional as F

from ...core import BACKWARD, VIEW_GRAD
from .streams import handle, on, record


class GradReducer:
    """The grads of a ShardedLayout over `mesh` (`residents`: the replicated parameters), on
    its reduce stream `reduce_stream` (None on the CPU). Every method that touches a block
    takes the session whose block it is."""

    def __init__(self, mesh, residents):
        self.mesh = mesh
        self.pieces = mesh.pieces
        self.residents = residents
        self.reduction = None  # (block, works, tensors to keep, (reduced, view) pairs)
        self.in_flight = []  # (event, tensors) the device may still read
        self.grad_version = 0
        self.sums = None  # (grad_version, {id(sp): global sum of squares})
        self.reduce_stream = None  # on CUDA (ShardedLayout.attach)

    def store(self, s, index, params, grads):
        """Reduce-scatter the block's grads (averaged over the shard group) into this rank's grad
        chunks in the slot; issued on the compute stream, waited for at release. The reduction
        runs in the DataParallel's reduce_dtype, by default the compute dtype (as DDP does),
        whatever the grad views' dtype: fp32 sums on the device (session.grads_in_place) must
        not double the bytes on the wire."""
        self.grad_version += 1
        what = "reducing block %d's grads" % index
        shards = self.mesh.shard_size
        in_place = s.grads_in_place
        works, keep, pairs = [], [], []
        for sp, g in zip(params, grads):
            if g is None:
                continue
            view = torch.from_dlpack(s.executor.view(index, BACKWARD, VIEW_GRAD, sp.grad_index))
            dtype = self.mesh.reduce_dtype or s.dtype
            full = g.reshape(-1).to(dtype).contiguous()
            if shards * sp.chunk != sp.numel:
                full = F.pad(full, (0, shards * sp.chunk - sp.numel))
            # With pieces the chunk's average goes on to the replicas' reduce-scatter; summed in
            # place, it is added into the view at release (finish): never written there
            # directly.
            out = view if dtype == view.dtype and self.pieces == 1 and not in_place else \
                torch.empty(sp.chunk, dtype=dtype, device=view.device)
            works.append(self.mesh.reduce_scatter(out, full, what))
            keep += [g, full, out]
            pairs.append((out, view))
            s.delivered.append(sp)
        self.reduction = (index, works, keep, pairs)

    def finish(self, s, index):
        """On the reduce stream: wait for the block's reduce-scatters, average over the
        replicas, round into the grad views (or add into them where they are the fp32 sums:
        session.grads_in_place), release the block (its grads leave for DRAM, or count as
        landed in HBM)."""
        in_place = s.grads_in_place
        block, works, keep, pairs = self.reduction or (index, [], [], [])
        self.reduction = None
        what = "reducing block %d's grads" % index
        if s.cuda:
            # Everything below reads what the compute stream wrote (the grads, and their copy
            # into `out` or the view where no shard group reduce-scatters: shard_size 1). A
            # shard group's NCCL reduce-scatter, issued on the compute stream and waited for
            # below, orders the reduce stream after it only when there is one; without it the
            # replicas' collectives (and the release's D2H) would run on whatever the buffers
            # held before the compute stream got there.
            self.reduce_stream.wait_stream(torch.cuda.current_stream(s.device))
        with on(self.reduce_stream):
            for work in works:
                self.mesh.wait(work, what)
            if self.pieces > 1:  # each replica gets the average of its piece of the chunk
                replicas = []
                for i, (out, view) in enumerate(pairs):
                    piece = view if out.dtype == view.dtype and not in_place else \
                        torch.empty(view.numel(), dtype=out.dtype, device=view.device)
                    replicas.append(self.mesh.scatter_pieces(
                        piece, out, what + " across the replicas"))
                    keep.append(piece)
                    pairs[i] = (piece, view)
            else:
                replicas = [self.mesh.average_replicas(out, what + " over the replicas")
                            for out, _ in pairs]
            for work in replicas:
                self.mesh.wait(work, what + " over the replicas")
            for out, view in pairs:
                if in_place:  # before the release: it fences the sums' landing
                    view.add_(out)
                elif out is not view:
                    view.copy_(out)
            del pairs
            s.executor.release(index, BACKWARD, handle(self.reduce_stream))
            event = record(self.reduce_stream)
        if event is not None:
            self.in_flight = [(e, t) for e, t in self.in_flight if not e.query()]
            self.in_flight.append((event, keep))

    def backward_ended(self):
        """step_end waited for the grads' copies, which followed every reduction; the
        resident parameters' grads are averaged once autograd's backward pass is done."""
        self.in_flight = []
        if self.residents:
            torch.autograd.Variable._execution_engine.queue_callback(self._average_residents)

    def _average_residents(self):
        """At the end of the backward pass: the resident parameters' grads averaged over all
        ranks (the streamed ones were averaged block by block). Each rank's grad may already
        hold an earlier pass's average (accumulation); the average of that plus this pass's
        local grad is still the average of both passes, as with DDP."""
        what = "averaging the resident parameters' grads"
        # The ranks agree first on which parameters have a grad: one whose forward skipped a
        # module (a batch without images never runs a vision tower) has none where another
        # has, and the averages must pair up (each rank reducing only its own grads would
        # mismatch the collectives). A rank without one adds zeros, as DDP counts an unused
        # parameter, so every replica takes the same average and stays in sync.
        graded = self.mesh.sum_all([float(p.grad is not None) for p in self.residents],
                                   "agreeing on the resident parameters with grads")
        for p, count in zip(self.residents, graded):
            if count and p.grad is None:
                p.grad = torch.zeros_like(p)
        works = [self.mesh.average_all(p.grad, what) for p, count in zip(self.residents, graded)
                 if count]
        for work in works:
            self.mesh.wait(work, what)

    def grad_sums(self, s, params):
        """Global sums of squares: each rank's chunks' sums, added over the shard group (with
        pieces: each rank's pieces' sums, added over every rank), for every trainable parameter
        at once, cached until a grad changes."""
        if self.sums is None or self.sums[0] != self.grad_version:
            trainable = [sp for entries in s.layers for sp in entries if sp.trainable]
            local = [s.optimizer.grad_info(sp.weight)[1] for sp in trainable]
            if self.pieces > 1:
                total = self.mesh.sum_all(local, "summing the grads' squares over the pieces")
            else:
                total = self.mesh.sum_shards(local, "summing the grads' squares over the shards")
            self.sums = (self.grad_version, {id(sp): v for sp, v in zip(trainable, total)})
        return [self.sums[1][id(sp)] for sp in params]


class CountingOptimizer:
    """The session's core.Optimizer, noting every change of a held grad (scaling, writing,
    zeroing), so the cached global sums of squares are recomputed after one: the cache makes the
    per-grad norm requests of clip_grad_norm_ one collective instead of one each."""

    def __init__(self, optimizer, reducer):
        self._optimizer, self._reducer = optimizer, reducer

    def __getattr__(self, name):
        return getattr(self._optimizer, name)

    def grad_scale(self, weight, factor):
        self._reducer.grad_version += 1
        return self._optimizer.grad_scale(weight, factor)

    def grad_write(self, weight, pointer, count):
        self._reducer.grad_version += 1
        return self._optimizer.grad_write(weight, pointer, count)

    def grad_zero(self, weight, keep_zeros=False):
        self._reducer.grad_version += 1
        return self._optimizer.grad_zero(weight, keep_zeros)
