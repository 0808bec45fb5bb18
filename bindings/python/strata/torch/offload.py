"""strata.torch.offload: stream a model's repeated blocks through Strata. The model stays the
same nn.Module with the same parameters and names; each block's forward is replaced by one
that streams it (strata.torch.block), and its state_dict / load_state_dict read and write the
values in Strata."""

import functools
import os
import time

import torch
from torch import nn

from .block import streamed_forward
from .session import DTYPE_NAMES, StrataSession, master_layout, swap_data


def find_blocks(model):
    """The model's repeated blocks: Hugging Face decoders keep them in model.model.layers (or
    transformer.h for GPT-2 style models); otherwise the largest nn.ModuleList of one type."""
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "layers", "blocks", "h"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList) and len(obj) > 0:
            return obj
    best = None
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(x) for x in m}) == 1:
            if best is None or sum(p.numel() for p in m.parameters()) > \
                    sum(p.numel() for p in best.parameters()):
                best = m
    if best is None:
        raise ValueError("strata.torch.offload: the model has no list of repeated blocks "
                         "(nn.ModuleList) to stream")
    return best


def _refuse_shared_blocks(blocks):
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


def _refuse_shared_outside(model, blocks):
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


def rebuild_meta_buffers(module, device):
    """Buffers still on the meta device after materializing (non-persistent ones computed in
    __init__, such as rotary inverse frequencies, which neither to_empty nor _init_weights
    fill): computed again by building the module anew from its config on the CPU."""
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
        raise ValueError("strata.torch.offload: buffer(s) %s of %s are on the meta device and "
                         "cannot be recomputed (the module has no config to rebuild it from); "
                         "build the model with real buffers" % (meta, type(module).__name__))
    for name in meta:
        module._buffers[name] = getattr(fresh, name).to(device)


def _guard_apply(session, module, streamed):
    """Changing dtype or device of streamed blocks (model.to(...), .half(), .cuda()) cannot
    work: their values live in Strata. Refused loudly before anything is converted, on every
    module holding streamed blocks (`streamed`: their parameters); a conversion that changes
    nothing (model.to(the same device), as accelerate's prepare() does) passes."""
    original = module._apply

    def _apply(fn, *args, **kwargs):
        if session.applying:
            return original(fn, *args, **kwargs)
        for p in streamed:
            t = fn(p.data)
            if t.dtype != p.dtype or t.device != p.device:
                raise RuntimeError(
                    "strata.torch: the model is offloaded; its streamed blocks' dtype and device "
                    "are fixed by strata.torch.offload(dtype=..., device=...) (model.to / .half "
                    "/ .cuda to another dtype or device after offload are not supported)")
        if module in session.blocks:
            return module  # unchanged: its parameters' data are Strata's placeholders
        return original(fn, *args, **kwargs)

    module._apply = _apply


class _StateHooks:
    """model.state_dict() returns the streamed values (read from Strata, on the CPU) under the
    model's own names; model.load_state_dict() writes them into Strata. (Methods of an object,
    not closures: pickling the model then reaches the session, which says why it cannot be.)"""

    def __init__(self, session, index):
        self.session, self.index, self.handled = session, index, []

    def entries(self):
        return self.session.layers[self.index] if self.session.layers else []

    def state(self, module, state_dict, prefix, local_metadata):
        self.session.check_open()
        for sp in self.entries():
            sp.check_untouched()
        for sp in self.entries():  # none before the blocks move into Strata: the params hold them
            key = prefix + sp.local
            if key in state_dict:
                state_dict[key] = self.session.read_weight(sp)

    def load_pre(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected,
                 error_msgs):
        self.session.check_open()
        _refuse_assign(local_metadata)  # before anything is written into Strata
        for sp in self.entries():
            key = prefix + sp.local
            if key in state_dict:
                try:
                    self.session.write_weight(sp, state_dict.pop(key))
                except ValueError as e:
                    error_msgs.append(str(e))
                # Written, or its error reported: not "missing" either way.
                self.handled.append(key)

    def load_post(self, module, incompatible):
        for key in self.handled:
            if key in incompatible.missing_keys:
                incompatible.missing_keys.remove(key)
        self.handled.clear()


