"""Where a session's streamed parameters live across processes, as a component the session
calls: LocalLayout (this process's runtime holds every parameter whole) or ShardedLayout (data
parallelism, strata.torch._distributed: each rank holds a chunk of every parameter). The
session's registration, its step's acquire / release / grads, and every read and write of
values, grads and optimizer state go through its layout; so do the questions other modules
ask (may the blocks be laid out again, does resident state page, how a checkpoint is split).

ShardedLayout, the design (docs/architecture.md, "Data parallel"): each rank's Strata runtime
holds, per streamed parameter, one chunk of 1/shard_size of its flattened values (padded to a
multiple of 64 elements): the weight chunk, its grad chunk and the chunk's fp32 master and AdamW
moments, so the ranks of one shard group hold one copy of the training state between them, each
in its own pinned DRAM on its GPU's NUMA node, updated by its own CPU threads. Per block and
pass:

- the executor loads this rank's chunks into a slot (1/shard_size of the block over this rank's
  PCIe link); an all-gather over the shard group assembles the whole block in a gathered buffer
  (two, alternating), the block's parameters point into it, and the slot is released at once in
  the forward pass. The forward pass gathers block i+1 while block i computes.
- backward: the recomputed grads are reduce-scattered (averaged) straight into the slot's grad
  views, averaged over the replicas where there are several, and the block is released after
  that on a side stream (which first waits for the compute stream: without a shard group
  nothing else orders the two), so the executor's D2H of the chunk and the optimizer's landing
  follow, while the compute stream goes on with the next block, whose gather is issued at once.
  With the grads' fp32 sums on the device (offload(grads="device"), grad_dtype float32: the
  grad views are the sums, in HBM) the reduction still runs in the compute dtype, into a
  temporary, and the side stream adds it into the view before the release.
- the resident parameters (embedding, head, resident blocks) are replicas, their grads averaged
  over all ranks when the backward pass ends (as DDP does).

Everything reading values (state_dict, evaluation, grads' values, optimizer state) gathers the
chunks, so it is collective: every rank must make the same calls.

Pieces (DataParallel(state_across_hosts=True); docs/architecture.md, "Optimizer state across
hosts"): each chunk is cut once more into one piece per replica (host), and rank k of replica h
registers only piece h of its chunk k with Strata: its bf16 weight, grad, fp32 master and
moments. Each host's optimizer state and CPU update shrink by the number of hosts H. The
weights stay replicated per host: a forward gather all-gathers the pieces across the replicas
(the network) into chunk k on the device before the shard group's gather, and copies the chunk
to this rank's host replica of the block (pinned DRAM, `_HostReplica`) on the same stream; the
backward gather copies the chunk back from there instead of using the network again. The
grads are reduce-scattered over the shard group, then over the replicas (each rank gets the
average of its piece). The executor streams only the pieces; the replica is the layout's own,
written and read on its communication stream in order, so no ordering with the executor's
copies is needed; it is rewritten at every forward pass (never persisted: checkpoints hold
each rank's pieces).

With nvme= each rank's runtime has an NVMe tier of its own files, and what its DRAM budget cannot
hold of its chunks goes there as on one GPU (offload planned every rank's chunks within the same
budgets: strata.torch._planning.plan_nvme); one rank of those sharing a host's disks measures
them and each counts its share of the rates (strata.torch._session), and the ranks adopt one
placement before anything is registered (ShardedLayout.before_build)."""

import contextlib
import os

import torch
import torch.nn.functional as F

from ..core import BACKWARD, FORWARD, VIEW_GRAD, VIEW_WEIGHT
from . import _params, _planning
from ._distributed import chunk_elements, optimizer_threads
from ._streamed import StreamedParam


