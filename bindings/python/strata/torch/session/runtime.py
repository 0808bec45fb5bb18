"""What offload() chose for a session (SessionChoices) and the session's Strata runtime made
from it (the budgets under data parallelism, the arena's pinned part, the device ordinal), with
the parts made beside it on this rank."""

import dataclasses
import weakref

import torch

from ... import core
from .. import _host, _planning
from ..activations.keeper import ActivationKeeper
from .._agreement import EveryRank
from .._spill import Spiller


@dataclasses.dataclass
class SessionChoices:
    """What offload() chose for the session it builds (strata.torch._offload's _build)."""
    blocks: list  # the streamed blocks, in order
    prefixes: list  # per block: its name in the model ("model.layers.3.")
    device: torch.device
    dtype: torch.dtype  # the compute dtype of the streamed weights
    backend: str  # the runtime's device backend: "cuda" or "host"
    gpu_budget: int  # HBM for the executor's slots (None: what the blocks need)
    host_budget: int  # pinned DRAM (None: what the blocks, grads and state need)
    nvme: list  # the NVMe tier's files (none: no tier)
    nvme_budget: int
    slot_budget: int = 0
    # Where the streamed blocks' grads live: "dram", "hbm" (the optimizer reads them through
    # one block's DRAM buffer: 2 bytes per bf16 parameter of DRAM less) or "hbm_sums" (fp32 in
    # HBM, each backward pass's grad added in place: no accumulators; _planning.GRAD_HOMES).
    grads_home: str = "dram"
    init: object = None  # the model's _init_weights(module), for blocks built on meta
    resident_blocks: list = dataclasses.field(default_factory=list)  # kept in HBM, in order
    weights_source: tuple = None  # offload(weights=): (SafetensorsWeights, names by tensor)
    # offload(spill_checkpoints=): None (when the device is short), True (always), False (never).
    spill_checkpoints: bool = None
    # offload(mlp_tiles=): the blocks' MLP over this many sequence tiles (None: the plan's).
    mlp_tiles: int = None


def open_runtime(session, choices):
    """What the session makes that can fail on this rank alone (its device, its runtime's
    memory): the activation keeper, the spiller, the anchor (StrataSession.__init__ says what
    each is for), the runtime, and the layout attached to them. Under data parallelism every
    rank learns of a failure here, instead of waiting for DataParallel's timeout in the next
    collective (EveryRank); another rank's failure closes this rank's runtime again."""
    try:
        with EveryRank(session.mesh, "creating the session's Strata runtime"):
            session.activations = ActivationKeeper(session.device, session.resident_blocks,
                                                   session.blocks)
            session.passes.note_memory_timeline()
            session.spill = Spiller(session.device, choices.spill_checkpoints,
                                    session.activations,
                                    len(session.resident_blocks) + len(session.blocks),
                                    regenerate=session.mesh is None)
            session.spill.forced_tiles = choices.mlp_tiles
            session.spill.session = weakref.ref(session)  # (its optimizer state's figures)
            session.anchor = torch.zeros(0, device=session.device, requires_grad=True)
            session.anchor_node = \
                session.anchor.view_as(session.anchor).grad_fn.next_functions[0][0]
            session.runtime = _runtime(session, choices)
            session.layout.attach(session)  # (its side streams: this rank's device too)
    except BaseException:
        if session.runtime is not None:
            session.runtime.close()
        raise


def _runtime(session, choices):
    """The session's runtime: the HBM and DRAM budgets for its streamed blocks (the layout's
    shares under data parallelism), computing on the model's GPU (cuda:1 is ordinal 1), not
    always the first."""
    gpu_budget, host_budget = _planning.session_budgets(
        session.layout.block_counts(session.blocks), session.dtype, session.grads_home,
        choices.gpu_budget, choices.host_budget, session.mesh,
        _planning.replica_bytes(session.blocks, session.dtype, session.mesh))
    # Only what the GPU's copies touch of the arena is pinned (the library sizes it,
    # strata_layout_totals_t.dram_gpu_bytes): the state stays unpinned.
    pinned = _planning.pinned_dram(session.blocks, session.dtype, session.grads_home,
                                   host_budget, session.mesh)
    return core.Runtime(backend=choices.backend, hbm_budget=gpu_budget,
                        dram_budget=host_budget, nvme=choices.nvme,
                        nvme_budget=choices.nvme_budget,
                        device=(session.device.index or 0) if session.cuda else 0,
                        dram_fault_threads=_host.fault_threads(session.mesh),
                        dram_pinned=pinned)