class _LoadsBeforeBuild:
    """The load_state_dict pre-hook of every module inside a streamed block (the block too:
    a load of the model, of the block or of a module within it reaches the first of them).
    assign=True is refused. Before the blocks move into Strata their parameters hold the
    values and torch copies the loaded ones in; those of a model built on the meta device get
    storage first (torch's copy into a meta tensor does nothing, and the build would then
    initialize them), where the loaded value fits (a mismatch fails the load and leaves the
    tensor to the init), and every loaded parameter is marked so that the build takes it
    rather than offload(weights=)'s file."""

    def __init__(self, session):
        self.session = session

    def __call__(self, module, state_dict, prefix, local_metadata, *args):
        _refuse_assign(local_metadata)
        if self.session.layers:
            return  # built: the blocks' own hooks write into Strata
        for local, p in module.named_parameters(recurse=False):
            value = state_dict.get(prefix + local)
            if torch.is_tensor(value) and value.shape == p.shape:
                if p.is_meta:  # uninitialized host memory, the loaded values copied in next
                    swap_data(p, torch.empty(p.shape, dtype=p.dtype))
                p._strata_loaded = True
        for name, b in list(module.named_buffers(recurse=False)):
            value = state_dict.get(prefix + name)
            if b.is_meta and name not in module._non_persistent_buffers_set and \
                    torch.is_tensor(value) and value.shape == b.shape:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype,
                                                    device=self.session.device)


class _ResidentFp32Loads:
    """Pre- and post-hook of load_state_dict on every module holding a resident parameter
    with offload's fp32 values (the model, its head, the embedding's module...): a resident
    parameter cast to a narrower compute dtype keeps the fp32
    values its master will start from (`_strata_fp32`, until the optimizer exists); a load
    into it brings values the cast rounds, so they become the kept ones too (dropped, the
    master would start from the rounded parameter: 2e-4 off a plain fp32 model loaded with
    the same values)."""

    def __init__(self):
        self.pending = {}  # id(module) -> [(parameter, loaded value)] of its load under way

    def pre(self, module, state_dict, prefix, *args):
        self.pending[id(module)] = [
            (p, state_dict[prefix + name]) for name, p in module.named_parameters()
            if "_strata_fp32" in p.__dict__ and torch.is_tensor(state_dict.get(prefix + name))
            and state_dict[prefix + name].shape == p.shape]

    @torch.no_grad()
    def post(self, module, incompatible):
        for p, value in self.pending.pop(id(module), []):
            kept = p.__dict__.get("_strata_fp32")
            if kept is not None and torch.equal(value.to(p.device, p.dtype), p.detach()):
                kept.copy_(value)  # what the load wrote, before its rounding
                p._strata_fp32_version = p._version


def _refuse_assign(local_metadata):
    """load_state_dict(..., assign=True) replaces the model's Parameter objects (the optimizer
    keeps the old ones); the streamed ones cannot be replaced, so half the model would go on
    training and half would not. Checked on every module holding streamed blocks (a load of
    the model or of a submodule) and on the blocks, before anything is loaded."""
    if local_metadata.get("assign_to_params_buffers"):
        raise RuntimeError("strata.torch: load_state_dict(..., assign=True) would replace the "
                           "parameters of an offloaded model, whose streamed ones live in "
                           "Strata; load without assign (the values are copied in); nothing "
                           "was loaded")


class _Hook:
    """One of _StateHooks' methods as a hook object (torch marks hooks with attributes, which
    bound methods cannot take)."""

    def __init__(self, hooks, name):
        self.hooks, self.name = hooks, name

    def __call__(self, *args, **kwargs):
        return getattr(self.hooks, self.name)(*args, **kwargs)