class LocalLayout:
    """Every streamed parameter whole in this process's runtime (no data parallelism)."""

    mesh = None
    # The blocks built without an optimizer may be laid out again by it (StrataSession.unbuild).
    can_relay = True
    # The resident parameters' optimizer state may page to host memory (strata.torch.paging).
    pages_resident_state = True
    # This process writes a checkpoint's shared files and swaps it in.
    lead = True
    # And the streamed part of it (the ranks of one replica hold the same chunks).
    writes_streamed = True

    def __init__(self):
        self.session = None

    def attach(self, session):
        """Called once by the session, its runtime created."""
        self.session = session

    # --- registration ----------------------------------------------------------------------

    def block_counts(self, blocks):
        """Elements per block this process keeps in DRAM."""
        return _planning.block_elements(blocks)

    def streamed_param(self, p, name, local, layer, index):
        return StreamedParam(p, name, local, layer, index)

    def before_build(self, optimizer):
        """The optimizer's settings for the build (core.Optimizer's), or None."""
        return optimizer

    def after_build(self):
        pass

    def register_param(self, sp, p):
        """Register a block parameter's weight and, when it trains, its grad (shapes only)."""
        self.session.register_shape(sp, sp.name, p.shape, p.requires_grad)

    def share_values(self, sp, values):
        """A block parameter's values made the same on every process before write_param
        (collective under data parallelism; here nothing to do)."""

    def write_param(self, sp, values, opt, group):
        """Write a block parameter's values (on the CPU or the compute device) into its weight
        and, when it trains, make it a param of `opt` in group `group`."""
        self.session.write_values(sp, values, opt, group)

    # --- the step --------------------------------------------------------------------------

    def acquire(self, index, phase):
        """The executor's acquire of the block, its parameters bound to the weights."""
        s = self.session
        s.executor.acquire(index, phase, s.stream())
        s.bind(index, phase)

    def release(self, index, phase):
        s = self.session
        s.unbind(index)
        s.executor.release(index, phase, s.stream())

    def store_grads(self, index, params, grads):
        """After block `index`'s backward: the grads of its trainable StreamedParams `params`
        (None where a parameter got none) into the acquired layer's grad views: copied, or
        added to the sums where the views are them (session.grads_in_place)."""
        s = self.session
        for sp, g in zip(params, grads):
            if g is not None:
                view = torch.from_dlpack(s.executor.view(index, BACKWARD, VIEW_GRAD,
                                                         sp.grad_index))
                if s.grads_in_place:
                    # The fp32 sum: zeroed at the backward load only where the param held no
                    # grad, else the earlier passes' sum (widened exactly, one fp32 rounding
                    # per add, as the optimizer's accumulators add).
                    view.add_(g)
                else:  # the view was zeroed when the backward pass began
                    view.copy_(g)
                del view
                s.delivered.append(sp)
            elif id(sp.param) not in s.held or sp.param.grad is None:
                s.ungraded.append(sp)

    def after_end(self, index, phase):
        """The session ended block `index`'s pass `phase` (released it)."""

    def before_abort(self):
        """The session abandons the running step."""

    # --- values ----------------------------------------------------------------------------

    def load_block(self, index):
        """For evaluation without grads, after the build: the block's weights copied from DRAM
        (the optimizer's updates done)."""
        s = self.session
        for sp in s.layers[index]:
            sp.check_untouched()
            host = torch.empty(sp.shape, dtype=s.dtype)
            sp.weight.read_pointer(host.data_ptr(), host.numel() * host.element_size())
            sp.param.data = host.to(s.device)

    def read_weight(self, sp):
        """A streamed parameter's values, on the CPU (the updates done)."""
        host = torch.empty(sp.shape, dtype=self.session.dtype)
        sp.weight.read_pointer(host.data_ptr(), host.numel() * host.element_size())
        return host

    def store_weight(self, sp, values):
        """The weight and, when trained, the master (the weight rounded from it)."""
        s = self.session
        if sp.trainable and s.optimizer is not None and s.dtype != torch.float32:
            # The master and the weight rounded from it, in any layout.
            master = values.detach().to("cpu", torch.float32).contiguous()
            s.optimizer.master_write(sp.weight, master.data_ptr(), master.numel())
            return
        host = values.detach().to("cpu", s.dtype).contiguous()
        sp.weight.write_pointer(host.data_ptr(), host.numel() * host.element_size())

    def masters_from_weights(self):
        """Every trained streamed parameter's fp32 master becomes its weight, widened."""
        s = self.session
        for sp in (sp for entries in s.layers for sp in entries if sp.trainable):
            s.store_weight(sp, s.read_weight(sp))

    def read_state(self, sp, kind):
        t = torch.empty(sp.shape, dtype=torch.float32)
        optimizer = self.session.optimizer
        if kind == "master":
            optimizer.master_read(sp.weight, t.data_ptr(), t.numel())
        else:
            optimizer.state(sp.weight, kind).read_pointer(t.data_ptr(), t.numel() * 4)
        return t

    def write_state(self, sp, kind, value):
        t = value.detach().to("cpu", torch.float32).contiguous()
        optimizer = self.session.optimizer
        if kind == "master":
            optimizer.master_write(sp.weight, t.data_ptr(), t.numel())
        else:
            optimizer.state(sp.weight, kind).write_pointer(t.data_ptr(), t.numel() * 4)

    def read_grad(self, sp):
        host = torch.empty(sp.shape, dtype=torch.float32)
        self.session.optimizer.grad_read(sp.weight, host.data_ptr(), host.numel())
        return host

    def grad_sums(self, params):
        return [self.session.optimizer.grad_info(sp.weight)[1] for sp in params]

    def own_grad(self, sp):
        """The part of a held grad this process holds, as an fp32 CPU tensor (a copy), and the
        `own_part` of any tensor of the parameter's shape (broadcast to it) that lines up with
        it: here the whole grad, in the parameter's shape."""
        return self.read_grad(sp)

    def own_part(self, sp, values):
        return values

    def write_own_grad(self, sp, values):
        """Set the part of a held grad this process holds from what own_grad returned, changed."""
        host = values.detach().to("cpu", torch.float32).contiguous()
        self.session.optimizer.grad_write(sp.weight, host.data_ptr(), host.numel())

    # --- what other modules ask ------------------------------------------------------------

    def agree(self, flags):
        """`flags` (a list of booleans) as every process agrees on them: each one's."""
        return flags

    def checkpoint_layout(self):
        """What a checkpoint records of the processes that wrote it (None: one process)."""
        return None

    def streamed_dir(self, root):
        """Where this process's streamed part of a checkpoint at `root` goes."""
        return os.path.join(root, "streamed")

    def rng_file(self, root):
        """This process's own RNG states' file in a checkpoint (None: in resident.pt)."""
        return None

    def barrier(self, what):
        """Every process of the job reaches this point (one process: at once)."""


