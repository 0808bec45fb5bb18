"""The model outside the streamed blocks on the device (move_residents: materialized or read
from offload(weights=), in the compute dtype) and each resident block's forward (keep_resident:
plain PyTorch with checkpointing, or its activations kept, or its checkpoint spilled)."""

import functools

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from .. import _params, _surgery, _weights
from .._replay import replaying_forward_state, without_caches


def move_residents(model, session, request, plan, rollback):
    """Everything outside the streamed blocks onto the device, in the compute dtype (buffers
    keep theirs): materialized with its init, or read from offload(weights=). A resident
    parameter narrowed from fp32 keeps its fp32 values for its master (session.kept_fp32). The
    streamed blocks are registered with the runtime later (the session's Builder)."""
    device, dtype, source = request.device, request.dtype, request.source
    in_blocks = {id(m) for b in plan.blocks for m in b.modules()}
    rest = [m for m in model.modules() if id(m) not in in_blocks]
    reads = None  # offload(weights=): the residents' tensors, read ahead
    if source is not None:  # the next module's tensors are read while this one is copied
        reads = _weights.Prefetcher(*source, [list(m.parameters(recurse=False)) for m in rest])
    try:
        for m in rest:
            for p in m.parameters(recurse=False):
                rollback.push(functools.partial(_restore_param, p, p.data))
            for name, b in m.named_buffers(recurse=False):
                rollback.push(functools.partial(_restore_buffer, m, name, b))
            if source is None:
                _surgery.materialize(m, device, session.init, recurse=False)
            else:
                _weights.load_module(m, device, *source, values=reads.next())
            for p in m.parameters(recurse=False):
                if p.dtype == torch.float32 and dtype != torch.float32:
                    # Its fp32 master (strata.torch.AdamW) starts from these values, unless
                    # the parameter is written before the optimizer exists (a load: its
                    # version moves) and the master starts from what was written.
                    _params.keep_fp32(p, p.data)
                p.data = p.data.to(device, dtype)
                if _params.fp32(p) is not None:
                    _params.note_fp32_version(p)
                    session.kept_fp32.append(p)
            _surgery.rebuild_meta_buffers(m, device, session.init)
            for name, b in list(m.named_buffers(recurse=False)):
                m._buffers[name] = b.to(device)
    finally:
        if reads is not None:
            reads.close()


def _restore_param(p, data):
    """A resident parameter's data before move_residents (a meta one stays meta: .data cannot
    go back from a real tensor to the meta device, and nothing of it was used)."""
    if not data.is_meta or p.is_meta:
        p.data = data
    _params.drop_fp32(p)


def _restore_buffer(module, name, value):
    module._buffers[name] = value


def _announcing_backward(session, index, output):
    """`output` of resident block `index`, its backward pass announced to the session's
    on_resident_backward_begin calls (strata.torch.paging brings optimizer state back as
    the later blocks free their memory) when the grad of its first tensor that requires one
    (its hidden states) arrives."""
    calls = session.on_resident_backward_begin
    if not calls:
        return output
    for leaf in tree_flatten(output)[0]:
        if torch.is_tensor(leaf) and leaf.requires_grad:
            def announce(grad):
                for call in calls:
                    call(index)
            leaf.register_hook(announce)
            break
    return output


def keep_resident(session, index, block, spill=None):
    """A block kept in HBM runs as plain PyTorch with activation checkpointing (RNG-exact, as
    the streamed blocks recompute), so its activation memory is what a streamed block's is;
    unless the measured memory lets it keep its activations (strata.torch.activations), all
    of them or only its matrix products' and attention's outputs, which gives the same values
    without the recompute (or with only its elementwise part). `spill`: the session's
    strata.torch._spill.Spiller, which may send its checkpoint to host memory (None: it stays)."""
    run = block.forward
    keeper = session.activations

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return run(*args, **kwargs)
        if index == 0 and keeper.enabled:
            keeper.forward_begins()
        for call in session.on_resident_forward_begin:
            call(index)
        leaves, spec = tree_flatten((args, kwargs))
        args, kwargs = tree_unflatten(without_caches(leaves), spec)
        keeper.observe(index, run, args, kwargs)
        if index == 0 and spill is not None:
            spill.forward_begins(run, block, args, kwargs)
        return _announcing_backward(session, index, _run_kept(index, args, kwargs))

    def _run_kept(index, args, kwargs):
        mode = keeper.mode(index, args)
        if mode == "whole":
            return run(*args, **kwargs)
        # The recompute runs on the buffers and train/eval flags the forward had.
        once = replaying_forward_state(block, run)
        if mode == "selective":
            return checkpoint(once, *args, use_reentrant=False, preserve_rng_state=True,
                              context_fn=functools.partial(keeper.context, index), **kwargs)
        if spill is None:
            return checkpoint(once, *args, use_reentrant=False, preserve_rng_state=True,
                              **kwargs)
        # The checkpoint saves the block's inputs: its hidden states may go to host memory.
        with spill.saving(index, args, kwargs):
            return checkpoint(once, *args, use_reentrant=False, preserve_rng_state=True,
                              **kwargs)

    # torch.compile: run as it is (a graph break), so that the calls above (the activation
    # keeper's, the pager's) run at every forward pass, not once when traced.
    block.forward = torch.compiler.disable(forward)
