"""Which resident blocks keep their activations for the backward pass instead of recomputing
them (issue 13, item 2: spare HBM spent on skipping recompute), decided from measured memory.

A resident block runs as plain PyTorch with activation checkpointing, so its activation memory
is what a streamed block's is. When the device has memory to spare once the model, its
optimizer state and a step's peak are in, some of them can run without checkpointing: the
same values (checkpointing recomputes exactly what the forward computed, dropout's RNG
included), one forward pass less per block. How many cannot be known at offload time (the
batch's activations and logits are unknown then), so it is measured:

- the bytes one resident block saves for its backward when not checkpointed, for the actual
  inputs of the first forward pass with grad: its forward run once on fake tensors (shapes
  only, no memory, no compute; the RNG state restored), summing what autograd saves beside the
  parameters;
- the memory torch's caching allocator held at its peak through the second optimizer step
  (AdamW's moments exist from the first): reserved, not allocated, since what fragmentation
  strands is as unusable as what is allocated (an H200 run planned from the allocated peak ran
  out of memory asking for 15.6 GiB of logits with 11 GiB reserved and unused);
- what torch could hold at most: the device's free memory plus what torch holds now (the CUDA
  context and Strata's own HBM arena are outside it).

From the third step on, the last `count` resident blocks run without checkpointing, count =
(usable - peak - 10% of the device) // (1.25 x block bytes). A forward pass with more tokens,
or longer sequences, than the measured steps had runs checkpointed (activations and logits
grow with the tokens, attention's with the sequence). An out-of-memory error anywhere (the
allocator counts them: a forward, a backward, a step) turns keeping off for good. Only on
CUDA."""

import torch


def saved_bytes(run, args, kwargs, device, params):
    """Bytes `run(*args, **kwargs)` would save for its backward beside `params` (its
    parameters), from a forward on fake tensors; None when that cannot be done."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.utils._pytree import tree_map

    seen, total = set(), 0

    def pack(t):
        nonlocal total
        if not isinstance(t, FakeTensor):  # a real tensor here is a parameter or buffer
            return t
        key = t.untyped_storage()._cdata  # the StorageImpl: the same for every view of it
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                # The mode converts a real tensor to the same fake one while that one lives:
                # held here, the parameters' fake storages (and the views of them autograd
                # saves) are known, and no storage address is reused meanwhile.
                fake_params = [mode.from_tensor(p) for p in params]
                seen.update(f.untyped_storage()._cdata for f in fake_params)
                fake = tree_map(lambda x: mode.from_tensor(x) if torch.is_tensor(x) else x,
                                (args, kwargs))
                hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
                with torch.enable_grad(), hooks:
                    run(*fake[0], **fake[1])
    except Exception:  # an op without a fake kernel, a custom block: keep checkpointing
        return None
    return total


def tokens_of(args):
    """Tokens in a block's input (its first tensor argument, [..., hidden])."""
    return shape_of(args)[0]


def shape_of(args):
    """(tokens, sequence length) of a block's input (its first tensor argument, [..., seq,
    hidden]); (0, 0) when it has none."""
    for a in args:
        if torch.is_tensor(a) and a.dim() >= 2:
            return a.numel() // a.shape[-1], a.shape[-2]
    return 0, 0


class ActivationKeeper:
    """One per offloaded model with resident blocks."""

    # Device memory left unused, as a fraction of the total, and each kept block's bytes taken
    # this much larger: the fragmentation a new allocation pattern brings, and what the
    # measured steps did not show.
    MARGIN = 0.10
    BLOCK_FACTOR = 1.25
    DECIDE_AFTER_STEPS = 2

    def __init__(self, device, blocks):
        self.device = device
        self.blocks = blocks  # the resident blocks, in order
        self.count = 0  # the last `count` resident blocks keep their activations
        self.forced = None  # a fixed count (tests, tools); None: measured
        self.steps = 0
        self.tokens = 0  # the most tokens a measured step had
        self.seq = 0  # and the longest sequence
        self.block_bytes = None  # one block's saved bytes at self.tokens
        self.decided = False
        self.ooms = 0  # the allocator's out-of-memory count when the plan was made

    def keeps(self, index, args):
        """Whether resident block `index` runs without checkpointing now (args: its inputs)."""
        if self.forced is not None:
            return index >= len(self.blocks) - self.forced
        if self.count <= 0 or index < len(self.blocks) - self.count:
            return False
        if index == len(self.blocks) - self.count and self.oom_since_plan():
            self.count = 0
            return False
        tokens, seq = shape_of(args)
        return tokens <= self.tokens and seq <= self.seq

    def oom_since_plan(self):
        return self.device.type == "cuda" and \
            torch.cuda.memory_stats(self.device).get("num_ooms", 0) > self.ooms

    def observe(self, index, run, args, kwargs):
        """A forward pass with grad of resident block `index`, before the decision: note its
        tokens and, for the most tokens seen, what it would save."""
        if self.decided or self.forced is not None or self.device.type != "cuda":
            return
        tokens, seq = shape_of(args)
        self.seq = max(self.seq, seq)
        if tokens > self.tokens:
            self.tokens = tokens
            self.block_bytes = saved_bytes(run, args, kwargs, self.device,
                                           list(self.blocks[index].parameters()))

    def on_step(self):
        """After an optimizer step: the decision, once enough steps were measured."""
        self.steps += 1
        if self.decided or self.steps < self.DECIDE_AFTER_STEPS or self.device.type != "cuda":
            return
        self.decided = True
        if not self.block_bytes:
            return
        self.ooms = torch.cuda.memory_stats(self.device).get("num_ooms", 0)
        free, total = torch.cuda.mem_get_info(self.device)
        usable = free + torch.cuda.memory_reserved(self.device)
        peak = torch.cuda.max_memory_reserved(self.device)
        self.count = plan_kept(usable, peak, int(self.block_bytes * self.BLOCK_FACTOR),
                               len(self.blocks), int(total * self.MARGIN))


def plan_kept(usable, peak, block_bytes, blocks, margin):
    """How many resident blocks can keep their activations: the memory between the measured
    peak and what torch could hold, less `margin` bytes, in blocks' worth of saved bytes."""
    if block_bytes <= 0:
        return 0
    spare = usable - peak - margin
    return max(0, min(blocks, spare // block_bytes))
