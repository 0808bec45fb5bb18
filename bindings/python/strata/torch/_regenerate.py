"""Block inputs regenerated in the backward pass instead of kept (the step plan's checkpoint
groups, strata_step_block_t.group_start; runtime/step/checkpoints.cpp decides them).

Where neither the device nor the host memory can hold one checkpoint per block (an 8B Llama at
148 x 1024 tokens: 1.16 GiB a block's input, 32 of them, beside an arena of ~14 bytes a
parameter in 125 GiB of host memory), the plan keeps one per group of k streamed blocks, as
MegaTrain's checkpoint interval does. A group's other blocks drop their input after their forward
pass (strata.torch._spill's saved-tensor hooks save a marker, Regenerated, in its place), and
when the backward pass reaches the group's last block (the first of the group to come), blocks
g .. last-1 run forward again, without grad, from the group's checkpoint, each with the RNG,
autocast and module state of its forward pass and its weights copied in from DRAM, so their
outputs are the inputs the forward pass had, bit for bit. They are held until each block's
backward reads its own.

A block's input is dropped only where it is exactly the previous block's output (the same
tensor, unchanged since): a model that transforms the hidden states between blocks keeps that
block's input as before (correct, only larger than the plan counted).

Weights: the re-run block is not the executor's layer of the moment (one layer is acquired at
a time, in step order), so its weights are copied from its DRAM home into device tensors on the
compute stream (pinned memory, asynchronous), not through a slot; the plan counts them in the
group's working set. The block's update has not run yet (it follows its own backward), so they
are the weights its forward pass used."""

import contextlib
import ctypes
import math

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class Regenerated:
    """What a dropped block input is saved as: its block's position and forward generation."""

    __slots__ = ("position", "generation")

    def __init__(self, position, generation):
        self.position, self.generation = position, generation


