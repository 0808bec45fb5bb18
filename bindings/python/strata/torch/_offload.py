"""strata.torch.offload: stream a model's repeated blocks through Strata. The model stays the
same nn.Module with the same parameters and names; each block's forward is replaced by one
that streams it (strata.torch._block), and its state_dict / load_state_dict read and write the
values in Strata (strata.torch._hooks).

offload() is a pipeline of stages, each a function below: _validate (the arguments, the
device, the blocks, the weights file, data parallelism), _plan (resident blocks, the host and
NVMe budgets: nothing is created), _build (the session, its runtime and with NVMe the
placement), _host_budget (host_budget's account), _install (the allocator setting, the blocks'
forwards and hooks, resident blocks), _move_residents (the model outside the streamed blocks
onto the device) and _attach (model.strata and the model's own hooks). Each stage that
changes something records how to undo it on a _Rollback; when a later stage fails, everything
done is undone in reverse order, so a failed call leaves the model as it was and releases what
it allocated. Under data parallelism every rank runs the stages together: what can fail on one
rank alone (the arguments' checks, agreed once the process groups exist; the resident blocks'
sizing, the blocks' and the device memory's checks, the host budget's check, the runtime, the
disk's measurement, the placement, the install and the move) ends in an EveryRank
(strata.torch._agreement), so that a failure on any rank stops every rank at once, each undoing
what it did, and names the rank and its error."""

import dataclasses
import functools
import os
import time
import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from . import (_allocator, _chunked_loss, _distributed, _foreign, _hooks, _params, _planning,
               _surgery, _weights)
from ._block import streamed_forward
from ._layout import ShardedLayout
from ._replay import replaying_forward_state, without_caches
from ._agreement import EveryRank
from ._session import SessionChoices, StrataSession


class _Rollback:
    """What the stages did, as functions that undo it, run in reverse order on failure."""

    def __init__(self):
        self._undo = []

    def push(self, undo):
        self._undo.append(undo)

    def run(self, error):
        """Undo everything, last first, for `error` (the failure that stops offload, which is
        the one raised): an undo that fails too does not stop the others; it is noted on
        `error`."""
        while self._undo:
            undo = self._undo.pop()
            try:
                undo()
            except Exception as e:  # noqa: BLE001 (every undo runs; the first error is raised)
                error.add_note("strata.torch.offload: undoing %r failed too: %r" % (undo, e))


@dataclasses.dataclass
class _Request:
    """offload()'s arguments, checked and resolved (_validate)."""
    all_blocks: list  # every repeated block, resident ones first
    device: torch.device
    dtype: torch.dtype
    backend: str
    grads_home: str  # "dram", "hbm" or "hbm_sums" (strata.torch._planning.GRAD_HOMES)
    nvme: list
    nvme_budget: int
    state_placement: str
    gpu_budget: int
    host_budget: int
    slot_budget: int
    mesh: object  # strata.torch._distributed.Mesh, or None
    source: tuple  # offload(weights=): (SafetensorsWeights, names by tensor), or None
    # The chunked loss (strata.torch._chunked_loss): None (off), or the tokens per chunk
    # (0: its default for the vocabulary).
    loss_chunk_tokens: int = None
    spill_checkpoints: bool = None  # None (when the device is short), True or False

    def close(self):
        if self.source is not None:
            self.source[0].close()


@dataclasses.dataclass
class _Plan:
    """What _plan decided: which blocks stay resident and which stream, and the budgets."""
    kept: list  # the resident blocks
    blocks: list  # the streamed blocks
    host_budget: int  # the runtime's DRAM arena's (of a given host_budget: its share)
    nvme_budget: int
    layers: list = None  # with nvme: per block, the sizes the placement weighs
    place_nvme: int = 0  # with nvme: what the placement may put there


