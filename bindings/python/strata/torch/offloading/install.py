"""offload()'s changes to the model once the session exists: the host budget's account
(account_host_budget), the streamed blocks' forwards and hooks and the resident blocks'
(install), and model.strata with the model's own hooks and the chunked loss (attach)."""

import functools

import torch

from .. import _allocator, _chunked_loss, _foreign, _hooks, _params, _planning, _surgery, \
    _tiled_mlp
from .._block import streamed_forward
from .residents import keep_resident
from .rollback import remember_attribute, set_attribute


def account_host_budget(session, request):
    """host_budget, the runtime's one host budget (the arena first; what the budget leaves,
    strata.torch's own host memory, buffers of the runtime: the paged optimizer state,
    strata.torch.AdamW's, the spilled checkpoints, the host replica), set once the arena is
    pinned so a default budget does not count it twice. Under data parallelism a default budget is this rank's share of the host (the ranks of
    the host divide its available memory; every rank's arena is pinned by now: the runtimes
    were created in one collective step) and holds the host replica of the weights the
    layout pins later (state across hosts)."""
    mesh = request.mesh
    session.host_budget = _planning.HostBudget(
        session.runtime, request.host_budget,
        ranks=1 if mesh is None else mesh.ranks_on_host(),
        beside=_planning.replica_bytes(session.blocks, session.dtype, mesh))
    session.spill.use_budget(session.host_budget)


def install(model, session, request, plan, rollback):
    """The allocator setting, each streamed block's forward and state hooks, each resident
    block's checkpointed forward, and the guard on .to()/.half() of every module holding
    streamed blocks."""
    # Expandable segments, unless the process configured the allocator (strata.torch._allocator:
    # the default allocator's fixed segments strand what the loss's transients leave behind);
    # not under data parallelism (NCCL's buffer registration needs the default).
    if request.mesh is None:
        undo = _allocator.prefer_expandable_segments(request.device)
        if undo is not None:
            rollback.push(undo)
    for i, block in enumerate(plan.blocks):
        for p in block.parameters():
            _params.set_owner(p, session)
        rollback.push(functools.partial(_unmark_owner, block))
        set_attribute(block, "forward", streamed_forward(session, i, block.forward), rollback)
        for handle in _hooks.install_state_hooks(session, i, block):
            rollback.push(handle.remove)
    for index, block in enumerate(plan.kept):
        remember_attribute(block, "forward", rollback)
        keep_resident(session, index, block, session.spill)
    # Each block's MLP over the sequence tiles the step plan gives its position (resident
    # blocks first, as the plan orders them).
    names = {id(m): n for n, m in model.named_modules()}
    for position, block in enumerate(list(plan.kept) + list(plan.blocks)):
        undo = _tiled_mlp.install(block, functools.partial(session.spill.tiles_at, position),
                                  names.get(id(block), "block") + "." + _tiled_mlp.MLP_ATTRIBUTE,
                                  forced=lambda: bool(session.spill.forced_tiles))
        if undo is not None:
            rollback.push(undo)
    streamed = {id(p) for b in plan.blocks for p in b.parameters()}
    for m in model.modules():
        inside = [p for p in m.parameters() if id(p) in streamed]
        if inside:
            set_attribute(m, "_apply", _hooks.guard_apply(session, m, inside), rollback)


def _unmark_owner(block):
    for p in block.parameters():
        _params.set_owner(p, None)


def attach(model, session, plan, request):
    """model.strata, the load hooks around the build and between steps, the model's forward
    pre-hooks, the refusals of a second distribution layer (strata.torch._foreign), the
    out-of-memory notes of a model with resident blocks, and the chunked loss (last: nothing
    can fail after its hooks are in)."""
    model.strata = session
    around = _surgery.blocks_around(model, plan.blocks)
    _hooks.install_load_hooks(model, session, plan.blocks, around)
    model.register_forward_pre_hook(_hooks.ModelForwardBegins(session, around))
    _foreign.install(model, around)  # DDP, FSDP, DeepSpeed over the model: refused
    if plan.kept:
        _hooks.note_memory_errors(model, session)
    if request.loss_chunk_tokens is not None:
        # The default (0) chunks only a call with more tokens than one chunk: below that the
        # whole logits are no larger, and the model's own loss is plain PyTorch's arithmetic.
        session.chunked_loss = _chunked_loss.install(
            model, request.loss_chunk_tokens or None, auto=request.loss_chunk_tokens == 0)
    else:
        session.chunked_loss = _chunked_loss.installed(model)
    # What the spill decision (strata.torch._spill) counts besides the blocks: the grads of the
    # parameters outside the streamed blocks, and the loss's logits.
    streamed = {id(p) for b in plan.blocks for p in b.parameters()}
    session.spill.model_params = [p for p in model.parameters() if id(p) not in streamed]
    head = getattr(model, "get_output_embeddings", lambda: None)()
    session.spill.head = head if isinstance(head, torch.nn.Module) else None
    session.spill.chunked_loss = session.chunked_loss
