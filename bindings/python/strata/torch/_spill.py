"""Block checkpoints spilled to host memory when the device is short (issue 36, item 2).

Every block with grad keeps its input (its checkpoint) from its forward to its backward pass:
a streamed block in its autograd function (strata.torch._block), a resident block in torch's
checkpoint. At 148 x 1024 tokens of an 8B Llama that is 1.24 GB per block, 40 GB for 32
blocks, held through the whole forward pass. When they cannot all stay in HBM, the first
blocks' inputs go to host memory:

- the decision, the library's step plan (strata.step_plan; runtime/step/checkpoints.cpp has
  the rule and its constants), at the first forward pass with grad, from the batch actually
  run (the first block's input is concrete then), strata.torch measuring what it is given
  (Spiller.plan): the step's peak is predicted as what torch
  holds when the forward pass begins, the grads the backward pass will allocate for the device's
  trainable parameters that have none now, every block's checkpoint, what the resident blocks
  that keep their activations hold (strata.torch.activations' measurements), and the larger
  of one block's backward working set (what it saves for its backward, measured on fake
  tensors at this batch as ActivationKeeper measures, x 1.25, plus the grads of its
  input and output) and the loss's (the chunked loss's chunk, or the whole logits); it is
  compared with what torch could hold (free + reserved) less the plan's margin. When
  short, as many of the first blocks spill as make it fit, counting the restores in flight.
  The first blocks: their backward comes last, so their restores have the most time. Decided
  again when the batch's tokens grow beyond what was planned for, or what torch holds at the
  forward pass's start grew (the resident optimizer state made by the first step);
- the copies, through saved-tensor hooks around the save of the block's inputs (the
  streamed block's autograd function, the resident block's torch checkpoint): a spilled
  block's input goes to a pinned host buffer on a side stream as the
  block's forward finishes (the side stream waits for an event of the compute stream; the
  input's memory is not reused before the copy is done: record_stream); in the backward pass,
  when block p is reached (its saved input is read), the inputs of the spilled blocks p-1 ..
  p-restore_depth (the plan's: 2) are copied back on the side stream into fresh device tensors, so the copy
  overlaps block p's backward; the compute stream waits for a restore's event before using
  it. A copy out and back is bit-exact;
- the buffers: one per spilled block, kept from step to step (no per-step allocation),
  grown when the batch grows; host buffers of the session's runtime (strata.h "Host
  buffers": mapped, NUMA-placed and pinned by the runtime at the exact size, where torch's
  pinned allocator rounds to a power of two), charged against its one host budget (the
  session's strata.torch._planning.HostBudget): the runtime refuses a buffer beyond what the
  budget leaves beside the arena and the other buffers, or one that would leave less than its
  reserve of the machine's memory available: that block does not spill, describe()
  (placement()) says how many more the decision wanted, and an out-of-memory error of the
  step names the remedy (host_budget). Their bytes: session.host_pinned_extra_bytes().

The decision's fake-tensor forward runs with every forward hook held back
(without_forward_hooks): it is a prediction, and the user's hooks see only real forward
passes.

Only the block's hidden states are spilled (its first tensor argument with two dimensions or
more, or hidden_states=): what else it is given (rotary tables, masks) is one tensor shared by
every block. A non-contiguous input stays. With spilling on, an in-place write into a block's
input after its forward is not caught as autograd's saved-tensor version check would (the
hooks hold no tensor to check). offload(spill_checkpoints=): None (automatic, above;
never on the CPU), True (every block spills at every step, on the CPU into ordinary host
tensors: how the tests exercise it), False (never).

Inside Hugging Face gradient checkpointing (gradient_checkpointing_enable), or any
torch.utils.checkpoint around the blocks, that checkpoint holds each block's input on the
device itself: the automatic mode then spills nothing (it would save no memory), and an
out-of-memory error says to turn it off (streamed blocks recompute already); True spills
anyway (the same values)."""

import time

import torch

from .. import step_plan
from . import _spill_plan, _spill_report, _tiled_mlp
from ._regenerate import Regenerated, Regenerator, signature
from ._spill_pool import HostPool