def offload(model, gpu_budget=None, host_budget=None, nvme=None, nvme_budget=0, dtype=None,
            device=None, backend="auto", slot_budget=0, resident_blocks=None,
            state_placement=None, data_parallel=None, weights=None, grads="host",
            chunked_loss=None, spill_checkpoints=None, grad_dtype=None):
    """Stream `model`'s blocks through Strata; returns the model, changed in place.

    gpu_budget: HBM bytes for the executor's slots (None: a few blocks). host_budget: the host
    memory the run may pin or allocate: the runtime's pinned DRAM arena (the blocks, grads,
    optimizer state, staging, gradient accumulators: at most what they need) and what it
    leaves to the resident parameters' paged optimizer state and the spilled checkpoints
    (model.strata.host_budget: _planning.HostBudget). None: the arena what the blocks, grads
    and optimizer state need (with nvme, that or 85% of the available memory, whichever is
    less), and beside it half the host memory then available (under data parallelism half of
    the rank's share: divided by the ranks of the host). nvme: an NVMe tier, a path or
    a list of paths (files, striped): the optimizer state that host_budget cannot hold goes there, the last
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
    (strata.torch._distributed); every rank calls offload alike, and a failure on one rank
    stops every rank (the others with a DataParallelError naming it). With nvme= under data
    parallelism each rank's tier is its own files, `<path>.rank<r>` for each path (r its rank
    in the group); the ranks must agree on nvme= and its options; host_budget and
    nvme_budget, given, are each rank's, and by default its share of the host, the smallest
    of the ranks' shares taken by all; one rank of those sharing a host's disks measures them
    for the others (each counting its share of the rates), and every rank adopts the placement
    of the rank whose rates predict the slowest step. weights: a safetensors checkpoint (a
    file, or a Hugging Face directory with model.safetensors or its sharded index) every
    parameter's values come from, for a model best built on the meta device: the streamed
    blocks' go from the file into Strata's pinned arena, the rest onto the device
    (strata.torch._weights); a checkpoint that lacks a parameter or has another shape is
    refused before anything changes.
    grads: where the streamed blocks' grads live between the backward pass and the step,
    "host" (pinned DRAM) or "device" (the GPU's memory, beside gpu_budget: 2 bytes per bf16
    parameter of DRAM less, 12 instead of 14, and as many more of HBM; the optimizer copies
    each block's grads to the CPU when it reads them: for their sums of squares as they land,
    and for the update). The training is bit for bit the same. With nvme=, DRAM then holds no
    grads either: down to the staging and one block's grads to read them through.
    grad_dtype (with grads="device"): the dtype of the grads on the device. The compute dtype
    (the default on one GPU): accumulating micro-batches sums them in fp32 accumulators in
    host memory (4 bytes per parameter of DRAM, or NVMe). torch.float32 (the default under
    data parallelism): the grads on the device are the fp32 sums themselves, each backward
    pass's grad added into them in place, so accumulating needs no host memory at all (DRAM
    12 bytes per bf16 parameter with or without accumulation, for 4 bytes per parameter of
    HBM, of this rank's shard under data parallelism, reserved whether or not the run
    accumulates); offload refuses it up front when the device has not that much free. The
    training is bit for bit grads="host"'s either way.
    spill_checkpoints: whether the blocks' checkpoints (each block's input, kept for its
    backward pass) go to pinned host memory, copied out and back overlapped with compute and
    bit-exact (strata.torch._spill): None (on CUDA when the step predicted from the batch run
    does not fit in device memory, the first blocks'), True (every block's, every step; on
    the CPU into ordinary host tensors), False (never).
    On CUDA without data parallelism, torch's caching allocator grows expandable segments from
    here on unless the process configured it (PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF
    non-empty: `expandable_segments:False` keeps the default; strata.torch._allocator says why,
    and what expandable segments do not support).
    A failed call leaves the model as it was and releases what it allocated."""
    parallel = _distributed.resolve(data_parallel)  # DataParallel options, or None
    # The arguments' checks: under data parallelism every rank learns whether they passed on
    # every rank once its process groups exist (made next, by every rank), and all raise
    # there; a rank refusing its arguments alone left the others waiting in those groups'
    # creation until the timeout.
    checking = EveryRank.deferred("checking strata.torch.offload's arguments")
    request = None
    with checking:
        if getattr(model, "strata", None) is not None:
            raise RuntimeError("strata.torch.offload: this model is already offloaded "
                               "(model.strata exists); offload a model once")
        loss_chunk_tokens = _check_chunked_loss(model, chunked_loss)
        if spill_checkpoints is not None and spill_checkpoints is not True and \
                spill_checkpoints is not False:
            raise ValueError("strata.torch.offload: spill_checkpoints is %r, not None (when "
                             "the device is short), True or False" % (spill_checkpoints,))
        request = _validate(model, gpu_budget, host_budget, nvme, nvme_budget, dtype, device,
                            backend, slot_budget, state_placement, parallel, weights, grads,
                            grad_dtype)
        request.loss_chunk_tokens = loss_chunk_tokens
        request.spill_checkpoints = spill_checkpoints
    rollback = _Rollback()
    if request is not None:
        rollback.push(request.close)
    try:
        mesh = None
        if parallel is not None:  # collective (a rank whose checks failed takes part too)
            mesh = _distributed.Mesh(parallel, request.device if request is not None
                                     else _fallback_device(device))
        checking.agree(mesh)
        request.mesh = mesh
        plan = _plan(model, request, resident_blocks)
        session = _build(model, request, plan, rollback)
        started = time.perf_counter()
        # The rest is this rank's own work until the optimizer's build: under data parallelism
        # a failure on one rank (its device's memory) stops every rank here, each undoing
        # what it did, instead of the others waiting at the build's first collective.
        with EveryRank(request.mesh, "installing the streamed blocks and moving the rest of "
                                     "the model to the device"):
            _host_budget(session, request)
            _install(model, session, request, plan, rollback)
            _move_residents(model, session, request, plan, rollback)
    except BaseException as e:
        rollback.run(e)
        raise
    session.timed("residents", started)  # the model outside the streamed blocks, on the device
    _attach(model, session, plan, request)
    return model


