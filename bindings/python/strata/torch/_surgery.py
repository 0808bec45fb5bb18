"""Model surgery: what strata.torch finds in, refuses of and does to a model's modules and
parameters before and while it streams them (its repeated blocks, parameters shared where they
cannot be, modules built on the meta device given storage and values, a parameter given other
data while staying the same object). Knows torch's modules, not Strata."""

import torch
from torch import nn

from . import _params


# Where models keep their repeated blocks, relative to the model or to its decoder.
_BLOCK_PATHS = ("model.layers", "transformer.h", "gpt_neox.layers", "layers", "blocks", "h")


def find_blocks(model):
    """The model's repeated blocks: Hugging Face decoders keep them in model.model.layers (or
    transformer.h for GPT-2 style models); a model holding a decoder beside other stacks (a
    vision-language model: its vision tower's blocks and its language model's layers) streams
    its decoder's, the module its get_decoder() names, whatever their sizes (a small language
    model beside a larger vision tower too; the vision tower stays resident:
    docs/python-guide.md, "Vision-language models"); otherwise the largest nn.ModuleList of
    one type."""
    decoder = _decoder(model)
    for root in (model, decoder):
        found = _at_known_path(root) if root is not None else None
        if found is not None:
            return found
    best = _largest_list(decoder) if decoder is not None else None
    best = best if best is not None else _largest_list(model)
    if best is None:
        raise ValueError("strata.torch.offload: the model has no list of repeated blocks "
                         "(nn.ModuleList) to stream")
    return best


def _decoder(model):
    """The module the model names its decoder (transformers' get_decoder(): a
    vision-language model's language model), where it is a part of the model; else None."""
    get = getattr(model, "get_decoder", None)
    if not callable(get):
        return None
    try:
        decoder = get()
    except (AttributeError, NotImplementedError):  # transformers: "best-effort", may raise
        return None
    if not isinstance(decoder, nn.Module) or decoder is model or \
            not any(decoder is m for m in model.modules()):
        return None
    return decoder


def _at_known_path(root):
    """The first non-empty nn.ModuleList at one of _BLOCK_PATHS under `root`, or None."""
    for path in _BLOCK_PATHS:
        obj = root
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList) and len(obj) > 0:
            return obj
    return None


def _largest_list(root):
    """The nn.ModuleList of several modules of one type under `root` with the most parameters,
    or None."""
    best, best_size = None, -1
    for m in root.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(x) for x in m}) == 1:
            size = sum(p.numel() for p in m.parameters())
            if size > best_size:
                best, best_size = m, size
    return best


def refuse_shared_blocks(blocks):
    """Blocks that are one module, or share parameters (ALBERT's one block applied N times):
    each streamed block's weights and grads have a place of their own in Strata, one update
    per step; a shared one would be registered twice. Refused before anything changes."""
    owner = {}
    for i, block in enumerate(blocks):
        for name, p in block.named_parameters():
            if id(p) in owner and owner[id(p)][0] != i:
                raise ValueError(
                    "strata.torch.offload: blocks %d and %d share parameter %r (the same module "
                    "or tied weights, as ALBERT repeats one block): streamed blocks each need "
                    "their own parameters; nothing was changed" % (owner[id(p)][0], i, name))
            owner.setdefault(id(p), (i, name))


def refuse_shared_outside(model, blocks):
    """A streamed block's parameter that a module outside the block holds too (weights tied
    between a block and the head, a gate shared with the embedding): outside its block's
    forward pass a streamed parameter is a placeholder, so the other module would compute
    with it, and its grads from there would not reach Strata. Refused before anything
    changes."""
    streamed = {id(p) for block in blocks for p in block.parameters()}
    # A module reached under a second name (model.last = model.layers[-1]) is still inside.
    within = {id(m) for block in blocks for m in block.modules()}
    names, outside = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in streamed:
            continue
        names.setdefault(id(p), []).append(name)
        owner = name.rpartition(".")[0]
        if id(model.get_submodule(owner) if owner else model) not in within:
            outside.setdefault(id(p), []).append(name)
    for key, elsewhere in outside.items():
        inner = [n for n in names[key] if n not in elsewhere]
        if inner:
            raise ValueError(
                "strata.torch.offload: parameter %s is shared between a streamed block and a "
                "module outside it (%s): a streamed block's parameters live in Strata and are "
                "only real inside its forward pass. Untie them, or keep that block resident "
                "(resident_blocks=); nothing was changed" % (inner[0], ", ".join(elsewhere)))


def swap_data(p, data):
    """Parameter `p` takes `data`, staying the same Python object with its attributes (its
    optimizer groups, names and tied modules keep pointing at it): torch.utils.swap_tensors,
    as .data cannot go from the meta device to a real one."""
    attrs = dict(p.__dict__)
    with _params.unreferenced(p):  # swap_tensors refuses a tensor with weak references
        torch.utils.swap_tensors(p, torch.nn.Parameter(data, p.requires_grad))
    p.__dict__.update(attrs)