# What the forward pass's start may grow by, as a fraction of the device, before the decision
# is made again.
REDECIDE_GROWTH = 0.01
# The most blocks whose inputs strata.torch regenerates from one checkpoint (the plan forms
# groups of at most its own kMaxGroupBlocks): any; 1 under data parallelism, where a re-run
# block's weights would be gathered from every rank in one rank's backward pass.
REGENERATE_ANY = 1 << 14


def hidden_of(args, kwargs):
    """The block's hidden states: its first tensor argument with two dimensions or more, or
    hidden_states=; None when there is none."""
    for a in args:
        if torch.is_tensor(a) and a.dim() >= 2:
            return a
    h = kwargs.get("hidden_states")
    return h if torch.is_tensor(h) and h.dim() >= 2 else None


class _Spilled:
    """A spilled checkpoint: its host copy (written on the side stream, which also restores
    it: the copies back follow the copy out in stream order) and, once restored, the device
    tensor and the restore's event."""

    __slots__ = ("position", "host", "generation", "restored", "ready")

    def __init__(self, position, host, generation):
        self.position, self.host, self.generation = position, host, generation
        self.restored = self.ready = None


class _Kept:
    """A checkpoint left on the device, with its block's position (the backward pass reaching
    it prefetches the spilled ones before it) and its forward pass's generation."""

    __slots__ = ("position", "tensor", "generation")

    def __init__(self, position, tensor, generation):
        self.position, self.tensor, self.generation = position, tensor, generation