def _device(device):
    """offload(device=) resolved: a torch.device, cuda with its ordinal."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _fallback_device(device):
    """The device a rank whose arguments were refused makes its process groups for (it takes
    part in their creation, then raises with the others): device= where it is one, else the
    default."""
    try:
        return _device(device)
    except Exception:  # noqa: BLE001 (the refusal is raised once every rank knows of it)
        return _device(None)


def _check_chunked_loss(model, chunked_loss):
    """offload(chunked_loss=) resolved before anything changes: None (off) or the tokens per
    chunk (0: the default for the model's vocabulary). Refuses True or a count for a model the
    chunked loss does not support; warns when the default falls back to the model's own loss on
    a model with an output head (whose loss would then hold the whole logits)."""
    if chunked_loss is False:
        return None
    if chunked_loss is not None and chunked_loss is not True:
        if not isinstance(chunked_loss, int):  # (True and False are handled above)
            raise ValueError("strata.torch.offload: chunked_loss is %r, not None, True, False "
                             "or a number of tokens per chunk" % (chunked_loss,))
        _chunked_loss.check_chunk_tokens(chunked_loss)
    if _chunked_loss.installed(model) is not None:  # the user's own install stays
        return None
    reason = _chunked_loss.unsupported_reason(model)
    if reason is None:
        return 0 if chunked_loss in (None, True) else chunked_loss
    if chunked_loss is not None:
        raise ValueError("strata.torch.offload: chunked_loss=%r: %s; nothing was changed"
                         % (chunked_loss, reason))
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if isinstance(head, torch.nn.Module):
        warnings.warn("strata.torch.offload: the loss is the model's own (the chunked loss "
                      "does not support it: %s): with labels it computes the whole logits; "
                      "pass chunked_loss=False to say so" % reason, stacklevel=3)
    return None


# The dtypes grads on the device may have: the compute dtype, or fp32 (the sums, in place).
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _validate(model, gpu_budget, host_budget, nvme, nvme_budget, dtype, device, backend,
              slot_budget, state_placement, parallel, weights, grads, grad_dtype=None):
    """The arguments checked and resolved; the weights file opened (closed again if a check
    after it fails). Nothing of the model changes, and nothing is collective: `parallel` is
    the DataParallel options or None, and the request's mesh comes after (offload)."""
    if grads not in ("host", "device"):
        raise ValueError("strata.torch.offload: grads is %r, not 'host' or 'device'" % (grads,))
    if grad_dtype is not None:
        if grads != "device":
            raise ValueError("strata.torch.offload: grad_dtype=%s is for grads='device' (the "
                             "grads on the GPU); grads='host' keeps them in the compute dtype "
                             "in host memory, summed in fp32 when micro-batches accumulate"
                             % (grad_dtype,))
        if grad_dtype not in _GRAD_DTYPES:
            raise ValueError("strata.torch.offload: grad_dtype is %r, not torch.float32 (the "
                             "grads' fp32 sums on the device) or the compute dtype (bfloat16 or "
                             "float16)" % (grad_dtype,))
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
        source = _weights.SafetensorsWeights(weights)
        try:
            _weights.check_covers(source, model)
        except BaseException:
            source.close()
            raise
        source = (source, _weights.names_by_tensor(model))
    try:
        return _validate_model(model, gpu_budget, host_budget, nvme, nvme_budget, dtype,
                               device, backend, slot_budget, state_placement, parallel,
                               (grads, grad_dtype), source)
    except BaseException:
        if source is not None:
            source[0].close()
        raise


def _validate_model(model, gpu_budget, host_budget, nvme, nvme_budget, dtype, device, backend,
                    slot_budget, state_placement, parallel, grads, source):
    device = _device(device)
    if backend not in ("auto", "cuda", "host"):
        raise ValueError("strata.torch.offload: backend %r is not 'auto', 'cuda' or 'host'"
                         % (backend,))
    if backend == "auto":
        backend = "cuda" if device.type == "cuda" else "host"
    all_blocks = _surgery.find_blocks(model)
    if source is not None and any(not p.is_meta for b in all_blocks for p in b.parameters()):
        # Their values would show (evaluation, state_dict) until the optimizer's build, and
        # then the file's would replace them and any edit made meanwhile.
        raise ValueError("strata.torch.offload: weights= gives the values of a model built on "
                         "the meta device (with torch.device('meta'): ...), and this model's "
                         "blocks hold values already; build it on meta, or load the file "
                         "with model.load_state_dict; nothing was changed")
    _surgery.refuse_shared_blocks(all_blocks)
    if dtype is None:
        dtype = next(all_blocks.parameters()).dtype
    if dtype not in _planning.DTYPE_NAMES:
        raise ValueError("strata.torch.offload: dtype %s is not float32, bfloat16 or float16"
                         % dtype)
    if source is not None and parallel is not None:
        raise NotImplementedError(
            "strata.torch.offload: weights= under data parallelism is not supported yet (each "
            "rank would read its own shards from the file); load the model on each rank, or "
            "train without data_parallel")
    grads_home = _grads_home(*grads, dtype, parallel)
    return _Request(list(all_blocks), device, dtype, backend, grads_home, nvme, nvme_budget,
                    state_placement, gpu_budget, host_budget, slot_budget, None, source)


# How offload's arguments spell each grads home, for messages.
_GRAD_HOME_TEXT = {"dram": "grads='host'", "hbm": "grads='device' in the compute dtype",
                   "hbm_sums": "grads='device' as fp32 sums"}


def _grads_home(grads, grad_dtype, dtype, parallel):
    """Where the streamed grads live (strata.torch._planning.GRAD_HOMES) for offload's grads=
    and grad_dtype= (checked by _validate), the compute dtype known and data parallelism
    (`parallel`: its options, or None) resolved."""
    if grads == "host":
        return "dram"
    if grad_dtype is None:
        # Under data parallelism the sums on the device are the point of grads='device'
        # (a sharded 40B accumulating on one host); on one GPU the default is what it was.
        grad_dtype = torch.float32 if parallel is not None else dtype
    if grad_dtype == torch.float32:
        return "hbm_sums"  # an fp32 model's grads too: grad_dtype=torch.float32 asks for sums
    if grad_dtype != dtype:
        raise ValueError("strata.torch.offload: grad_dtype=%s with compute dtype %s: grads on "
                         "the device are kept in the compute dtype, or as torch.float32 sums "
                         "(added to in place)" % (grad_dtype, dtype))
    return "hbm"


def _plan(model, request, resident_blocks):
    """Which blocks stay resident (the given count, or _planning's choice; under data
    parallelism the fewest any rank keeps) and, with NVMe, whether a placement of the training
    state fits (else whether the host budget holds the streamed blocks); under data
    parallelism with NVMe, each rank's own files (request.nvme becomes them) and its share of
    the host's budgets. Creates nothing (a probe of each rank's files leaves none behind)."""
    all_blocks, mesh = request.all_blocks, request.mesh
    # Every rank must stream the same blocks: the fewest any rank keeps.
    with EveryRank(mesh, "choosing the resident blocks") as step:
        step.value = resident_blocks
        if resident_blocks is None:
            step.value = _planning._auto_resident_blocks(
                model, all_blocks, request.dtype, request.device, request.gpu_budget,
                request.grads_home, mesh)
    resident_blocks = min(step.every)
    plan = _Plan(all_blocks[:resident_blocks], all_blocks[resident_blocks:],
                 request.host_budget, request.nvme_budget)
    with EveryRank(mesh, "checking the streamed blocks and the device's memory") as step:
        step.value = request.grads_home
        if not 0 <= resident_blocks < len(all_blocks):
            raise ValueError("strata.torch.offload: resident_blocks is %d; the model has %d "
                             "blocks and at least one must stream"
                             % (resident_blocks, len(all_blocks)))
        _surgery.refuse_shared_outside(model, plan.blocks)
        _planning.check_device_memory(plan.blocks, request.dtype, mesh, request.grads_home,
                                      request.gpu_budget, request.device, request.backend)
    if len(set(step.every)) > 1:  # every rank raises alike
        raise ValueError("strata.torch.offload: the data-parallel ranks disagree about where "
                         "the grads live (grads= and grad_dtype=: %s); every rank must pass the "
                         "same" % ", ".join("rank %d: %s" % (r, _GRAD_HOME_TEXT[home])
                                            for r, home in enumerate(step.every)))
    if mesh is not None:
        # Every rank its own NVMe files, or none on every rank (collective: the ranks agree
        # about nvme= and its options, and each can create its files, or all raise).
        request.nvme = _distributed.rank_files(mesh, request.nvme, {
            "nvme_budget": request.nvme_budget, "host_budget": request.host_budget,
            "state_placement": request.state_placement})
    if request.nvme:
        plan.layers, plan.host_budget, plan.nvme_budget, plan.place_nvme = _planning.plan_nvme(
            plan.blocks, request.dtype, request.grads_home, request.state_placement,
            plan.host_budget, request.nvme, plan.nvme_budget, mesh)
    else:
        with EveryRank(mesh, "checking host_budget"):
            _planning.check_host_budget(plan.blocks, request.dtype, mesh, request.grads_home,
                                        plan.host_budget)
            plan.host_budget = _planning.arena_budget(plan.blocks, request.dtype, mesh,
                                                      request.grads_home, plan.host_budget)
    return plan


def _build(model, request, plan, rollback):
    """The session: its runtime with the planned budgets and, with NVMe, the placement of the
    training state chosen with the rates measured on it (closed again on a later failure)."""
    prefixes = {id(m): n + "." for n, m in model.named_modules(remove_duplicate=False)}
    choices = SessionChoices(
        blocks=plan.blocks, prefixes=[prefixes[id(b)] for b in plan.blocks],
        device=request.device, dtype=request.dtype, backend=request.backend,
        gpu_budget=request.gpu_budget, host_budget=plan.host_budget, nvme=request.nvme,
        nvme_budget=plan.nvme_budget, slot_budget=request.slot_budget,
        grads_home=request.grads_home, init=getattr(model, "_init_weights", None),
        resident_blocks=plan.kept, weights_source=request.source,
        spill_checkpoints=request.spill_checkpoints)
    layout = None
    if request.mesh is not None:
        # Everything outside the streamed blocks is replicated on every rank, its grads averaged
        # after backward (the same parameter objects once _move_residents gave them storage).
        streamed = {id(p) for b in plan.blocks for p in b.parameters()}
        layout = ShardedLayout(request.mesh,
                               [p for p in model.parameters() if id(p) not in streamed])
    session = StrataSession(choices, layout)
    rollback.push(session.close)
    if plan.layers is not None:
        try:
            session.place(plan.layers, plan.host_budget, plan.place_nvme,
                          request.state_placement)
        except MemoryError as e:  # the choice with measured rates fits wherever the check did
            error = ValueError("strata.torch.offload: %s; nothing was changed" % e)
            for note in getattr(e, "__notes__", ()):  # the ranks that failed alike (EveryRank)
                error.add_note(note)
            raise error from None
    return session


def _host_budget(session, request):
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


def _install(model, session, request, plan, rollback):
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
        _set_attribute(block, "forward", streamed_forward(session, i, block.forward), rollback)
        for handle in _hooks.install_state_hooks(session, i, block):
            rollback.push(handle.remove)
    for index, block in enumerate(plan.kept):
        _remember_attribute(block, "forward", rollback)
        _keep_resident(session, index, block, session.spill)
    streamed = {id(p) for b in plan.blocks for p in b.parameters()}
    for m in model.modules():
        inside = [p for p in m.parameters() if id(p) in streamed]
        if inside:
            _set_attribute(m, "_apply", _hooks.guard_apply(session, m, inside), rollback)


def _set_attribute(obj, name, value, rollback):
    """obj.name = value, undone on rollback."""
    _remember_attribute(obj, name, rollback)
    setattr(obj, name, value)


def _remember_attribute(obj, name, rollback):
    """On rollback, obj's instance attribute `name` becomes what it is now, or none again."""
    rollback.push(functools.partial(_reset_attribute, obj, name,
                                    obj.__dict__.get(name, _ABSENT)))


_ABSENT = object()


def _reset_attribute(obj, name, before):
    if before is _ABSENT:
        obj.__dict__.pop(name, None)
    else:
        obj.__dict__[name] = before


def _unmark_owner(block):
    for p in block.parameters():
        _params.set_owner(p, None)


def _move_residents(model, session, request, plan, rollback):
    """Everything outside the streamed blocks onto the device, in the compute dtype (buffers
    keep theirs): materialized with its init, or read from offload(weights=). A resident
    parameter narrowed from fp32 keeps its fp32 values for its master (session.kept_fp32). The
    streamed blocks are registered with the runtime later (StrataSession.build)."""
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
            _surgery.rebuild_meta_buffers(m, device)
            for name, b in list(m.named_buffers(recurse=False)):
                m._buffers[name] = b.to(device)
    finally:
        if reads is not None:
            reads.close()


def _restore_param(p, data):
    """A resident parameter's data before _move_residents (a meta one stays meta: .data cannot
    go back from a real tensor to the meta device, and nothing of it was used)."""
    if not data.is_meta or p.is_meta:
        p.data = data
    _params.drop_fp32(p)


def _restore_buffer(module, name, value):
    module._buffers[name] = value


def _attach(model, session, plan, request):
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


def _announcing_backward(session, index, output):
    """`output` of resident block `index`, its backward pass announced to the session's
    on_resident_backward_begin calls (strata.torch._paging brings optimizer state back as
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


def _keep_resident(session, index, block, spill=None):
    """A block kept in HBM runs as plain PyTorch with activation checkpointing (RNG-exact, as
    the streamed blocks recompute), so its activation memory is what a streamed block's is;
    unless the measured memory lets it keep its activations (strata.torch._activations), all
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