def _install_state_hooks(session, index, block):
    hooks = _StateHooks(session, index)
    register = getattr(block, "register_state_dict_post_hook", None) or \
        block._register_state_dict_hook
    register(_Hook(hooks, "state"))
    block._register_load_state_dict_pre_hook(_Hook(hooks, "load_pre"), with_module=True)
    block.register_load_state_dict_post_hook(_Hook(hooks, "load_post"))


def _estimate_dram(blocks, dtype, mesh=None, grads="dram"):
    from .. import core
    if mesh is None:
        counts = [sum(p.numel() for p in b.parameters()) for b in blocks]
    else:  # this rank's shards
        from .sharded import chunk_elements
        counts = [sum(chunk_elements(p.numel(), mesh.shard_size) for p in b.parameters())
                  for b in blocks]
    _, dram = core.streaming_budgets(counts, torch.finfo(dtype).bits // 8, master_layout(dtype),
                                     grads)
    return dram


def _mem_available():
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _disk_free(paths):
    """Bytes the NVMe tier's files can take: the striped files grow equally, so each file
    system holds its share (its files over all of them) of the budget; 5% and 1 GiB of each
    are left to it."""
    free, files = {}, {}
    for path in paths:
        folder = os.path.dirname(os.path.abspath(path))
        st = os.statvfs(folder)
        dev = os.stat(folder).st_dev
        free[dev] = max(0, int(st.f_bavail * st.f_frsize * 0.95) - (1 << 30))
        files[dev] = files.get(dev, 0) + 1
    return min(free[dev] * len(paths) // files[dev] for dev in free)


def _auto_resident_blocks(model, blocks, dtype, device, gpu_budget, grads="dram"):
    """How many of the first blocks to keep resident in HBM: as many as fit in 40% of the device
    memory left beside Strata's own (the rest for activations, logits and the allocator), at 16
    bytes per parameter in bf16 (the compute-dtype weight and grad, an fp32 master unless the
    weights are fp32, AdamW's m and v; the fp32 grads the update reads exist a chunk at a time,
    st.AdamW.RESIDENT_CHUNK). Resident blocks need no transfers and are updated by torch's
    AdamW on the device at once, so the CPU's updates of the streamed ones start with the
    resident blocks' forward pass as a head start (the next forward pass needs the first blocks
    first). The free memory counted is what is left once the rest of the model (embeddings,
    head: not yet on the device for a meta model) and its optimizer state are there, at the
    same bytes per parameter (a 128k-vocabulary 8B Llama's embedding and head take 17 GB: left
    out, 7 blocks were kept on an 80 GB GPU and the first step ran out of memory). 0 on the
    CPU."""
    if device.type != "cuda":
        return 0
    free, _ = torch.cuda.mem_get_info(device)
    from .. import core
    element = torch.finfo(dtype).bits // 8
    # Resident blocks are trained by torch's AdamW with whole fp32 masters (never split).
    per_param = 2 * element + core.state_bytes_per_param(element)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    coming = sum(p.numel() for p in model.parameters()
                 if id(p) not in in_blocks and p.device != device)
    free = max(0, free - coming * per_param)
    spare = max(0, free - (gpu_budget or 0)) * 2 // 5
    counts = [sum(p.numel() for p in b.parameters()) for b in blocks]
    grad_bytes = 0
    if grads == "hbm":
        # The streamed blocks' grads in HBM come out of the residents' share, not out of what
        # the activations and logits are left: a block kept resident gives its grads' share
        # back (its own grad is in per_param).
        grad_bytes = element
        spare -= core.grads_hbm_bytes(counts, element)
    k = 0
    for n in counts[:-1]:  # at least one block streams
        need = n * (per_param - grad_bytes)
        if need > spare:
            break
        spare -= need
        k += 1
    return k


def _keep_resident(session, index, block):
    """A block kept in HBM runs as plain PyTorch with activation checkpointing (RNG-exact, as
    the streamed blocks recompute), so its activation memory is what a streamed block's is;
    unless the measured memory lets it keep its activations (strata.torch.activations), all
    of them or only its matrix products' and attention's outputs, which gives the same values
    without the recompute (or with only its elementwise part)."""
    from torch.utils._pytree import tree_flatten, tree_unflatten
    from torch.utils.checkpoint import checkpoint

    from .block import replaying_forward_state, without_caches
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
        mode = keeper.mode(index, args)
        if mode == "whole":
            return run(*args, **kwargs)
        # The recompute runs on the buffers and train/eval flags the forward had.
        once = replaying_forward_state(block, run)
        if mode == "selective":
            return checkpoint(once, *args, use_reentrant=False, preserve_rng_state=True,
                              context_fn=functools.partial(keeper.context, index), **kwargs)
        return checkpoint(once, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    # torch.compile: run as it is (a graph break), so that the calls above (the activation
    # keeper's, the pager's) run at every forward pass, not once when traced.
    block.forward = torch.compiler.disable(forward)


def offload(model, gpu_budget=None, host_budget=None, nvme=None, nvme_budget=0, dtype=None,
            device=None, backend="auto", slot_budget=0, resident_blocks=None,
            state_placement=None, data_parallel=None, weights=None, grads="host"):
    """Stream `model`'s blocks through Strata; returns the model, changed in place.

    gpu_budget: HBM bytes for the executor's slots (None: a few blocks). host_budget: pinned
    DRAM bytes (None: what the blocks, grads and optimizer state need; with nvme, that or 85% of
    the available memory, whichever is less). nvme: an NVMe tier, a path or a list of paths
    (files, striped): the optimizer state that host_budget cannot hold goes there, the last
    blocks' first, staged through DRAM for each update; when host_budget cannot even hold every
    streamed weight beside the grads and staging, the last blocks' weights go there too
    (streamed from NVMe, written back by their updates). nvme_budget: its bytes (None or 0:
    what the spilled tensors need). state_placement (with nvme): "planned" (default: DRAM
    first, the rest on NVMe) or "nvme" (all of the streamed blocks' optimizer state on NVMe,
    leaving DRAM to the weights and grads). slot_budget: HBM for streaming slots
    within gpu_budget (0: all of it). dtype: the compute dtype of the streamed weights (None:
    the model's). device: where to compute (None: cuda if available, else cpu with Strata's
    host backend). resident_blocks: how many of the first blocks stay in HBM as plain PyTorch
    modules with checkpointing, trained by torch's AdamW on the device (None: as many as 40% of
    the device memory holds that is free once the rest of the model and its state are there,
    0 on the CPU; the batch's activations and logits are not known here: pass a smaller
    number, or 0, when the first step runs out of memory).
    data_parallel: None (data parallel over torch.distributed's default group when it is
    initialized with several ranks), False (never), or a strata.torch.DataParallel
    (strata.torch.distributed). weights: a safetensors checkpoint (a file, or a Hugging Face
    directory with model.safetensors or its sharded index) every parameter's values come from,
    for a model best built on the meta device: the streamed blocks' go from the file into
    Strata's pinned arena, the rest onto the device (strata.torch.weights); a checkpoint that
    lacks a parameter or has another shape is refused before anything changes.
    grads: where the streamed blocks' grads live between the backward pass and the step,
    "host" (pinned DRAM) or "device" (the GPU's memory, beside gpu_budget: 2 bytes per bf16
    parameter of DRAM less, 12 instead of 14, and as many more of HBM; the optimizer copies
    each block's grads to the CPU when it reads them: for their sums of squares as they land,
    and for the update). The training is bit for bit the same. With nvme=, DRAM then holds no
    grads either: down to the staging and one block's grads to read them through. Not yet
    under data parallelism.
    On CUDA without data parallelism, torch's caching allocator grows expandable segments from
    here on unless the process configured it (PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF
    non-empty: `expandable_segments:False` keeps the default; strata.torch.allocator says why,
    and what expandable segments do not support).
    A failed call leaves the model as it was and releases what it allocated."""
    if getattr(model, "strata", None) is not None:
        raise RuntimeError("strata.torch.offload: this model is already offloaded "
                           "(model.strata exists); offload a model once")
    if grads not in ("host", "device"):
        raise ValueError("strata.torch.offload: grads is %r, not 'host' or 'device'" % (grads,))
    grads_home = "dram" if grads == "host" else "hbm"
    if isinstance(nvme, (str, bytes, os.PathLike)):
        nvme = [nvme]  # one path, not its characters
    nvme = list(nvme) if nvme else []
    nvme_budget = nvme_budget or 0  # None, as documented, is 0 (examples/train.py passes it)
    if nvme_budget and not nvme:
        raise ValueError("strata.torch.offload: nvme_budget=%d without nvme= (the NVMe tier's "
                         "file paths)" % nvme_budget)
    if state_placement not in (None, "planned", "nvme"):
        raise ValueError("strata.torch.offload: state_placement is %r, not 'planned' or 'nvme'"
                         % (state_placement,))
    if state_placement is not None and not nvme:
        raise ValueError("strata.torch.offload: state_placement=%r needs nvme= (the NVMe "
                         "tier's file paths)" % state_placement)
    source = None
    if weights is not None:
        from .weights import SafetensorsWeights, check_covers, names_by_tensor
        source = SafetensorsWeights(weights)
        try:
            check_covers(source, model)
        except BaseException:
            source.close()
            raise
        source = (source, names_by_tensor(model))
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if backend not in ("auto", "cuda", "host"):
        raise ValueError("strata.torch.offload: backend %r is not 'auto', 'cuda' or 'host'"
                         % (backend,))
    if backend == "auto":
        backend = "cuda" if device.type == "cuda" else "host"
    all_blocks = find_blocks(model)
    if source is not None and any(not p.is_meta for b in all_blocks for p in b.parameters()):
        # Their values would show (evaluation, state_dict) until the optimizer's build, and
        # then the file's would replace them and any edit made meanwhile.
        source[0].close()
        raise ValueError("strata.torch.offload: weights= gives the values of a model built on "
                         "the meta device (with torch.device('meta'): ...), and this model's "
                         "blocks hold values already; build it on meta, or load the file "
                         "with model.load_state_dict; nothing was changed")
    _refuse_shared_blocks(all_blocks)
    if dtype is None:
        dtype = next(all_blocks.parameters()).dtype
    if dtype not in DTYPE_NAMES:
        raise ValueError("strata.torch.offload: dtype %s is not float32, bfloat16 or float16"
                         % dtype)
    from .distributed import resolve
    mesh = resolve(data_parallel, device)  # collective under data parallelism
    if source is not None and mesh is not None:
        source[0].close()
        raise NotImplementedError(
            "strata.torch.offload: weights= under data parallelism is not supported yet (each "
            "rank would read its own shards from the file); load the model on each rank, or "
            "train without data_parallel")
    if grads_home == "hbm" and mesh is not None:
        # A sharded session reduces the grads into DRAM shards: not from the device yet.
        raise NotImplementedError(
            "strata.torch.offload: grads='device' under data parallelism is not supported "
            "yet; use grads='host'")
    if resident_blocks is None:
        resident_blocks = _auto_resident_blocks(model, list(all_blocks), dtype, device,
                                                gpu_budget, grads_home)
    if mesh is not None:  # every rank must stream the same blocks: the fewest any rank keeps
        resident_blocks = min(mesh.gather_objects(resident_blocks))
    if not 0 <= resident_blocks < len(all_blocks):
        raise ValueError("strata.torch.offload: resident_blocks is %d; the model has %d blocks "
                         "and at least one must stream" % (resident_blocks, len(all_blocks)))
    kept = list(all_blocks)[:resident_blocks]
    blocks = list(all_blocks)[resident_blocks:]
    try:
        _refuse_shared_outside(model, blocks)
    except ValueError:
        if source is not None:
            source[0].close()
        raise
    if nvme and mesh is not None:
        # Each rank would need NVMe files of its own, and the state's placement is planned per
        # runtime from what one process holds: not built yet.
        raise NotImplementedError(
            "strata.torch.offload: nvme= under data parallelism is not supported yet; each "
            "rank keeps 1/(ranks per host) of the training state in DRAM: size host_budget "
            "for that, or train without data_parallel")
    layers = None  # with nvme: per block, the sizes the placement weighs
    if nvme:
        # Training state may spill to NVMe: the placement (strata_placement_*) chooses, from
        # the budgets and the rates measured on the runtime, which blocks' state and weights go
        # there, fastest predicted step first (docs/optimizer.md, "State on NVMe"). Here it
        # only checks, with no rates, that some placement fits: nothing is created otherwise.
        from .. import core
        element = torch.finfo(dtype).bits // 8
        counts = [[p.numel() for p in b.parameters() if p.requires_grad] for b in blocks]
        frozen = [[p.numel() for p in b.parameters() if not p.requires_grad] for b in blocks]
        layers = core.placement_layers(counts, element, frozen,
                                       "nvme" if state_placement == "nvme" else "choose",
                                       master_layout=master_layout(dtype), grads=grads_home)
        for i, layer in enumerate(layers):
            layer["name"] = "blocks.%d" % i
        # Grads on the device: the placement counts the DRAM buffer they are read through.
        if host_budget is None:
            available = _mem_available()
            host_budget = core.full_dram(layers)
            if available is not None:
                host_budget = min(host_budget, int(available * 0.85))
        # The NVMe tier holds what the placement puts there, 5% more for its per-tensor
        # alignment and 64 MiB a block: the placement may use (budget - margin) / 1.05, the
        # same figure here (the check) and in session.place (the choice).
        margin = (64 << 20) * len(layers)
        if not nvme_budget:
            # Room for everything that could spill, at most what the disks have free: the
            # runtime preallocates its files.
            spillable = sum(l["weight_bytes"] + l["state_bytes"] for l in layers)
            nvme_budget = min(-(-spillable * 105 // 100) + margin, _disk_free(nvme))
        place_nvme = (nvme_budget - margin) * 100 // 105
        if place_nvme <= 0:
            raise ValueError("strata.torch.offload: nvme_budget %d bytes leaves no room for "
                             "training state after the tier's margins (64 MiB a block and 5%%); "
                             "nothing was changed" % nvme_budget)
        try:
            core.place(layers, dram_budget=host_budget, nvme_budget=place_nvme)
        except MemoryError as e:
            short = ("host_budget %d bytes is below what DRAM needs" % host_budget
                     if "DRAM needs" in str(e) else
                     "nvme_budget %d bytes is below what NVMe needs" % nvme_budget)
            raise ValueError("strata.torch.offload: %s with training state and weights on NVMe "
                             "(%s); nothing was changed" % (short, e)) from None
    elif host_budget is not None and host_budget < (
            need := _estimate_dram(blocks, dtype, mesh, grads_home)):
        hint = ""
        if grads_home == "dram" and mesh is None:
            hint = ("; grads='device' needs %d (the grads on the GPU)"
                    % _estimate_dram(blocks, dtype, mesh, "hbm"))
        raise ValueError("strata.torch.offload: host_budget %d bytes is below the %d bytes the "
                         "streamed blocks need in pinned DRAM (their weights, %sfp32 masters "
                         "and AdamW moments, 2%% for page alignment, and a fixed 256 MiB of "
                         "headroom beyond them; or pass nvme= to put state on NVMe%s); nothing "
                         "was changed" % (host_budget, need,
                                          "grads, " if grads_home == "dram" else
                                          "one block's grads, ", hint))
    prefixes = {id(m): n + "." for n, m in model.named_modules(remove_duplicate=False)}
    names = [prefixes[id(b)] for b in blocks]  # each block's prefix in the model's names
    init = getattr(model, "_init_weights", None)
    args = (blocks, names, device, dtype, gpu_budget, host_budget, nvme, nvme_budget, backend,
            slot_budget, init)
    if mesh is None:
        session = StrataSession(*args, grads=grads_home)
    else:
        from .sharded import ShardedSession
        session = ShardedSession(mesh, *args)
    session.resident_blocks = kept
    session.weights_source = source
    session.kept_fp32 = []  # resident parameters with offload's fp32 values (_strata_fp32)
    if layers is not None:
        try:
            session.place(layers, host_budget, place_nvme, state_placement)
        except MemoryError as e:  # the choice with measured rates fits wherever the check did
            session.close()
            raise ValueError("strata.torch.offload: %s; nothing was changed" % e) from None
        except BaseException:
            session.close()
            raise
    # Expandable segments, unless the process configured the allocator (strata.torch.allocator:
    # the default allocator's fixed segments strand what the loss's transients leave behind);
    # not under data parallelism (NCCL's buffer registration needs the default).
    from .allocator import prefer_expandable_segments
    undo_allocator = prefer_expandable_segments(device) if mesh is None else None
    started = time.perf_counter()
    session.applying = False
    installed = []
    reads = None  # offload(weights=): the residents' tensors, read ahead
    moved = []  # (param or (module, buffer name), its data before): undone on failure
    try:
        session.anchor = torch.zeros(0, device=device, requires_grad=True)
        # Its grad accumulator: whether a backward pass will run it says whether that pass
        # accumulates into parameters (loss.backward()) or not (torch.autograd.grad).
        session.anchor_node = session.anchor.view_as(session.anchor).grad_fn.next_functions[0][0]
        for i, block in enumerate(blocks):
            for p in block.parameters():
                p._strata_session = session
            block.forward = streamed_forward(session, i, block.forward)
            installed.append(block)
            _install_state_hooks(session, i, block)
        from .activations import ActivationKeeper
        session.activations = ActivationKeeper(device, kept)
        for index, block in enumerate(kept):
            _keep_resident(session, index, block)
            installed.append(block)
        streamed = {id(p): p for b in blocks for p in b.parameters()}
        for m in model.modules():
            inside = [p for p in m.parameters() if id(p) in streamed]
            if inside:
                _guard_apply(session, m, inside)
                installed.append(m)
        # Everything else is resident on the device, in the compute dtype (buffers keep theirs);
        # the blocks are registered with the runtime later (StrataSession.build).
        in_blocks = {id(m) for b in blocks for m in b.modules()}
        rest = [m for m in model.modules() if id(m) not in in_blocks]
        if source is not None:  # the next module's tensors are read while this one is copied
            from .weights import Prefetcher, load_module
            reads = Prefetcher(*source, [list(m.parameters(recurse=False)) for m in rest])
        for m in rest:
            for p in m.parameters(recurse=False):
                moved.append((p, p.data))
            for name, b in m.named_buffers(recurse=False):
                moved.append(((m, name), b))
            if source is None:
                materialize(m, device, init, recurse=False)
            else:
                load_module(m, device, *source, values=reads.next())
            for p in m.parameters(recurse=False):
                if p.dtype == torch.float32 and dtype != torch.float32:
                    # Its fp32 master (strata.torch.AdamW) starts from these values, unless
                    # the parameter is written before the optimizer exists (a load: its
                    # version moves) and the master starts from what was written.
                    p._strata_fp32 = p.data
                p.data = p.data.to(device, dtype)
                if "_strata_fp32" in p.__dict__:
                    p._strata_fp32_version = p._version
                    session.kept_fp32.append(p)
            rebuild_meta_buffers(m, device)
            for name, b in list(m.named_buffers(recurse=False)):
                m._buffers[name] = b.to(device)
        if reads is not None:
            reads.close()
    except BaseException:
        if reads is not None:
            reads.close()
        for target, data in reversed(moved):
            if isinstance(target, tuple):
                target[0]._buffers[target[1]] = data
            elif not data.is_meta or target.is_meta:
                target.data = data
            if not isinstance(target, tuple):
                target.__dict__.pop("_strata_fp32", None)
                target.__dict__.pop("_strata_fp32_version", None)
        for block in installed:
            for attr in ("forward", "_apply"):
                block.__dict__.pop(attr, None)
            for p in block.parameters():
                p.__dict__.pop("_strata_session", None)
        session.close()
        if undo_allocator is not None:
            undo_allocator()
        raise
    session.timed("residents", started)  # the model outside the streamed blocks, on the device
    if mesh is not None:  # replicated on every rank, their grads averaged after backward
        session.residents = [p for p in model.parameters() if id(p) not in streamed]
    model.strata = session
    # A load between a forward pass and its backward is refused by the streamed blocks'
    # hooks; checked here first, before the modules loaded ahead of them (the embedding) are
    # written.
    around = _around(model, blocks)
    loads, fp32_loads = _LoadsBetweenSteps(session), _ResidentFp32Loads()
    for _, m in around:  # the model, the modules down to the blocks, the blocks
        m.register_load_state_dict_pre_hook(loads)
    kept_fp32 = {id(p) for p in session.kept_fp32}
    for m in model.modules() if kept_fp32 else ():  # where a load of a kept one can start
        if any(id(p) in kept_fp32 for p in m.parameters()):
            m.register_load_state_dict_pre_hook(fp32_loads.pre)
            m.register_load_state_dict_post_hook(fp32_loads.post)
    before_build = _LoadsBeforeBuild(session)
    for block in blocks:
        for m in block.modules():
            m.register_load_state_dict_pre_hook(before_build)
    model.register_forward_pre_hook(_ModelForwardBegins(session, around))
    if kept:
        _note_memory_errors(model, session)
    return model


class _LoadsBetweenSteps:
    """The model's load_state_dict pre-hook (an object, not a closure: copying or pickling the
    model reaches the session's own refusal, which says why)."""

    def __init__(self, session):
        self.session = session

    def __call__(self, module, state_dict, prefix, local_metadata, *args):
        if self.session.in_step:
            raise RuntimeError("strata.torch: weights can be loaded between steps only (a "
                               "forward pass with grad waits for its backward); nothing was "
                               "loaded")
        _refuse_assign(local_metadata)


def _around(model, blocks):
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


class _ModelForwardBegins:
    """The model's forward pre-hook, with grad in training mode: Hugging Face gradient
    checkpointing with use_reentrant=True around a streamed block fails in its backward pass
    with torch's own message (reentrant checkpointing is incompatible with .grad(), which a
    streamed block's backward uses): refused first, naming the fix. Then the session's
    on_forward_begin callbacks, with None (strata.torch.paging times the forward pass).
    `around`: _around's modules, the only ones looked at (the hook runs at every training
    forward pass; checkpointing elsewhere does not wrap a streamed block)."""

    def __init__(self, session, around):
        self.session = session
        self.around = around

    @torch.compiler.disable  # torch.compile: the callbacks run at every forward pass
    def __call__(self, module, *args):
        if not torch.is_grad_enabled() or not module.training:
            return
        for name, m in self.around:
            run = getattr(m, "_gradient_checkpointing_func", None)
            if getattr(m, "gradient_checkpointing", False) is True and \
                    getattr(run, "keywords", {}).get("use_reentrant") is True:
                raise NotImplementedError(
                    "strata.torch: gradient checkpointing with use_reentrant=True is on for "
                    "%s, around streamed blocks; streamed blocks recompute their forward in the "
                    "backward pass already and need none, and the reentrant variant cannot run "
                    "around them: call model.gradient_checkpointing_disable(), or enable it "
                    "with gradient_checkpointing_kwargs={'use_reentrant': False}"
                    % (name or "the model"))
        for call in self.session.on_forward_begin:
            call(None)


def _note_memory_errors(model, session):
    """Out-of-memory errors raised by the model's forward pass (logits, resident blocks) get
    the same note as the streamed blocks' (strata.torch.block.note_memory)."""
    from .block import note_memory
    run = model.forward

    def forward(*args, **kwargs):
        try:
            return run(*args, **kwargs)
        except BaseException as e:
            note_memory(session, e)
            raise

    model.forward = forward


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
        rebuild_meta_buffers(m, device)