class ShardedParam(StreamedParam):
    # chunk: this rank's chunk's elements; piece: what this rank registers of it (the chunk,
    # or with pieces across the replicas 1/pieces of it); offset: in the gathered block;
    # chunk_offset: in the block's chunks (pieces only).
    __slots__ = ("numel", "chunk", "piece", "offset", "chunk_offset")


class _HostReplica:
    """With pieces: the block chunks of this rank, in DRAM (one copy per rank, so the host holds
    every weight once): written by each forward gather, read by the backward gather. A host
    buffer of the session's runtime (strata.h "Host buffers"), pinned by it on a GPU, so both
    copies are asynchronous on the communication stream, and charged against its one host
    budget (`budget`: strata.torch._planning.HostBudget, which made it with the budget: its
    `beside`). Without a budget (a layout outside a session) torch's own unpinned memory."""

    def __init__(self, counts, dtype, budget):
        self.host_bytes = 0
        memory = torch.empty(0, dtype=dtype)
        nbytes = sum(counts) * _planning.element_bytes(dtype)
        if nbytes and budget is None:  # a layout outside a session (the tests' fakes)
            memory = torch.empty(sum(counts), dtype=dtype)
            self.host_bytes = nbytes
        elif nbytes:
            buf, why = budget.take_beside(), None  # made with the budget (HostBudget's beside)
            if buf is None or buf.nbytes != nbytes:
                buf, why = budget.allocate(nbytes, "host replica of the weights")
            if buf is None:
                raise RuntimeError(
                    "strata.torch: no host memory for the host replica of the weights (%d "
                    "bytes): %s" % (nbytes, "host_budget has %d bytes of room left; raise it"
                                    % budget.room() if why == "budget" else
                                    "the machine's memory would have dropped below the "
                                    "runtime's reserve, or pinning failed"))
            self.host_bytes = buf.charged
            memory = _planning.tensor(buf).view(dtype)
        self.memory = memory
        self.blocks, start = [], 0
        for n in counts:
            self.blocks.append(self.memory[start:start + n])
            start += n