def signature(t):
    """What identifies a tensor's memory and view (no reference to it: a closure holding the
    tensor itself would keep a dropped input alive)."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


class Rerun:
    """Block `index`'s forward pass, again, on a given hidden input: what its forward pass ran
    with (the arguments other than the hidden states, the RNG and autocast state, the module
    state), captured at that forward pass."""

    def __init__(self, session, index, run, leaves, spec, hidden_at, cpu_rng, device_rng,
                 autocast, state, out_at):
        self.session, self.index, self.run = session, index, run
        self.leaves, self.spec, self.hidden_at = leaves, spec, hidden_at
        self.cpu_rng, self.device_rng, self.autocast = cpu_rng, device_rng, autocast
        self.state, self.out_at = state, out_at

    def __call__(self, hidden):
        s = self.session
        leaves = list(self.leaves)
        leaves[self.hidden_at] = hidden
        args, kwargs = tree_unflatten(leaves, self.spec)
        devices = [s.device] if s.cuda else []
        bind_weights(s, self.index)
        try:
            with torch.random.fork_rng(devices=devices, device_type=s.device.type), \
                    self.state.replay(), torch.no_grad():
                torch.set_rng_state(self.cpu_rng)
                if s.cuda:
                    torch.cuda.set_rng_state(self.device_rng, s.device)
                autocast = contextlib.nullcontext() if self.autocast is None else \
                    torch.autocast(s.device.type, dtype=self.autocast)
                with autocast:
                    out = self.run(*args, **kwargs)
        finally:
            s.unbind(self.index)
        return tree_flatten(out)[0][self.out_at].detach()


def bind_weights(session, index):
    """Block `index`'s parameters on device copies of its weights: from their pinned DRAM home
    asynchronously on the compute stream (its address, strata_tensor_data_pointer: torch's
    DLPack import takes no kDLCUDAHost), else as strata.torch's evaluation loads them
    (synchronously: a weight on NVMe, a sharded layout)."""
    copies = []
    itemsize = torch.empty(0, dtype=session.dtype).element_size()
    for sp in session.layers[index]:
        nbytes = math.prod(sp.shape) * itemsize
        try:
            address = sp.weight.data_pointer() if session.mesh is None else None
        except Exception:  # on NVMe (no address): the general path
            address = None
        if address is None or sp.weight.nbytes < nbytes:
            session.layout.load_block(index)
            return
        raw = (ctypes.c_char * nbytes).from_address(address)
        copies.append((sp, torch.frombuffer(raw, dtype=torch.uint8)))
    for sp, host in copies:
        values = host.view(session.dtype).view(sp.shape)
        sp.param.data = values.to(session.device, non_blocking=True) if session.cuda \
            else values.clone()


def rerun_for(session, index, ctx, leaves, spec, positions, hidden, out_leaves, state):
    """The Rerun of block `index` (its autograd ctx's RNG and autocast state), or None where its
    hidden input or its hidden output cannot be told (no tensor of two dimensions or more)."""
    hidden_at = next((i for i in positions if leaves[i] is hidden), None)
    out_at = next((i for i, x in enumerate(out_leaves)
                   if isinstance(x, torch.Tensor) and x.dim() >= 2), None)
    if hidden_at is None or out_at is None:
        return None
    leaves = list(leaves)
    leaves[hidden_at] = None  # the input itself is what is dropped
    return Rerun(session, index, ctx.run, leaves, spec, hidden_at, ctx.cpu_rng,
                 ctx.device_rng, ctx.autocast, state, out_at)


class Regenerator:
    """The step's regenerations: per position, the Rerun of a block whose output is the next
    one's dropped input and that output's signature and version (the next block's input is
    dropped only where it is that tensor, unchanged), the inputs kept by the group's blocks
    that keep theirs (what a regeneration starts from), and the inputs regenerated, waiting for
    their blocks' backward."""

    def __init__(self):
        self.starts = None  # per position its group's start (None: no groups)
        self.regenerated_total = 0  # inputs regenerated so far (tests, benchmarks)
        self.clear()

    def clear(self):
        self.reruns = {}  # position -> Rerun
        self.outputs = {}  # position -> (signature, version) of its hidden output
        self.kept = {}  # position -> its saved input's record (strata.torch._spill's)
        self.ready = {}  # position -> its regenerated input

    def grouped(self, position):
        """Whether `position`'s input may be dropped (its group started before it)."""
        return self.starts is not None and position < len(self.starts) and \
            self.starts[position] != position

    def feeds_group(self, position):
        """Whether the next block's input may be regenerated from `position`'s output."""
        return self.grouped(position + 1)

    def note_output(self, position, rerun, output):
        self.reruns[position] = rerun
        self.outputs[position] = (signature(output), output._version)

    def replaces(self, position, hidden):
        """Whether block `position`'s input is the previous block's output, unchanged."""
        seen = self.outputs.get(position - 1)
        return self.grouped(position) and seen is not None and \
            position - 1 in self.reruns and seen == (signature(hidden), hidden._version)

    def take(self, position, restored):
        """Block `position`'s regenerated input, regenerating its group's inputs up to it
        first if needed. `restored(record)`: a kept record's tensor on the device."""
        if position not in self.ready:
            self._regenerate(position, restored)
        return self.ready.pop(position)

    def _regenerate(self, position, restored):
        start = max((p for p in self.kept if p < position), default=None)
        if start is None or any(p not in self.reruns for p in range(start, position)):
            raise RuntimeError(
                "strata.torch: block %d's input was dropped for regeneration but the blocks "
                "before it in its checkpoint group are gone (a backward pass through part of "
                "the step, or twice through it: call backward once per forward pass)"
                % position)
        x = restored(self.kept[start])
        for p in range(start, position):
            x = self.reruns.pop(p)(x)
            if p + 1 < position:
                self.ready[p + 1] = x
            self.regenerated_total += 1
        self.ready[position] = x
