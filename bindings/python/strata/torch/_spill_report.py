"""What strata.torch._spill's Spiller says: placement()'s line about the block checkpoints, and
the note an out-of-memory error of the step gets."""


def budget_short(s):
    """Whether host_budget left no room for some of the buffers the decision wanted."""
    return s.stopped_by == "budget" and s.count < s.wanted


def describe(s):
    """'N of M block checkpoints spilled to host memory (X GiB)', what host_budget kept
    from spilling, and the blocks whose MLP runs over sequence tiles, or ''."""
    tiled = [t for t in (s.mlp_tiles or ()) if t > 1]
    tiles = ("the MLP of %d blocks over %d sequence tiles" % (len(tiled), max(tiled))
             if tiled else "")
    said = _checkpoints(s)
    return "; ".join(part for part in (said, tiles) if part)


def _checkpoints(s):
    if s.count <= 0 and not budget_short(s) and s.regen.starts is None:
        return ""
    if s.inside_checkpoint:
        return ("block checkpoints kept on the device (the blocks run inside "
                "torch.utils.checkpoint, which keeps their inputs there)")
    said = "%d of %d block checkpoints spilled to host memory (%.2f GiB)" % (
        s.count, s.positions, s.host_bytes / (1 << 30))
    starts = s.regen.starts
    if starts is not None:
        largest = max(sum(1 for g in starts if g == h) for h in set(starts))
        said += (", one per group of up to %d blocks (%d inputs regenerated in the backward "
                 "pass)" % (largest, sum(1 for i, g in enumerate(starts) if g != i)))
    if budget_short(s):
        said += ("; %d more kept on the device: host_budget has no room for them "
                 "(%.2f GiB left of it, %.2f GiB a checkpoint)%s"
                 % (s.wanted - s.count, s.pool.budget.room() / (1 << 30),
                    s.pool.wanted / (1 << 30),
                    "" if s.fits else ", the step predicted short"))
    elif not s.fits:
        said += ", the step predicted short even so"
    return said + state_advice(s, "; ")


def state_advice(s, lead):
    """The step plan's advice on the optimizer state's tier, after `lead`, or '': how much of
    the streamed blocks' state NVMe should hold for host memory to hold the checkpoints, and
    the checkpoint group that gives. The state was placed at offload, before the batch was
    known: strata.torch says so rather than moving it."""
    if s.state_advice is None:
        return ""
    nbytes, group = s.state_advice
    return ("%sthe step plan advises %.2f GiB of the streamed blocks' optimizer state on NVMe "
            "(host memory then holds %s): offload placed the state before this batch was "
            "known; offload(nvme=..., state_placement='nvme') puts all of it there"
            % (lead, nbytes / (1 << 30), "one checkpoint per block" if group <= 1 else
               "one checkpoint per group of %d blocks" % group))


def note(s):
    """What an out-of-memory error of the step is told, or None."""
    if budget_short(s):
        return ("strata.torch: host_budget had room for %d of the %d block checkpoints "
                "the step needed spilled to host memory (%.2f GiB of it left, %.2f GiB a "
                "checkpoint): the others stayed on the device; raise host_budget (or pass "
                "a smaller resident_blocks, or a smaller batch)%s"
                % (s.count, s.wanted, s.pool.budget.room() / (1 << 30),
                   s.pool.wanted / (1 << 30), state_advice(s, "; ")))
    if s.pool.refused:
        return ("strata.torch: %d block checkpoint buffer(s) of host memory were refused "
                "(%s): those checkpoints stayed on the device"
                % (s.pool.refused, s.pool.host_refusal()))
    if s.count and s.inside_checkpoint:
        return ("strata.torch: the blocks run inside torch.utils.checkpoint (Hugging Face "
                "gradient_checkpointing_enable), which keeps each block's input on the "
                "device, so their checkpoints were not spilled to host memory: streamed "
                "blocks recompute already; model.gradient_checkpointing_disable() lets "
                "them spill")
    if s.count and not s.fits:
        return ("strata.torch: %d block checkpoints were spilled to host memory and the "
                "step was predicted short even so: pass a smaller resident_blocks, or a "
                "smaller batch%s" % (s.count, state_advice(s, "; ")))
    return None