class ShardedLayout(LocalLayout):
    """Data parallelism: each rank holds one chunk of every streamed parameter (above)."""

    can_relay = False  # the ranks' chunks were laid out together
    pages_resident_state = False  # the residents stay replicated and in sync as they are

    def __init__(self, mesh, residents):
        super().__init__()
        self.mesh = mesh
        self.lead = mesh.rank == 0
        self.pieces = mesh.pieces  # >1: this rank holds one piece of its chunks' state
        # The first replica's ranks write the shards (the replicas hold the same); with pieces
        # every rank writes its own.
        self.writes_streamed = mesh.replica == 0 or self.pieces > 1
        self.residents = residents  # the replicated parameters
        self.layer_elements = []  # per block: elements of its gathered buffer
        self.buffers = [None, None]  # gathered blocks, alternating (even / odd blocks)
        self.chunk_elements = []  # with pieces, per block: its chunks' elements
        self.chunk_buffers = [None, None]  # with pieces: the block's chunks, alternating
        self.replica = None  # with pieces: the _HostReplica of this rank's chunks
        self.free = [None, None]  # per buffer: event after the last compute that read it
        self.holding = [None, None]  # per buffer: (step_id, block) it holds
        self.ready = {}  # block -> (buffer, event): gathered, waiting for its compute
        self.reduction = None  # (block, works, tensors to keep, (reduced, view) pairs)
        self.in_flight = []  # (event, tensors) the device may still read
        self.grad_version = 0
        self.sums = None  # (grad_version, {id(sp): global sum of squares})
        self.comm = self.reduce_stream = None  # side streams on CUDA (attach)
        self.numa_node = None

    def attach(self, session):
        super().attach(session)
        self.comm = torch.cuda.Stream(session.device) if session.cuda else None
        self.reduce_stream = torch.cuda.Stream(session.device) if session.cuda else None
        caps = session.runtime.capabilities()
        self.numa_node = caps.device_numa_node

    # --- registration ----------------------------------------------------------------------

    def block_counts(self, blocks):
        # With pieces the runtime holds this rank's pieces (weights, grads, state); the host
        # replica of the chunks is the layout's own (_HostReplica).
        return _planning.block_elements(blocks, self.mesh)

    def _sizes(self, numel):
        """(chunk, piece): elements of this rank's chunk of a parameter and of what it
        registers of it (_planning.kept_elements: one rule with the arena's sizing)."""
        return chunk_elements(numel, self.mesh.shard_size, self.pieces), \
            _planning.kept_elements(numel, self.mesh)

    def streamed_param(self, p, name, local, layer, index):
        sp = ShardedParam(p, name, local, layer, index)
        sp.numel = p.numel()
        sp.chunk, sp.piece = self._sizes(sp.numel)
        return sp

    def before_build(self, optimizer):
        if self.session.placement_choice is not None:
            self._adopt_one_placement()
        if optimizer is not None and not optimizer.get("threads"):
            optimizer = dict(optimizer, threads=optimizer_threads(self.mesh, self.numa_node))
        with torch.no_grad():
            for k, p in enumerate(self.residents):
                self.mesh.broadcast(p.data, "broadcasting resident parameter %d from rank 0" % k)
                fp32 = _params.fp32(p)
                if fp32 is not None:  # the fp32 values its master starts from
                    self.mesh.broadcast(fp32, "broadcasting resident parameter %d from rank 0" % k)
        return optimizer

    def _adopt_one_placement(self):
        """With NVMe, every rank adopts one placement of the state before anything is
        registered: the one chosen by the rank whose measured rates predict the slowest step
        (the ranks wait for each other at every block, so the slowest rank sets the pace; its
        choice is the fastest for it). Each rank chose from the same layers (equal chunks) and
        the same budgets (strata.torch._planning.plan_nvme agreed on them), so that rank's
        choice, its optimizer options and its weight homes fit every rank's runtime; only the
        rates differ. Collective."""
        s = self.session
        every = self.mesh.gather_objects((s.placement_choice, s.state_options,
                                          s.nvme_weight_blocks))
        slowest = max(range(len(every)),
                      key=lambda r: (every[r][0].info["predicted_step_seconds"], -r))
        s.placement_choice, s.state_options, s.nvme_weight_blocks = every[slowest]

    def after_build(self):
        s = self.session
        for entries in s.layers:
            offset = chunks = 0
            for sp in entries:
                sp.offset, sp.chunk_offset = offset, chunks
                offset += self.mesh.shard_size * sp.chunk
                chunks += sp.chunk
            self.layer_elements.append(offset)
            self.chunk_elements.append(chunks)
        if self.pieces > 1:
            self.replica = _HostReplica(self.chunk_elements, s.dtype, s.host_budget)
            if s.host_budget is not None:
                s.host_budget.add("host replica of the weights", self.replica)
        if s.optimizer is not None:
            s.optimizer = _CountingOptimizer(s.optimizer, self)

    def register_param(self, sp, p):
        name = "%s.shard%dof%d" % (sp.name, self.mesh.shard_rank, self.mesh.shard_size)
        if self.pieces > 1:
            name += ".piece%dof%d" % (self.mesh.replica, self.pieces)
        self.session.register_shape(sp, name, [sp.piece], p.requires_grad)

    def share_values(self, sp, values):
        self.mesh.broadcast(values, "broadcasting %s from rank 0" % sp.name)

    def write_param(self, sp, values, opt, group):
        self.session.write_values(sp, self._own_chunk(sp, values), opt, group)

    def _own_chunk(self, sp, values):
        """This rank's chunk (or piece) of a parameter's values (zero past the end)."""
        flat = values.detach().reshape(-1)
        out = torch.zeros(sp.piece, dtype=flat.dtype, device=flat.device)
        lo, hi = self._own_range(sp)
        if hi > lo:
            out[:hi - lo] = flat[lo:hi]
        return out

    # --- streams ---------------------------------------------------------------------------

    def _on(self, stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _handle(self, stream):
        return stream.cuda_stream if stream is not None else None

    def _record(self, stream):
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _buffer(self, b):
        if self.buffers[b] is None:
            self.buffers[b] = torch.empty(max(self.layer_elements), dtype=self.session.dtype,
                                          device=self.session.device)
        return self.buffers[b]

    def _chunk_buffer(self, b):
        if self.chunk_buffers[b] is None:
            self.chunk_buffers[b] = torch.empty(max(self.chunk_elements),
                                                dtype=self.session.dtype,
                                                device=self.session.device)
        return self.chunk_buffers[b]

    def _chunks(self, index, phase, b, what):
        """With pieces, on the communication stream: block `index`'s chunks of this rank, whole,
        in a chunk buffer (its parameters' chunks at their chunk_offset). The forward pass
        gathers every replica's updated piece (across the hosts) and keeps the chunks in the
        host replica for the backward pass, which copies them back from there: the same stream
        orders the two copies, and a forward pass always precedes its backward pass."""
        chunks = self._chunk_buffer(b)
        n = self.chunk_elements[index]
        host = self.replica.blocks[index]
        if phase == BACKWARD:
            chunks[:n].copy_(host, non_blocking=True)
            return chunks
        works = []
        for sp in self.session.layers[index]:
            piece = torch.from_dlpack(self.session.executor.view(index, phase, VIEW_WEIGHT,
                                                                 sp.index))
            out = chunks[sp.chunk_offset:sp.chunk_offset + sp.chunk]
            works.append(self.mesh.gather_pieces(out, piece, what + " across the replicas"))
            del piece
        for work in works:
            self.mesh.wait(work, what + " across the replicas")
        host.copy_(chunks[:n], non_blocking=True)
        return chunks

    # --- the step --------------------------------------------------------------------------

    def _gather(self, index, phase):
        """Acquire block `index` (this rank's chunks) and all-gather it into its buffer, on the
        communication stream; the forward pass releases the slot at once."""
        b = index % 2
        buf = self._buffer(b)
        what = "gathering block %d (%s)" % (index, "forward" if phase == FORWARD else "backward")
        shards = self.mesh.shard_size
        with self._on(self.comm):
            if self.free[b] is not None:
                self.comm.wait_event(self.free[b])
            self.session.executor.acquire(index, phase, self._handle(self.comm))
            chunks = self._chunks(index, phase, b, what) if self.pieces > 1 else None
            works = []
            for sp in self.session.layers[index]:
                if chunks is None:
                    chunk = torch.from_dlpack(self.session.executor.view(
                        index, phase, VIEW_WEIGHT, sp.index))
                else:
                    chunk = chunks[sp.chunk_offset:sp.chunk_offset + sp.chunk]
                out = buf[sp.offset:sp.offset + shards * sp.chunk]
                works.append(self.mesh.all_gather(out, chunk, what))
                del chunk
            for work in works:
                self.mesh.wait(work, what)
            if phase == FORWARD:
                self.session.executor.release(index, FORWARD, self._handle(self.comm))
            event = self._record(self.comm)
        self.holding[b] = (self.session.step_id, index)
        self.ready[index] = (b, event)

    def acquire(self, index, phase):
        # Called outside the blocks' own error handling: a failed gather (another rank gone)
        # abandons the step here, so no layer stays acquired.
        try:
            self._acquire_layer(index, phase)
        except BaseException:
            self.session.abort()
            raise

    def _acquire_layer(self, index, phase):
        if phase == FORWARD:
            if index not in self.ready:
                self._gather(index, FORWARD)
            if index + 1 < len(self.session.layers):
                self._gather(index + 1, FORWARD)  # overlaps block index's compute
        elif index not in self.ready:
            b = index % 2
            if self.holding[b] == (self.session.step_id, index):
                # The turnaround: the last block's forward gather is still in its buffer.
                with self._on(self.comm):
                    self.session.executor.acquire(index, BACKWARD, self._handle(self.comm))
                    self.ready[index] = (b, self._record(self.comm))
            else:
                self._gather(index, BACKWARD)
        b, event = self.ready.pop(index)
        if event is not None:
            torch.cuda.current_stream(self.session.device).wait_event(event)
        buf = self.buffers[b]
        for sp in self.session.layers[index]:
            sp.check_untouched()
            sp.param.data = buf[sp.offset:sp.offset + sp.numel].view(sp.shape)

    def release(self, index, phase):
        if self.session.cuda:  # the buffer is free once the compute queued so far has run
            self.free[index % 2] = self._record(torch.cuda.current_stream(self.session.device))
        self.session.unbind(index)
        if phase == BACKWARD:
            try:
                self._finish_reduction(index)
                if index > 0:
                    self._gather(index - 1, BACKWARD)  # overlaps block index-1's compute
            except BaseException:
                self.session.abort()
                raise

    def store_grads(self, index, params, grads):
        """Reduce-scatter the block's grads (averaged over the shard group) into this rank's grad
        chunks in the slot; issued on the compute stream, waited for at release. The reduction
        runs in the DataParallel's reduce_dtype, by default the compute dtype (as DDP does),
        whatever the grad views' dtype: fp32 sums on the device (session.grads_in_place) must
        not double the bytes on the wire."""
        self.grad_version += 1
        what = "reducing block %d's grads" % index
        shards = self.mesh.shard_size
        in_place = self.session.grads_in_place
        works, keep, pairs = [], [], []
        for sp, g in zip(params, grads):
            if g is None:
                continue
            view = torch.from_dlpack(self.session.executor.view(index, BACKWARD, VIEW_GRAD,
                                                                sp.grad_index))
            dtype = self.mesh.reduce_dtype or self.session.dtype
            full = g.reshape(-1).to(dtype).contiguous()
            if shards * sp.chunk != sp.numel:
                full = F.pad(full, (0, shards * sp.chunk - sp.numel))
            # With pieces the chunk's average goes on to the replicas' reduce-scatter; summed in
            # place, it is added into the view at release (_finish_reduction): never written
            # there directly.
            out = view if dtype == view.dtype and self.pieces == 1 and not in_place else \
                torch.empty(sp.chunk, dtype=dtype, device=view.device)
            works.append(self.mesh.reduce_scatter(out, full, what))
            keep += [g, full, out]
            pairs.append((out, view))
            self.session.delivered.append(sp)
        self.reduction = (index, works, keep, pairs)

    def _finish_reduction(self, index):
        """On the reduce stream: wait for the block's reduce-scatters, average over the
        replicas, round into the grad views (or add into them where they are the fp32 sums:
        session.grads_in_place), release the block (its grads leave for DRAM, or count as
        landed in HBM)."""
        in_place = self.session.grads_in_place
        block, works, keep, pairs = self.reduction or (index, [], [], [])
        self.reduction = None
        what = "reducing block %d's grads" % index
        if self.session.cuda:
            # Everything below reads what the compute stream wrote (the grads, and their copy
            # into `out` or the view where no shard group reduce-scatters: shard_size 1). A
            # shard group's NCCL reduce-scatter, issued on the compute stream and waited for
            # below, orders the reduce stream after it only when there is one; without it the
            # replicas' collectives (and the release's D2H) would run on whatever the buffers
            # held before the compute stream got there.
            self.reduce_stream.wait_stream(torch.cuda.current_stream(self.session.device))
        with self._on(self.reduce_stream):
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
            self.session.executor.release(index, BACKWARD, self._handle(self.reduce_stream))
            event = self._record(self.reduce_stream)
        if event is not None:
            self.in_flight = [(e, t) for e, t in self.in_flight if not e.query()]
            self.in_flight.append((event, keep))

    def after_end(self, index, phase):
        if phase == BACKWARD and index == 0:
            # step_end waited for the grads' copies, which followed every reduction.
            self.in_flight = []
            if self.residents:
                torch.autograd.Variable._execution_engine.queue_callback(self._average_residents)

    def _average_residents(self):
        """At the end of the backward pass: the resident parameters' grads averaged over all
        ranks (the streamed ones were averaged block by block). Each rank's grad may already
        hold an earlier pass's average (accumulation); the average of that plus this pass's
        local grad is still the average of both passes, as with DDP."""
        what = "averaging the resident parameters' grads"
        works = [self.mesh.average_all(p.grad, what) for p in self.residents
                 if p.grad is not None]
        for work in works:
            self.mesh.wait(work, what)

    def before_abort(self):
        if self.session.cuda:  # the acquired slot is released after what the side streams queued
            current = torch.cuda.current_stream(self.session.device)
            current.wait_stream(self.comm)
            current.wait_stream(self.reduce_stream)
        self.ready.clear()
        self.reduction = None

    # --- values (collective: every rank calls) ----------------------------------------------

    def load_block(self, index):
        s = self.session
        for sp in s.layers[index]:
            sp.check_untouched()
            values = self._gather_values(sp, self._read_chunk(sp.weight, sp, s.dtype))
            sp.param.data = values.to(s.device)

    def read_weight(self, sp):
        return self._gather_values(sp, self._read_chunk(sp.weight, sp, self.session.dtype))

    def store_weight(self, sp, values):
        s = self.session
        if sp.trainable and s.optimizer is not None and s.dtype != torch.float32:
            self._write_master(sp, values)  # and the weight, rounded from it
        else:
            self._write_chunk(sp.weight, sp, values, s.dtype)

    def masters_from_weights(self):
        """On this rank's chunks (no gathering)."""
        s = self.session
        s.optimizer.synchronize()
        for sp in (sp for entries in s.layers for sp in entries if sp.trainable):
            chunk = self._read_chunk(sp.weight, sp, s.dtype).float()
            s.optimizer.master_write(sp.weight, chunk.data_ptr(), chunk.numel())

    def _gather_values(self, sp, chunk):
        """A parameter-shaped tensor from every shard's `chunk` of it (on the CPU); with pieces
        `chunk` is this rank's piece, first gathered across the replicas into its chunk."""
        what = "gathering the values of %s" % sp.name
        chunk = chunk.to(self.mesh.comm_device())
        if self.pieces > 1:
            piece = chunk
            chunk = torch.empty(sp.chunk, dtype=piece.dtype, device=piece.device)
            self.mesh.wait(self.mesh.gather_pieces(chunk, piece, what), what)
        out = torch.empty(self.mesh.shard_size * sp.chunk, dtype=chunk.dtype, device=chunk.device)
        self.mesh.wait(self.mesh.all_gather(out, chunk, what), what)
        return out[:sp.numel].view(sp.shape).cpu()

    def _read_chunk(self, tensor, sp, dtype):
        """This rank's chunk (or piece) of a tensor of the parameter's."""
        host = torch.empty(sp.piece, dtype=dtype)
        tensor.read_pointer(host.data_ptr(), host.numel() * host.element_size())
        return host

    def _write_chunk(self, tensor, sp, values, dtype):
        chunk = self._own_chunk(sp, values.detach().to("cpu", dtype))
        tensor.write_pointer(chunk.data_ptr(), chunk.numel() * chunk.element_size())

    def _write_master(self, sp, values):
        chunk = self._own_chunk(sp, values.detach().to("cpu", torch.float32))
        self.session.optimizer.master_write(sp.weight, chunk.data_ptr(), chunk.numel())

    def read_state(self, sp, kind):
        if kind == "master":  # put together whatever its layout
            host = torch.empty(sp.piece, dtype=torch.float32)
            self.session.optimizer.master_read(sp.weight, host.data_ptr(), host.numel())
            return self._gather_values(sp, host)
        return self._gather_values(
            sp, self._read_chunk(self.session.optimizer.state(sp.weight, kind), sp, torch.float32))

    def write_state(self, sp, kind, value):
        if kind == "master":
            self._write_master(sp, value)
        else:
            self._write_chunk(self.session.optimizer.state(sp.weight, kind), sp, value,
                              torch.float32)

    def read_grad(self, sp):
        host = torch.empty(sp.piece, dtype=torch.float32)
        self.session.optimizer.grad_read(sp.weight, host.data_ptr(), host.numel())
        return self._gather_values(sp, host)

    def grad_sums(self, params):
        """Global sums of squares: each rank's chunks' sums, added over the shard group (with
        pieces: each rank's pieces' sums, added over every rank), for every trainable parameter
        at once, cached until a grad changes."""
        if self.sums is None or self.sums[0] != self.grad_version:
            trainable = [sp for entries in self.session.layers for sp in entries if sp.trainable]
            local = [self.session.optimizer.grad_info(sp.weight)[1] for sp in trainable]
            if self.pieces > 1:
                total = self.mesh.sum_all(local, "summing the grads' squares over the pieces")
            else:
                total = self.mesh.sum_shards(local, "summing the grads' squares over the shards")
            self.sums = (self.grad_version, {id(sp): s for sp, s in zip(trainable, total)})
        return [self.sums[1][id(sp)] for sp in params]

    def own_grad(self, sp):
        """This rank's elements of the grad (its chunk without the padding past the end), flat:
        an elementwise op on them is the op on the whole grad, sharded."""
        lo, hi = self._own_range(sp)
        host = torch.empty(sp.piece, dtype=torch.float32)
        self.session.optimizer.grad_read(sp.weight, host.data_ptr(), host.numel())
        return host[:hi - lo]

    def own_part(self, sp, values):
        lo, hi = self._own_range(sp)
        return values.broadcast_to(sp.shape).reshape(-1)[lo:hi]

    def write_own_grad(self, sp, values):
        # The padding keeps its zeros: it counts in the chunk's sum of squares (the norm).
        lo, hi = self._own_range(sp)
        host = torch.zeros(sp.piece, dtype=torch.float32)
        host[:hi - lo] = values.detach().to("cpu", torch.float32).reshape(-1)
        self.session.optimizer.grad_write(sp.weight, host.data_ptr(), host.numel())

    def _own_range(self, sp):
        """[lo, hi): this rank's elements of the flattened parameter (its chunk, or with
        pieces its replica's piece of it)."""
        lo = self.mesh.shard_rank * sp.chunk
        if self.pieces > 1:
            lo += self.mesh.replica * sp.piece
        lo = min(lo, sp.numel)
        return lo, min(lo + sp.piece, sp.numel)

    # --- what other modules ask ------------------------------------------------------------

    def agree(self, flags):
        """Each flag true on every rank (a collective)."""
        if not flags:
            return flags
        return [all(column) for column in zip(*self.mesh.gather_objects(flags))]

    def checkpoint_layout(self):
        layout = {"ranks": self.mesh.world, "shard_size": self.mesh.shard_size}
        if self.pieces > 1:  # (absent otherwise: checkpoints of HSDP still compare equal)
            layout["state_across_hosts"] = self.pieces
        return layout

    def streamed_dir(self, root):
        name = "shard%dof%d" % (self.mesh.shard_rank, self.mesh.shard_size)
        if self.pieces > 1:
            name += ".piece%dof%d" % (self.mesh.replica, self.pieces)
        return os.path.join(root, "streamed", name)

    def rng_file(self, root):
        return os.path.join(root, "rng", "rank%d.pt" % self.mesh.rank)

    def barrier(self, what):
        self.mesh.barrier(what)


class _CountingOptimizer:
    """The session's core.Optimizer, noting every change of a held grad (scaling, writing,
    zeroing), so the cached global sums of squares are recomputed after one: the cache makes the
    per-grad norm requests of clip_grad_norm_ one collective instead of one each."""

    def __init__(self, optimizer, layout):
        self._optimizer, self._layout = optimizer, layout

    def __getattr__(self, name):
        return getattr(self._optimizer, name)

    def grad_scale(self, weight, factor):
        self._layout.grad_version += 1
        return self._optimizer.grad_scale(weight, factor)

    def grad_write(self, weight, pointer, count):
        self._layout.grad_version += 1
        return self._optimizer.grad_write(weight, pointer, count)

    def grad_zero(self, weight, keep_zeros=False):
        self._layout.grad_version += 1
        return self._optimizer.grad_zero(weight, keep_zeros)
