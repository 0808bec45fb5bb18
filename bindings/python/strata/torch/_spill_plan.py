"""The checkpoint-homes decision's profile (strata.torch._spill's Spiller decides through these):
what strata.torch measures for the library's step plan at a forward pass's start (what torch
holds, the grads to come, how the blocks keep, one block's saved bytes on fake tensors, the
loss's head and chunk, the paged state leaving, the host's room, the groups it can regenerate,
the streamed blocks' optimizer state in DRAM and the NVMe tier's room for it),
and the plan of spill_checkpoints=True with a forced group size. Nothing is decided here: the
rules are the library's (runtime/step/checkpoints.cpp)."""

import torch

from .. import host_buffers, step_plan
from . import _step, _tiled_mlp
from ._measure import measure
from ._replay import ForwardState, without_forward_hooks


def checkpoint_plan(s, run, block, args, kwargs, tokens, nbytes, base, hidden=None):
    """The library's step plan of checkpoint homes for this batch (strata.step_plan): from
    what torch holds as the forward pass begins (`base`), the grads the backward pass will
    allocate, how the blocks keep now (their measured bytes), one block's saved bytes at
    this batch (measured on fake tensors), the loss's head and chunk, and the optimizer
    state leaving the device before the loss (strata.torch.paging); with `hidden` (the
    block's hidden states), what its MLP saves per token (strata.torch._tiled_mlp), for the
    plan's sequence tiles."""
    keeper = s.keeper
    saved = block_saved(s, run, block, args, kwargs, tokens, hidden)
    mlp = s.measured_mlp.get(tokens, 0) if saved is not None else 0
    head = getattr(s.head, "weight", None)
    vocab, hidden = (head.shape if torch.is_tensor(head) and head.dim() == 2 else (0, 0))
    loss = s.chunked_loss
    chunked = loss is not None and loss.enabled and bool(loss.chunk_tokens)
    blocks = keeper.profile_blocks(tokens)
    missing = s.positions - len(blocks)  # (a keeper of no blocks: tests, tools)
    blocks += [step_plan.Block(1, residency="streamed")] * max(0, missing)
    return step_plan.plan_step(
        blocks[:s.positions], plan_checkpoints=True, tokens=tokens, checkpoint_bytes=nbytes,
        block_saved_bytes=saved or 0, block_saved_measured=saved is not None,
        in_use_bytes=base, backward_grad_bytes=grad_bytes(s),
        leaving_bytes=s.leaving(), vocab=vocab, hidden=hidden,
        loss_chunked=chunked, loss_chunk_tokens=loss.chunk_tokens if chunked else 0,
        host_room_bytes=host_room(s), max_group_blocks=max_group(s),
        mlp_token_bytes=mlp, mlp_tiles=s.forced_tiles or 0,
        **state_figures(s.session()), **_step.device_figures(s.device))


def state_figures(session):
    """The optimizer state's tier figures of the step profile: the streamed blocks' optimizer
    state in DRAM (what the optimizer holds there, its staging slots aside) and what the NVMe
    tier can still take (0 without one). The plan advises from them how much of the state NVMe
    should take so that host memory holds the checkpoints (strata.h state_nvme_bytes); the
    state was placed at offload, before any batch, so strata.torch reports the advice
    (strata.torch._spill_report) rather than moving it."""
    opt = getattr(session, "optimizer", None)
    if opt is None or session.runtime is None:
        return {}
    stats = opt.stats()
    state = max(0, stats["state_bytes"] - stats["staging_bytes"])
    nvme = 0
    if session.runtime.capabilities().tiers_available[2]:
        usage = session.runtime.tier_usage("nvme")
        nvme = max(0, usage["budget"] - usage["used"])
    return {"state_dram_bytes": state, "nvme_free_bytes": nvme}


def max_group(s):
    """What this session can regenerate from one checkpoint: only streamed blocks are
    grouped (the plan's rule), and none inside torch.utils.checkpoint, which keeps every
    input anyway."""
    return 1 if s.inside_checkpoint else s.max_group


def host_room(s):
    """Host memory the spilled checkpoints may take: the runtime's room in host_budget and
    what the machine can give beside the reserve it keeps available (the runtime's rules),
    plus the buffers held now (unbounded without a budget: a pool outside a session)."""
    budget = s.pool.budget
    if budget is None:
        return (1 << 64) - 1
    usage = host_buffers.usage(budget.runtime)
    room = usage["room"]
    if usage["available"]:
        room = min(room, max(0, usage["available"] - usage["reserve"]))
    return room + s.pool.host_bytes


def forced_plan(s, tokens, nbytes):
    """spill_checkpoints=True with forced_group k: the library's groups of k at this
    batch (checkpoint_group_blocks, the user's size), every group's checkpoint spilled."""
    blocks = s.keeper.profile_blocks(tokens)
    blocks += [step_plan.Block(1, residency="streamed")] * max(0, s.positions - len(blocks))
    plan = step_plan.plan_step(
        blocks[:s.positions], plan_checkpoints=True, tokens=tokens, checkpoint_bytes=nbytes,
        device_total_bytes=1 << 30, device_free_bytes=0, in_use_bytes=1 << 30,
        checkpoint_group_blocks=s.forced_group, mlp_tiles=s.forced_tiles or 0)
    for b in plan.blocks:
        b["checkpoint"] = "dram"
    return plan


def forced_tiles_plan(s, tokens, nbytes):
    """offload(mlp_tiles=k) where no checkpoint decision is made (the CPU, spill_checkpoints
    True or False): the library's plan of k tiles at this batch, nothing else planned from it
    (which blocks are tiled is its rule: those that recompute)."""
    blocks = s.keeper.profile_blocks(tokens)
    blocks += [step_plan.Block(1, residency="streamed")] * max(0, s.positions - len(blocks))
    return step_plan.plan_step(
        blocks[:s.positions], plan_checkpoints=True, tokens=tokens, checkpoint_bytes=nbytes,
        device_total_bytes=1 << 30, device_free_bytes=0, in_use_bytes=1 << 30,
        mlp_tiles=s.forced_tiles)


def block_saved(s, run, block, args, kwargs, tokens, hidden=None):
    """What one block saves for its backward (its recompute) at this batch, measured on
    fake tensors once per batch size (None: it cannot be measured), and of it what its MLP
    saves per token (s.measured_mlp; strata.torch._tiled_mlp)."""
    if tokens not in s.measured:
        state = ForwardState(block)
        try:
            # A prediction, not a forward pass of the model's: the user's hooks do not see
            # it (they would count it, or record fake tensors).
            with without_forward_hooks(block):
                measured = measure(run, args, kwargs, s.device,
                                   list(block.parameters()))
                mlp = _tiled_mlp.token_bytes(block, hidden, s.device)
        finally:
            state.restore_buffers()
        s.measured = {tokens: None if measured is None else measured[0]}
        s.measured_mlp = {tokens: mlp}
    return s.measured[tokens]


def grad_bytes(s):
    """The grads the backward pass will allocate on the device: trainable parameters
    outside the streamed blocks (resident blocks, embedding, head) that hold none now."""
    return sum(p.numel() * p.element_size() for p in s.model_params
               if p.requires_grad and p.grad is None and p.device == s.device)
