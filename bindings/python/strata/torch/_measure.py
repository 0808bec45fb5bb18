"""What a block would keep for its backward pass, measured on fake tensors (shapes only: no
memory, no compute), and the selective-checkpoint contexts that keep only its costly ops'
outputs (matrix products and attention). strata.torch.activations' keeper and
strata.torch._spill's decision measure through here; the decisions are the library's step plan
(strata.step_plan)."""

import contextlib

import torch


def _costly_ops():
    """The ops whose outputs a selectively kept block saves: matrix products and attention."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
             "_efficient_attention_forward", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_fused_attention_overrideable")
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


COSTLY_OPS = _costly_ops()


def _dropout_p(func, args, kwargs):
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "dropout_p":
            if arg.name in kwargs:
                return kwargs[arg.name]
            return args[i] if i < len(args) else arg.default_value
    return 0.0


def saves_output(func, args, kwargs):
    """Whether a selectively kept block saves `func`'s output instead of recomputing it: a
    matrix product or attention, unless it draws random numbers (attention with dropout; the
    recompute must draw what the forward drew, in the same order)."""
    if func.overloadpacket not in COSTLY_OPS:
        return False
    if torch.Tag.nondeterministic_seeded in func.tags:
        return not _dropout_p(func, args, kwargs or {})
    return True


def selective_context(limit=None):
    """checkpoint(context_fn=...) for a selectively kept block (with functools.partial for a
    limit): the outputs of its first `limit` costly ops are cached (None: all of them).

    Past the last tensor autograd saves, torch's recompute stops (its early stop): the ops after
    it never run again, so caching their outputs would only hold memory (a Llama block's last
    product, down_proj, whose output only feeds the residual sum: ~10% of the bytes). The policy
    counts costly ops in the order the forward runs them, the recompute's calls apart (older
    torch asks it there too)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    seen = {False: 0, True: 0}  # costly ops so far, in the forward and in the recompute

    def policy(ctx, func, *args, **kwargs):
        if func.overloadpacket not in COSTLY_OPS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        ordinal = seen[ctx.is_recompute]
        seen[ctx.is_recompute] += 1
        if (limit is None or ordinal < limit) and saves_output(func, args, kwargs):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def measure(run, args, kwargs, device, params=(), everything=None):
    """What keeping `run(*args, **kwargs)` would hold, from one forward on fake tensors:
    (bytes kept wholly, (bytes, limit) kept selectively or None), or None when the forward
    cannot be done on fake tensors (an op without a fake kernel, a data-dependent shape).

    Wholly: what autograd saves beside `params` (the block's parameters). Selectively: the
    outputs of its costly ops (matrix products, attention) that its recompute reaches, and how
    many of its costly ops come before the recompute stops (selective_context's limit);
    everything: all its costly ops' outputs, and how many there are (None: when
    torch.utils.checkpoint.set_checkpoint_early_stop(False) is in force, since the recompute
    then runs the whole block and would redo the products past the stop). Selectively is None
    when the block writes in place into one of those outputs, through any alias (the cached
    value would no longer be what the backward needs, and torch's version check misses a
    write through _unsafe_view's alias). A caller writing in place into the block's output is
    not seen here."""
    import torch.utils.checkpoint as checkpointing
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._pytree import tree_leaves

    if everything is None:
        everything = getattr(checkpointing, "_enable_checkpoint_early_stop", None) is False
    ops = [0]  # ops dispatched so far
    costly = []  # per costly op: (its position, {storage: (bytes, tensor, version)} if saved)
    last_pack = [0]  # ops dispatched when autograd last saved a tensor
    written = []  # an op wrote into a cached storage
    params_seen = set()  # the parameters' storages (not counted)
    # Per storage autograd saved: (a weak reference to it, its bytes). Counted at the end are
    # those still alive while the block's output is: what a branch of the forward left behind
    # (a router's scores with grad, dropped for their indices) is freed with its graph, and its
    # address may then be a later saved storage's (counted by address alone, the figure
    # depended on the allocator's reuse: one block measured 87,824 or 96,016 bytes).
    saved = {}
    outputs = []  # the forward's output, held until the count

    def cached():
        return {k: v for _, outs in costly for k, v in outs.items()}

    class Saving(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            # A write through any alias of a cached output (a view, or _unsafe_view's tensor,
            # which has a version counter of its own): compared by storage, not by version.
            keys = None
            for i, arg in enumerate(func._schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = args[i] if i < len(args) else kwargs.get(arg.name)
                    keys = cached() if keys is None else keys
                    if any(torch.is_tensor(t) and t.untyped_storage()._cdata in keys
                           for t in tree_leaves(value)):
                        written.append(func)
            out = func(*args, **kwargs)
            if func.overloadpacket in COSTLY_OPS:
                outs = {}
                if saves_output(func, args, kwargs):
                    for t in tree_leaves(out):
                        if torch.is_tensor(t):
                            outs.setdefault(t.untyped_storage()._cdata,
                                            (t.untyped_storage().nbytes(), t, t._version))
                costly.append((ops[0], outs))
            ops[0] += 1
            return out

    def pack(t):
        last_pack[0] = ops[0]
        if isinstance(t, FakeTensor):  # a real tensor here is a parameter or buffer
            storage = t.untyped_storage()
            key = storage._cdata  # the StorageImpl: the same for every view of it
            if key not in params_seen and (key not in saved or saved[key][0].expired()):
                saved[key] = (StorageWeakRef(storage), storage.nbytes())
        return t

    if not _forward_on_fake(run, args, kwargs, device, pack, Saving(), params=params,
                            known=params_seen, outputs=outputs):
        return None
    total = sum(size for ref, size in saved.values() if not ref.expired())
    outputs.clear()
    if written or any(t._version != version for _, t, version in cached().values()):
        return total, None
    # Autograd saves an op's inputs before the op runs and its outputs after: the recompute
    # stops inside the op that was running at the last save, so the costly ops before it run.
    reached = [outs for position, outs in costly if everything or position < last_pack[0]]
    kept = {k: v for outs in reached for k, v in outs.items()}
    return total, (sum(size for size, _, _ in kept.values()), len(reached))


def selective_bytes(run, args, kwargs, device, everything=None):
    """measure()'s (bytes, limit) for keeping `run(*args, **kwargs)` selectively, or None."""
    measured = measure(run, args, kwargs, device, everything=everything)
    return None if measured is None else measured[1]


def saved_bytes(run, args, kwargs, device, params):
    """Bytes `run(*args, **kwargs)` would save for its backward beside `params` (its
    parameters), from a forward on fake tensors; None when that cannot be done."""
    measured = measure(run, args, kwargs, device, params)
    return None if measured is None else measured[0]


def _forward_on_fake(run, args, kwargs, device, pack, dispatch=None, params=(), known=None,
                     outputs=None):
    """run(*args, **kwargs) once on fake tensors (shapes only: no memory, no compute), with
    grad, each tensor autograd saves passed to `pack`, the ops through `dispatch` (a
    TorchDispatchMode) when given, the RNG state restored after. `params` are made fake first
    and their storages added to `known`; its output is appended to `outputs` (held: what
    autograd saved for it stays alive). False when it cannot be done (an op without a fake
    kernel, a custom block)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map

    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                # The mode converts a real tensor to the same fake one while that one lives:
                # held here, the parameters' fake storages (and the views of them autograd
                # saves) are known, and no storage address is reused meanwhile.
                fake_params = [_fake_parameter(mode, p) for p in params]
                if known is not None:
                    known.update(f.untyped_storage()._cdata for f in fake_params)
                fake = tree_map(lambda x: mode.from_tensor(x) if torch.is_tensor(x) else x,
                                (args, kwargs))
                hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
                with torch.enable_grad(), hooks, dispatch or contextlib.nullcontext():
                    out = run(*fake[0], **fake[1])
                if outputs is not None:
                    outputs.append(out)
    except Exception:
        return False
    return True


def _fake_parameter(mode, p):
    """`p` as the fake tensor its block's forward sees: a parameter whose storage cannot hold
    its elements is a placeholder (a streamed parameter parked between its block's passes: one
    element expanded to its shape, every stride 0), and its block runs on it at the contiguous
    layout of its slot, so its fake is that layout. Faked as it is, a product that checks its
    operands' strides refuses it (torch's grouped_mm, which Hugging Face runs a
    mixture-of-experts block's 3-D expert weights through: "Invalid strides/sizes, got (0, 0,
    0)"), and the block could not be measured. The mode's memo maps `p` to this fake, so the
    forward's reads of `p` get it."""
    needed = p.numel() * p.element_size()
    if p.numel() <= 1 or p.untyped_storage().nbytes() >= needed:
        return mode.from_tensor(p)
    with mode:
        fake = torch.empty(p.shape, dtype=p.dtype, device=p.device)
    fake.requires_grad_(p.requires_grad)
    mode.fake_tensor_converter.set_tensor_memo(p, fake)
    return fake


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
