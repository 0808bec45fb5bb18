"""ShardedLayout: data parallelism, the design (docs/architecture.md, "Data parallel"): each rank's
Strata runtime holds, per streamed parameter, one chunk of 1/shard_size of its flattened values
(padded to a multiple of 64 elements): the weight chunk, its grad chunk and the chunk's fp32
master and AdamW moments, so the ranks of one shard group hold one copy of the training state
between them, each in its own pinned DRAM on its GPU's NUMA node, updated by its own CPU
threads. Per block and pass:

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
to this rank's host replica of the block (pinned DRAM, HostReplica) on the same stream; the
backward gather copies the chunk back from there instead of using the network again. The
grads are reduce-scattered over the shard group, then over the replicas (each rank gets the
average of its piece). The executor streams only the pieces; the replica is the layout's own,
written and read on its communication stream in order, so no ordering with the executor's
copies is needed; it is rewritten at every forward pass (never persisted: checkpoints hold
each rank's pieces).

With nvme= each rank's runtime has an NVMe tier of its own files, and what its DRAM budget cannot
hold of its chunks goes there as on one GPU (offload planned every rank's chunks within the same
budgets: strata.torch._planning.plan_nvme); one rank of those sharing a host's disks measures
them and each counts its share of the rates (strata.torch.session), and the ranks adopt one
placement before anything is registered (ShardedLayout.before_build).

The gathers (BlockGathers, strata.torch.layout.gather) and the grads (GradReducer,
strata.torch.layout.reduce) are parts the layout owns; the values are read and written through
strata.torch.layout.chunks."""

import os

import torch

from ...core import BACKWARD
from .. import _params, _planning
from .._distributed import chunk_elements, optimizer_threads
from .chunks import (ShardedParam, gather_values, own_chunk, own_range, read_chunk,
                     write_chunk, write_master)