def rebuild_meta_buffers(module, device, init=None):
    """Buffers still on the meta device after materializing (non-persistent ones computed in
    __init__, such as rotary inverse frequencies, which neither to_empty nor _init_weights
    fill): computed again by building the module anew from its config on the CPU; a module
    without a config (Gemma 3's scaled embedding and its embed_scale) by the model's init
    function `init` where it fills them (_init_buffers)."""
    meta = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
    if not meta:
        return
    config = getattr(module, "config", None)
    fresh = None
    if config is not None:
        with torch.device("cpu"):
            for make in (lambda: type(module)(config=config), lambda: type(module)(config)):
                try:
                    fresh = make()
                    break
                except TypeError:
                    continue
    if fresh is None:
        if init is not None and _init_buffers(module, meta, device, init):
            return
        raise ValueError("strata.torch.offload: buffer(s) %s of %s are on the meta device and "
                         "cannot be recomputed (the module has no config to rebuild it from, "
                         "and the model's init does not fill them); build the model with real "
                         "buffers" % (meta, type(module).__name__))
    for name in meta:
        module._buffers[name] = getattr(fresh, name).to(device)


def _init_buffers(module, names, device, init):
    """The meta buffers `names` of `module` given storage on `device` and filled by the model's
    init function (transformers 5's _init_weights fills non-persistent buffers: Gemma 3's
    embed_scale, rotary frequencies). The module's parameters, which hold their values already,
    are stood in for by meta copies during the call (an init writing them writes nothing).
    Whether the init wrote a buffer is told by its version counter (in-place writes move it).
    True where it filled all of them; else the buffers are left on meta."""
    before = {n: module._buffers[n] for n in names}
    for n in names:
        module._buffers[n] = torch.empty(before[n].shape, dtype=before[n].dtype, device=device)
    versions = {n: module._buffers[n]._version for n in names}
    params = dict(module._parameters)
    try:
        for n, p in params.items():
            if p is not None:
                module._parameters[n] = nn.Parameter(torch.empty_like(p, device="meta"),
                                                     p.requires_grad)
        init(module)
    finally:
        module._parameters.update(params)
    if all(module._buffers[n]._version != versions[n] for n in names):
        return True
    module._buffers.update(before)
    return False


def blocks_around(model, blocks):
    """(name, module) for each streamed block and each module that contains one (the model
    down to the blocks' list): where transformers turns gradient checkpointing on around them,
    on the blocks (its checkpointing layers) or, in older versions, on the module whose forward
    loops over them. Found once: the model's forward pre-hook reads these, not every module."""
    inside = {id(b) for b in blocks}
    found = []
    for name, m in model.named_modules():
        if any(id(sub) in inside for sub in m.modules()):  # m.modules() includes m
            found.append((name, m))
    return found


def materialize(module, device, init, recurse=True):
    """A module built on the meta device (to build a model larger than host memory allows
    twice) gets real storage on `device` and its init function's values; buffers computed at
    construction (rotary frequencies) are computed again. The parameters stay the same
    objects (optimizer groups, names and tied weights keep pointing at them)."""
    modules = list(module.modules()) if recurse else [module]
    if any(p.is_meta for m in modules for p in m.parameters(recurse=False)):
        if init is None:
            raise ValueError("strata.torch.offload: the model is on the meta device and has no "
                             "_init_weights(module) to initialize it")
        # What is not on meta (loaded into a meta model before its build: load_state_dict(...,
        # strict=False)) keeps its values: the init is for the meta tensors, and a module's
        # init may write its children's too (GPT-2's attention re-initializes its c_proj).
        loaded = [(p, p.detach().clone()) for m in modules for p in m.parameters(recurse=False)
                  if not p.is_meta]
        loaded_buffers = [(m, name, b.detach().clone()) for m in modules
                          for name, b in m.named_buffers(recurse=False)
                          if not b.is_meta and name not in m._non_persistent_buffers_set]
        for m in modules:
            for p in m.parameters(recurse=False):
                if p.is_meta:
                    swap_data(p, torch.empty(p.shape, dtype=p.dtype, device=device))
            for name, b in list(m.named_buffers(recurse=False)):
                if b.is_meta and name not in m._non_persistent_buffers_set:
                    m._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
        for m in modules:
            init(m)
        with torch.no_grad():
            for p, values in loaded:
                p.data.copy_(values)
            for m, name, values in loaded_buffers:
                m._buffers[name] = values.to(m._buffers[name].device)
    for m in modules:
        rebuild_meta_buffers(m, device, init)