class Spiller:
    """One per session. mode: None (automatic), True (always) or False (never)."""

    def __init__(self, device, mode, keeper, positions, regenerate=True):
        self.device = device
        self.cuda = device.type == "cuda"
        self.mode = mode
        self.keeper = keeper  # the session's ActivationKeeper (how the blocks keep)
        self.positions = positions  # blocks with grad in a forward pass: resident + streamed
        self.pool = HostPool()
        self.side = None  # the copies' stream (CUDA)
        self.count = 0  # the blocks spilling now (self.spilled: which)
        self.spilled = ()  # their positions, ascending
        # Checkpoint groups (strata.torch._regenerate): the inputs dropped and regenerated.
        self.regen = Regenerator()
        self.max_group = REGENERATE_ANY if regenerate else 1
        self.forced_group = None  # spill_checkpoints=True: groups of this many (tests)
        # The blocks' MLP over sequence tiles (strata.torch._tiled_mlp): offload(mlp_tiles=),
        # the user's count (None: the plan's), and per block position the last plan's tiles
        # (None: every MLP whole).
        self.forced_tiles = None
        self.mlp_tiles = None
        self.wanted = 0  # the first blocks the decision wanted spilled (count: those it got)
        self.stopped_by = None  # why count < wanted: the pool's refusal ("host", "budget")
        self.fits = True  # whether the step was predicted to fit with them
        self.tokens = 0  # the tokens the decision was made for
        self.base = 0  # what torch held at that forward pass's start
        self.measured = {}  # tokens -> one block's measure()d whole bytes (None: unmeasurable)
        self.measured_mlp = {}  # tokens -> its MLP's saved bytes a token (0: not tileable)
        self.decisions = 0
        self.spilled_total = 0  # checkpoints copied to host memory so far (tests, benchmarks)
        self.decide_seconds = 0.0
        self.generation = 0  # advances at each forward pass with grad
        self.records = {}  # position -> _Spilled, of this generation
        self.model_params = []  # the device's parameters outside the streamed blocks
        self.head = None  # the output head (vocabulary x hidden), for the loss's estimate
        self.chunked_loss = None
        # A forward pass ran inside torch.utils.checkpoint (around the blocks), which keeps
        # their inputs on the device whatever is spilled.
        self.inside_checkpoint = False
        # The resident optimizer state on its way to host memory at the forward pass's start
        # (bytes; strata.torch.paging sets it): gone by the loss, back in the backward pass.
        self.leaving = lambda: 0
        # Of the last decision: one block's (or the loss's) backward working set, the
        # restores in flight and the margin (bytes), for the paged state's copies back.
        self.working = None
        # Spilled checkpoints restored ahead of the backward pass beyond the block's own: the
        # plan's (it counts them in flight).
        self.restore_depth = step_plan.plan_step([]).restore_depth
        self.plan_text = None  # the last decision's step plan, as the library dumps it
        # The session whose optimizer state the plan's state tier counts (a weak reference the
        # session sets; no session: none counted), and the last plan's advice: (bytes of the
        # streamed blocks' optimizer state on NVMe, the checkpoint group with it) or None.
        self.session = lambda: None
        self.state_advice = None

    def backward_reserve(self):
        """What the backward pass may allocate beyond what it holds at a block's start: one
        block's (or the loss's) backward working set at the batch last decided for, the
        spilled checkpoints' restores in flight and the margin kept free (None before a
        decision: on the CPU, with spill_checkpoints=True or False)."""
        return self.working

    @property
    def host_bytes(self):
        """Bytes of host memory the spill buffers hold."""
        return self.pool.nbytes

    def use_budget(self, budget):
        """Count the buffers against `budget` (the session's strata.torch._planning.HostBudget):
        a buffer beyond what it leaves is refused, and that block keeps its checkpoint."""
        self.pool.budget = budget
        budget.add("spilled checkpoints", self.pool)

    def close(self):
        self.records = {}
        self._quiesce()
        self.pool.close()

    def _quiesce(self):
        """Wait for the side stream's copies: a buffer is freed or replaced only when no copy
        reads or writes it."""
        if self.side is not None:
            self.side.synchronize()

    # --- the decision ---------------------------------------------------------------------

    def forward_begins(self, run, block, args, kwargs):
        """The first block's forward pass with grad (`run` its forward, `block` the module):
        a new generation of records, and the decision for this batch; the MLP's tiles the
        user forced, where no decision carried them (strata.torch._tiled_mlp)."""
        hidden = hidden_of(args, kwargs)
        if self.forced_tiles and hidden is not None and \
                hidden.numel() // hidden.shape[-1] < self.forced_tiles:
            raise ValueError(
                "strata.torch.offload: mlp_tiles=%d is more than this batch's %d tokens (a tile "
                "holds at least one): pass fewer tiles, or mlp_tiles=None for the plan's"
                % (self.forced_tiles, hidden.numel() // hidden.shape[-1]))
        self._decide(run, block, args, kwargs)
        if self.forced_tiles and self.mlp_tiles is None and hidden is not None:
            self.mlp_tiles = _tiled_mlp.planned(_spill_plan.forced_tiles_plan(
                self, hidden.numel() // hidden.shape[-1], hidden.numel() * hidden.element_size()))

    def tiles_at(self, position):
        """The sequence tiles block `position`'s MLP runs over now (1: whole)."""
        tiles = self.mlp_tiles
        return 1 if tiles is None or position >= len(tiles) else tiles[position]

    def _decide(self, run, block, args, kwargs):
        self.generation += 1
        self.records = {}
        self.regen.clear()
        hidden = hidden_of(args, kwargs)
        if self.mode is False or hidden is None:
            self._take(None, 0)
            return
        tokens = hidden.numel() // hidden.shape[-1]
        nbytes = hidden.numel() * hidden.element_size()
        if self.mode is True:
            self._take(_spill_plan.forced_plan(self, tokens, nbytes) if self.forced_group else None, nbytes)
            self.tokens = tokens
            return
        if not self.cuda:
            self._take(None, 0)
            return
        base = torch.cuda.memory_allocated(self.device)
        total = torch.cuda.get_device_properties(self.device).total_memory
        if self.decisions and tokens <= self.tokens and \
                base <= self.base + int(total * REDECIDE_GROWTH):
            return
        started = time.perf_counter()
        # Planned for this batch: a later one with more tokens is decided again (one decided
        # again for the memory held, with fewer tokens than before, plans for those).
        self.tokens, self.base = tokens, base
        plan = self.plan(run, block, args, kwargs, tokens, nbytes, base)
        self._take(plan, nbytes)
        self.fits = bool(plan.fits) and self.count == self.wanted
        self.working = plan.backward_reserve_bytes
        self.restore_depth = plan.restore_depth
        self.plan_text = plan.text  # the library's reasons, for benchmarks and diagnostics
        self.state_advice = ((plan.state_nvme_bytes, plan.state_nvme_group_blocks)
                             if plan.state_tier == "move" else None)
        self.decisions += 1
        self.decide_seconds += time.perf_counter() - started

    def plan(self, run, block, args, kwargs, tokens, nbytes, base):
        """The library's step plan of checkpoint homes for this batch (strata.torch._spill_plan
        builds its profile). The blocks are measured with their MLP whole (the tiles of the
        last plan set aside: the plan splits the untiled working set itself)."""
        self.mlp_tiles = None
        return _spill_plan.checkpoint_plan(self, run, block, args, kwargs, tokens, nbytes, base,
                                           hidden_of(args, kwargs))

    def _take(self, plan, nbytes):
        """The plan's checkpoint homes and groups taken (None: nothing spills, or, with
        spill_checkpoints=True, every block), the buffers reserved: as many of the spilled as
        the host gave."""
        starts = None
        if plan is None:
            spilled = range(self.positions) if self.mode is True and nbytes else ()
        else:
            blocks = plan.blocks
            spilled = [i for i, b in enumerate(blocks)
                       if b["checkpoint"] == "dram" and b["group_start"] == i]
            if any(b["group_start"] != i for i, b in enumerate(blocks)):
                starts = [b["group_start"] for b in blocks]
        self.regen.starts = starts
        self.mlp_tiles = _tiled_mlp.planned(plan)
        self.wanted = len(spilled)
        got = self._reserve(spilled, nbytes)
        self.spilled = tuple(spilled[:got])
        self.count = got

    def _reserve(self, positions, nbytes):
        """Buffers for the blocks at `positions`, in order: how many the host gave. Buffers of
        blocks no longer spilling (a decision made again: other groups, fewer spills) are
        freed first: the plan counted their room as the new ones'."""
        wanted = set(positions)
        stale = [p for p in self.pool.buffers if p not in wanted]
        if stale or any(not self.pool.holds(position, nbytes) for position in positions):
            self._quiesce()  # a buffer is replaced: the last step's copies may still use it
        for position in stale:
            self.pool.release(position)
        self.stopped_by = None
        for n, position in enumerate(positions):
            if not self.pool.reserve(position, nbytes):
                self.stopped_by = self.pool.last_refusal
                return n
        return len(positions)

    # --- the copies ---------------------------------------------------------------------------

    def saving(self, position, args, kwargs):
        """The context a block's forward with grad runs in: its hidden states spilled when
        `position` is among the spilled blocks; every checkpoint of a step that spills marked
        with its position (the backward pass reaching it prefetches the earlier ones)."""
        if self.count <= 0 and self.regen.starts is None:
            return _NO_HOOKS
        if _inside_checkpoint():
            # The checkpoint keeps the block's input on the device whatever is spilled, so a
            # spill frees nothing there (and on torch 2.11 our hooks inside its region broke
            # its recompute's block order): nothing spills, in any mode.
            self.inside_checkpoint = True
            return _NO_HOOKS
        hidden = hidden_of(args, kwargs)
        # The hidden states by their signature only: a closure holding the tensor would keep
        # it on the device, spilled or dropped.
        hidden_is = None if hidden is None else signature(hidden)
        spill = position in self.spilled
        dropped = hidden is not None and self.regen.replaces(position, hidden)
        grouped = self.regen.starts is not None
        generation = self.generation
        del hidden

        def pack(t):
            if hidden_is is None or signature(t) != hidden_is:
                return _Kept(position, t, generation)
            if dropped:
                return Regenerated(position, generation)
            record = self._spill(position, t, generation) if spill else None
            record = _Kept(position, t, generation) if record is None else record
            if grouped:  # what regenerating the inputs after it starts from
                self.regen.kept[position] = record
            return record

        return torch.autograd.graph.saved_tensors_hooks(pack, self._unpack)

    def forward_done(self, position, rerun, output):
        """Block `position` (streamed) ran its forward pass with grad: `rerun` (a
        strata.torch._regenerate.Rerun, or None) runs it again on a given input, `output` its
        hidden output, the next block's input if that is dropped."""
        if rerun is not None and self.regen.feeds_group(position):
            self.regen.note_output(position, rerun, output)

    def _spill(self, position, t, generation):
        if not t.is_contiguous() or t.device != self.device or position in self.records:
            return None
        host = self.pool.view(position, t)
        if host is None:
            return None
        if self.cuda:
            side = self._side()
            side.wait_stream(torch.cuda.current_stream(self.device))  # t is computed
            with torch.cuda.stream(side):
                host.copy_(t.detach(), non_blocking=True)
            t.record_stream(side)  # its memory is not reused before the copy is done
        else:
            host.copy_(t.detach())
        record = _Spilled(position, host, generation)
        self.records[position] = record
        self.spilled_total += 1
        return record

    def _side(self):
        if self.side is None:
            self.side = torch.cuda.Stream(self.device)
        return self.side

    def _unpack(self, saved):
        position, current = saved.position, saved.generation == self.generation
        earlier = [p for p in self.spilled if p < position][-self.restore_depth:] \
            if current else ()
        for p in earlier:
            record = self.records.get(p)
            if record is not None and record.restored is None:
                self._restore(record)
        if current:
            self.regen.kept.pop(position, None)  # its block's backward: no regeneration after
        if isinstance(saved, _Kept):
            return saved.tensor
        if isinstance(saved, Regenerated) and current:
            return self.regen.take(position, self._device_copy)
        if not current:
            raise RuntimeError(
                "strata.torch: backward through block %d of a forward pass that is no longer "
                "the current one (its checkpoint, spilled to host memory, was overwritten by "
                "a later forward pass): call backward per forward pass" % position)
        if saved.restored is None:
            self._restore(saved)
        t, ready = saved.restored, saved.ready
        saved.restored = saved.ready = None  # read again (retain_graph): copied again
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        return t

    def _device_copy(self, record):
        """A kept or spilled record's tensor on the device, for a regeneration: a spilled one
        restored (and left restored: its own block's backward reads it next)."""
        if isinstance(record, _Kept):
            return record.tensor
        if record.restored is None:
            self._restore(record)
        if record.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(record.ready)
        return record.restored

    def _restore(self, record):
        """The record's host copy back on the device, on the side stream (CUDA)."""
        host = record.host
        if not self.cuda:
            record.restored = host.clone()
            return
        compute = torch.cuda.current_stream(self.device)
        t = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        side = self._side()
        side.wait_stream(compute)  # t's memory may have been the compute stream's until now
        with torch.cuda.stream(side):
            t.copy_(host, non_blocking=True)
        t.record_stream(side)
        ready = torch.cuda.Event()
        ready.record(side)
        record.restored, record.ready = t, ready

    def describe(self):
        """placement()'s line about the block checkpoints (strata.torch._spill_report)."""
        return _spill_report.describe(self)

    def note(self):
        """What an out-of-memory error of the step is told, or None."""
        return _spill_report.note(self)


def _inside_checkpoint():
    """Whether the running forward pass is inside torch.utils.checkpoint's region: its
    saved-tensor hooks are on top (torch marks them _checkpoint_internal; a torch without the
    mark and whose hooks come from another module reads as outside)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None:
        return False
    # torch 2.15 marks its hooks _checkpoint_internal; older releases (2.11) do not, and their
    # hooks are closures defined in torch.utils.checkpoint.
    return bool(getattr(top[0], "_checkpoint_internal", False)) or \
        getattr(top[0], "__module__", None) == "torch.utils.checkpoint"



class _NoHooks:
    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


_NO_HOOKS = _NoHooks()