from .gather import BlockGathers
from .local import LocalLayout
from .reduce import CountingOptimizer, GradReducer


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
        self.gathers = BlockGathers(mesh)  # the blocks gathered for their passes
        self.reducer = GradReducer(mesh, residents)  # their grads reduced; the residents'
        self.numa_node = None

    @property
    def replica(self):
        """With pieces: the HostReplica of this rank's chunks (None without)."""
        return self.gathers.replica

    def attach(self, session):
        super().attach(session)
        self.gathers.comm = torch.cuda.Stream(session.device) if session.cuda else None
        self.reducer.reduce_stream = \
            torch.cuda.Stream(session.device) if session.cuda else None
        caps = session.runtime.capabilities()
        self.numa_node = caps.device_numa_node

    # --- registration ----------------------------------------------------------------------

    def block_counts(self, blocks):
        # With pieces the runtime holds this rank's pieces (weights, grads, state); the host
        # replica of the chunks is the layout's own (HostReplica).
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
        self.gathers.lay_out(s)
        if s.optimizer is not None:
            s.optimizer = CountingOptimizer(s.optimizer, self.reducer)

    def register_param(self, sp, p):
        name = "%s.shard%dof%d" % (sp.name, self.mesh.shard_rank, self.mesh.shard_size)
        if self.pieces > 1:
            name += ".piece%dof%d" % (self.mesh.replica, self.pieces)
        self.session.register_shape(sp, name, [sp.piece], p.requires_grad)

    def share_values(self, sp, values):
        self.mesh.broadcast(values, "broadcasting %s from rank 0" % sp.name)

    def write_param(self, sp, values, opt, group):
        self.session.write_values(sp, own_chunk(self.mesh, sp, values), opt, group)

    # --- the step --------------------------------------------------------------------------

    def acquire(self, index, phase):
        # Called outside the blocks' own error handling: a failed gather (another rank gone)
        # abandons the step here, so no layer stays acquired.
        try:
            self.gathers.acquire(self.session, index, phase)
        except BaseException:
            self.session.abort()
            raise

    def release(self, index, phase):
        self.gathers.computed(self.session, index)
        self.session.unbind(index)
        if phase == BACKWARD:
            try:
                self.reducer.finish(self.session, index)
                if index > 0:  # overlaps block index-1's compute
                    self.gathers.gather(self.session, index - 1, BACKWARD)
            except BaseException:
                self.session.abort()
                raise

    def store_grads(self, index, params, grads):
        self.reducer.store(self.session, index, params, grads)

    def after_end(self, index, phase):
        if phase == BACKWARD and index == 0:
            self.reducer.backward_ended()

    def before_abort(self):
        if self.session.cuda:  # the acquired slot is released after what the side streams queued
            current = torch.cuda.current_stream(self.session.device)
            current.wait_stream(self.gathers.comm)
            current.wait_stream(self.reducer.reduce_stream)
        self.gathers.ready.clear()
        self.reducer.reduction = None

    # --- values (collective: every rank calls) ----------------------------------------------

    def load_block(self, index):
        s = self.session
        for sp in s.layers[index]:
            sp.check_untouched()
            values = gather_values(self.mesh, sp, read_chunk(sp.weight, sp, s.dtype))
            sp.param.data = values.to(s.device)

    def read_weight(self, sp):
        return gather_values(self.mesh, sp, read_chunk(sp.weight, sp, self.session.dtype))

    def store_weight(self, sp, values):
        s = self.session
        if sp.trainable and s.optimizer is not None and s.dtype != torch.float32:
            write_master(self.mesh, s.optimizer, sp, values)  # and the weight, rounded from it
        else:
            write_chunk(self.mesh, sp.weight, sp, values, s.dtype)

    def masters_from_weights(self):
        """On this rank's chunks (no gathering)."""
        s = self.session
        s.optimizer.synchronize()
        for sp in (sp for entries in s.layers for sp in entries if sp.trainable):
            chunk = read_chunk(sp.weight, sp, s.dtype).float()
            s.optimizer.master_write(sp.weight, chunk.data_ptr(), chunk.numel())

    def read_state(self, sp, kind):
        optimizer = self.session.optimizer
        if kind == "master":  # put together whatever its layout
            host = torch.empty(sp.piece, dtype=torch.float32)
            optimizer.master_read(sp.weight, host.data_ptr(), host.numel())
            return gather_values(self.mesh, sp, host)
        return gather_values(self.mesh, sp,
                             read_chunk(optimizer.state(sp.weight, kind), sp, torch.float32))

    def write_state(self, sp, kind, value):
        optimizer = self.session.optimizer
        if kind == "master":
            write_master(self.mesh, optimizer, sp, value)
        else:
            write_chunk(self.mesh, optimizer.state(sp.weight, kind), sp, value, torch.float32)

    def read_grad(self, sp):
        host = torch.empty(sp.piece, dtype=torch.float32)
        self.session.optimizer.grad_read(sp.weight, host.data_ptr(), host.numel())
        return gather_values(self.mesh, sp, host)

    def grad_sums(self, params):
        return self.reducer.grad_sums(self.session, params)

    def own_grad(self, sp):
        """This rank's elements of the grad (its chunk without the padding past the end), flat:
        an elementwise op on them is the op on the whole grad, sharded."""
        lo, hi = own_range(self.mesh, sp)
        host = torch.empty(sp.piece, dtype=torch.float32)
        self.session.optimizer.grad_read(sp.weight, host.data_ptr(), host.numel())
        return host[:hi - lo]

    def own_part(self, sp, values):
        lo, hi = own_range(self.mesh, sp)
        return values.broadcast_to(sp.shape).reshape(-1)[lo:hi]

    def write_own_grad(self, sp, values):
        # The padding keeps its zeros: it counts in the chunk's sum of squares (the norm).
        lo, hi = own_range(self.mesh, sp)
        host = torch.zeros(sp.piece, dtype=torch.float32)
        host[:hi - lo] = values.detach().to("cpu", torch.float32).reshape(-1)
        self.session.optimizer.grad_write(sp.weight, host.data_ptr(), host.numel())

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
