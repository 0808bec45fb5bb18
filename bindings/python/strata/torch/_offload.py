"""strata.torch.offload: stream a model's repeated blocks through Strata. The model stays the
same nn.Module with the same parameters and names; each block's forward is replaced by one
that streams it (strata.torch._block), and its state_dict / load_state_dict read and write the
values in Strata (strata.torch._hooks).

offload() is a pipeline of stages: validate (strata.torch.offloading.request: the arguments,
the device, the blocks, the weights file, data parallelism), _plan below (resident blocks, the
host and NVMe budgets: nothing is created), _build below (the session, its runtime and with
NVMe the placement), then in strata.torch.offloading.install account_host_budget
(host_budget's account) and install (the allocator setting, the blocks' forwards and hooks,
resident blocks), move_residents (strata.torch.offloading.residents: the model outside the
streamed blocks onto the device) and attach (model.strata and the model's own hooks). Each
stage that changes something records how to undo it on a Rollback
(strata.torch.offloading.rollback); when a later stage fails, everything done is undone in
reverse order, so a failed call leaves the model as it was and releases what it allocated.
Under data parallelism every rank runs the stages together: what can fail on one rank alone
(the arguments' checks, agreed once the process groups exist; the resident blocks' sizing, the
blocks' and the device memory's checks, the host budget's check, the runtime, the disk's
measurement, the placement, the install and the move) ends in an EveryRank
(strata.torch._agreement), so that a failure on any rank stops every rank at once, each
undoing what it did, and names the rank and its error."""

import dataclasses
import functools
import time

import torch

from . import _distributed, _planning, _surgery
from ._agreement import EveryRank
from .layout.sharded import ShardedLayout
from .offloading.install import account_host_budget, attach, install
from .offloading.request import GRAD_HOME_TEXT, check_chunked_loss, fallback_device, validate
from .offloading.residents import move_residents
from .offloading.rollback import Rollback
from .session.runtime import SessionChoices
from .session.session import StrataSession


@dataclasses.dataclass
class _Plan:
    """What _plan decided: which blocks stay resident and which stream, and the budgets."""
    kept: list  # the resident blocks
    blocks: list  # the streamed blocks
    host_budget: int  # the runtime's DRAM arena's (of a given host_budget: its share)
    nvme_budget: int
    layers: list = None  # with nvme: per block, the sizes the placement weighs
    place_nvme: int = 0  # with nvme: what the placement may put there


def _outside_no_grad(function):
    """`function` run with grad and outside inference mode whatever the caller's: a user's
    setup code under torch.no_grad() or torch.inference_mode() (weight surgery, a loader)
    would otherwise give the session's tensors no graph (its anchor found no grad_fn) or make
    them inference tensors that training cannot use."""
    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        with torch.inference_mode(False), torch.enable_grad():
            return function(*args, **kwargs)
    return wrapped


@_outside_no_grad
def offload(model, gpu_budget=None, host_budget=None, nvme=None, nvme_budget=0, dtype=None,
            device=None, backend="auto", slot_budget=0, resident_blocks=None,
            state_placement=None, data_parallel=None, weights=None, grads="host",
            chunked_loss=None, spill_checkpoints=None, grad_dtype=None, mlp_tiles=None):
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
    mlp_tiles: the sequence tiles each block's MLP (its child module `mlp`) runs over, saving
    only its input and recomputing each tile in the backward pass, so that no intermediate of
    the whole batch exists at once (strata.torch._tiled_mlp): None (the library's step plan
    chooses on CUDA, from the batch run: the fewest with which the step fits, 1 where it fits
    whole; with spill_checkpoints=None, which makes that plan), or a count of at least 1, at
    most the batch's tokens (then at every step, the blocks that recompute; the same values,
    the weight grads summed over the tiles).
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
        loss_chunk_tokens = check_chunked_loss(model, chunked_loss)
        if spill_checkpoints is not None and spill_checkpoints is not True and \
                spill_checkpoints is not False:
            raise ValueError("strata.torch.offload: spill_checkpoints is %r, not None (when "
                             "the device is short), True or False" % (spill_checkpoints,))
        request = validate(model, gpu_budget, host_budget, nvme, nvme_budget, dtype, device,
                           backend, slot_budget, state_placement, parallel, weights, grads,
                           grad_dtype)
        request.loss_chunk_tokens = loss_chunk_tokens
        request.spill_checkpoints = spill_checkpoints
        if mlp_tiles is not None and (isinstance(mlp_tiles, bool) or
                                      not isinstance(mlp_tiles, int) or mlp_tiles < 1):
            raise ValueError("strata.torch.offload: mlp_tiles is %r, not None (the plan's) or "
                             "a count of at least 1" % (mlp_tiles,))
        request.mlp_tiles = mlp_tiles
    rollback = Rollback()
    if request is not None:
        rollback.push(request.close)
    try:
        mesh = None
        if parallel is not None:  # collective (a rank whose checks failed takes part too)
            mesh = _distributed.Mesh(parallel, request.device if request is not None
                                     else fallback_device(device))
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
            account_host_budget(session, request)
            install(model, session, request, plan, rollback)
            move_residents(model, session, request, plan, rollback)
    except BaseException as e:
        rollback.run(e)
        raise
    session.timed("residents", started)  # the model outside the streamed blocks, on the device
    attach(model, session, plan, request)
    return model


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
                         "same" % ", ".join("rank %d: %s" % (r, GRAD_HOME_TEXT[home])
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
        spill_checkpoints=request.spill_checkpoints, mlp_tiles=request.mlp_tiles)
    layout = None
    if request.mesh is not None:
        # Everything outside the streamed blocks is replicated on every rank, its grads averaged
        # after backward (the same parameter objects once move_residents gave them storage).
        streamed = {id(p) for b in plan.blocks for p in b.parameters()}
        layout = ShardedLayout(request.mesh,
                               [p for p in model.parameters() if id(p) not in streamed])
    session = StrataSession(choices, layout)
    rollback.push(session.close)
    if plan.layers is not None:
        try:
            session.placer.place(plan.layers, plan.host_budget, plan.place_nvme,
                                 request.state_placement)
        except MemoryError as e:  # the choice with measured rates fits wherever the check did
            error = ValueError("strata.torch.offload: %s; nothing was changed" % e)
            for note in getattr(e, "__notes__", ()):  # the ranks that failed alike (EveryRank)
                error.add_note(note)
            raise error from None
    return session
