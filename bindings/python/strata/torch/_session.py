"""StrataSession: one offloaded model's runtime, registered tensors, executor, optimizer and step
state. The blocks' parameters stay the model's own nn.Parameter objects (names, identity, hooks
and PEFT wrappers keep working); while a block is not being computed, each parameter's data is a
zero-stride view of one element with the parameter's real shape, dtype and device, so shapes,
numel() and grad assignment behave as in plain PyTorch and nothing is stored twice."""

import dataclasses
import json
import time

import torch

from .. import core
from ..core import BACKWARD, FORWARD, VIEW_WEIGHT
from . import _host, _params, _planning, _surgery
from ._activations import ActivationKeeper
from ._agreement import EveryRank
from ._grads import StreamedGrad
from ._layout import LocalLayout
from ._planning import DTYPE_NAMES
from ._spill import Spiller
from ._streamed import fill, narrows, split_master
from ._weights import Prefetcher, load_buffers


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


class StrataSession:
    """One offloaded model. Blocks are registered with the runtime when the optimizer is created
    (or at the first forward pass without one), one at a time: host memory never holds the
    model twice. Every field is declared here; `layout` (strata.torch._layout) says where the
    streamed parameters live across processes, and the session calls it for everything that
    differs under data parallelism."""

    def __init__(self, choices, layout=None):
        self.blocks = choices.blocks
        self.prefixes = choices.prefixes
        self.grads_home = choices.grads_home
        # The grad views are the sums (strata.torch._layout adds each backward's grads into
        # them instead of copying).
        self.grads_in_place = choices.grads_home == "hbm_sums"
        self.device = choices.device
        self.dtype = choices.dtype
        self.cuda = choices.device.type == "cuda"
        self.init = choices.init
        self.slot_budget = choices.slot_budget
        self.resident_blocks = choices.resident_blocks
        self.weights_source = choices.weights_source  # closed once the blocks hold its values
        self.layout = layout if layout is not None else LocalLayout()
        self.mesh = self.layout.mesh  # strata.torch._distributed.Mesh, or None
        self.closed = False
        # Seconds per setup phase (runtime creation, init, copies into the arena, optimizer
        # state, planning): where offloading a large model spends its time.
        self.setup_seconds = {}
        # With NVMe, what place() chose: the core.Placement and the layers it weighed, the
        # optimizer's options that realize it, and how many of the last blocks keep their
        # weights on NVMe.
        self.placement_choice = None
        self.placement_layers = None
        self.state_options = {}
        self.nvme_weight_blocks = 0
        # Resident parameters narrowed to the compute dtype that keep offload's fp32 values
        # for their masters (strata.torch._params), until the optimizer exists.
        self.kept_fp32 = []
        # Forward hooks inside streamed blocks are refused (strata.torch._block.refuse_inner_hooks)
        # unless the user says they only observe.
        self.allow_inner_hooks = False
        self.layers = []  # per block: [StreamedParam] in named_parameters order
        self.by_id = {}  # id(param) -> StreamedParam
        self.executor = None
        self.optimizer = None
        self.in_step = False
        # The strata.torch.gathered context whose copies the streamed parameters hold, or None:
        # what reads or writes Strata behind those copies is refused meanwhile.
        self.gathered = None
        self.step_id = 0  # advances at every step_begin: a stale backward can tell
        self.backward_next = None  # the block whose backward the executor expects next
        self.forward_next = 0  # and whose forward, within a step
        self.held = set()  # ids of trainable streamed params the optimizer holds a grad for
        self.landed_layers = set()  # blocks whose backward pass this step delivered grads
        self.delivered = []  # parameters of the block being released that got grads
        # Trainable parameters a backward pass gave no grad (a branch their block did not take)
        # and that held none before it: their grads go back to None when it has landed, so
        # the update skips them, as torch's AdamW skips a parameter whose .grad is None.
        self.ungraded = []
        # Called with the block's index when a streamed block's forward or backward pass begins
        # with grad, and with None when the model's forward pass with grad begins (in training
        # mode): strata.torch._paging frees, times and brings back optimizer state.
        self.on_forward_begin = []
        self.on_backward_begin = []
        self.on_resident_forward_begin = []  # a resident block's, with its index, with grad
        self.on_resident_backward_begin = []  # and its backward pass's, with its index
        # The model's chunked loss (strata.torch._chunked_loss.ChunkedLoss; offload's
        # chunked_loss=), or None: its own.
        self.chunked_loss = None
        # Built without an optimizer (a checkpoint loaded first, a forward pass of frozen
        # blocks, predict) with nothing narrowed to the compute dtype since, or every block's
        # weights then loaded from a checkpoint: the optimizer may lay the blocks out again
        # (unbuild), nothing of the values being lost.
        self.relayable = False
        self.optimizer_made = False  # strata.torch.AdamW was created for this session
        # The host memory account (strata.torch._planning.HostBudget: the arena, the paged
        # state, the spill pool), made by offload once the runtime exists.
        self.host_budget = None
        # Evaluated before the build: id(param) -> its own data, put back after the block ran.
        self._unmoved = {}
        self.nvme_files = choices.nvme  # this rank's NVMe tier files (none: no tier)
        self.runtime = None
        started = time.perf_counter()
        # What can fail on this rank alone (its device, its runtime's memory): under data
        # parallelism every rank learns of a failure here, instead of waiting for DataParallel's
        # timeout in the next collective (EveryRank); another rank's failure closes this
        # rank's runtime again.
        try:
            with EveryRank(self.mesh, "creating the session's Strata runtime"):
                # Which resident blocks keep their activations instead of recomputing them,
                # and which streamed blocks keep their matrix products' and attention's
                # outputs.
                self.activations = ActivationKeeper(self.device, self.resident_blocks,
                                                    self.blocks)
                self._note_memory_timeline()
                # Which blocks' checkpoints go to host memory (strata.torch._spill).
                self.spill = Spiller(self.device, choices.spill_checkpoints, self.activations,
                                     len(self.resident_blocks) + len(self.blocks),
                                     regenerate=self.mesh is None)
                # A session-wide empty tensor requiring grad: every streamed block's autograd
                # function takes it, so the backward pass reaches each one in order; its grad
                # accumulator says whether a backward pass accumulates into parameters
                # (loss.backward()) or not (torch.autograd.grad).
                self.anchor = torch.zeros(0, device=self.device, requires_grad=True)
                self.anchor_node = \
                    self.anchor.view_as(self.anchor).grad_fn.next_functions[0][0]
                gpu_budget, host_budget = _planning.session_budgets(
                    self.layout.block_counts(self.blocks), self.dtype, self.grads_home,
                    choices.gpu_budget, choices.host_budget, self.mesh,
                    _planning.replica_bytes(self.blocks, self.dtype, self.mesh))
                # The runtime computes on the model's GPU (cuda:1 is ordinal 1), not always
                # the first.
                # Only what the GPU's copies touch of the arena is pinned (the library sizes
                # it, strata_layout_totals_t.dram_gpu_bytes): the state stays unpinned.
                pinned = _planning.pinned_dram(self.blocks, self.dtype, self.grads_home,
                                               host_budget, self.mesh)
                self.runtime = core.Runtime(backend=choices.backend, hbm_budget=gpu_budget,
                                            dram_budget=host_budget, nvme=choices.nvme,
                                            nvme_budget=choices.nvme_budget,
                                            device=(self.device.index or 0) if self.cuda else 0,
                                            dram_fault_threads=_host.fault_threads(self.mesh),
                                            dram_pinned=pinned)
                self.layout.attach(self)  # (its side streams: this rank's device too)
        except BaseException:
            if self.runtime is not None:
                self.runtime.close()
            raise
        self.timed("runtime", started)

    # --- registration ----------------------------------------------------------------------


    def _note_memory_timeline(self):
        """The activation keeper notes the memory allocated at each block's forward and
        backward start (ActivationKeeper.at_point), on CUDA, called before strata.torch's
        other block-start calls (the pager's), which change it."""
        keeper = self.activations
        if not keeper.enabled:
            return
        self.on_forward_begin.append(
            lambda i: i is not None and keeper.at_point("f", i, streamed=True))
        self.on_backward_begin.append(lambda i: keeper.at_point("b", i, streamed=True))
        self.on_resident_forward_begin.append(lambda i: keeper.at_point("f", i, streamed=False))
        self.on_resident_backward_begin.append(
            lambda i: keeper.at_point("b", i, streamed=False))
    def timed(self, phase, started):
        """Add the seconds since `started` to `phase`; returns now (the next phase's start)."""
        now = time.perf_counter()
        self.setup_seconds[phase] = self.setup_seconds.get(phase, 0.0) + now - started
        return now

    def build(self, optimizer=None, group_of=None):
        """Register every block (materializing meta blocks on the compute device first), with
        optimizer state for trainable parameters when `optimizer` (core.Optimizer settings) is
        given; plan; create the executor. group_of: id(param) -> optimizer group index.
        Under data parallelism the build is collective (the layout's gathers and broadcasts),
        and each of its steps that can fail on one rank alone (the optimizer's memory, a
        block's materialization or writes, the executor) ends in an EveryRank, so a failure
        on any rank stops every rank at the same step; each then closes its session (its
        runtime's memory released: half laid out, the model cannot train, and the job ends)."""
        self.check_open()
        if self.executor is not None:
            raise RuntimeError("strata.torch: create the optimizer (strata.torch.AdamW) before "
                               "the first forward pass")
        try:
            self._build(self.layout.before_build(optimizer), group_of)
        except BaseException:
            if self.mesh is not None:
                self.close()
            raise

    def _build(self, optimizer, group_of):
        mesh = self.mesh
        source = self.weights_source  # offload(weights=): (file, names)
        trainable_any = self.blocks_train()
        opt = None
        # Every block's weights and grads are registered (shapes only) before any optimizer
        # state: state placed in DRAM first then sees exactly what DRAM has left for it.
        registered = []
        t = time.perf_counter()
        with EveryRank(mesh, "creating the optimizer and registering the streamed blocks"):
            if optimizer is not None and trainable_any:
                settings = dict(optimizer)
                kind = settings.pop("kind", "adamw")  # strata.torch's optimizers name theirs
                opt = core.Optimizer(self.runtime, kind, update_mode="explicit", **settings,
                                     **self.state_options)
            for i, block in enumerate(self.blocks):
                entries = []
                for k, (local, p) in enumerate(block.named_parameters()):
                    name = self.prefixes[i] + local
                    sp = self.layout.streamed_param(p, name, local, i, k)
                    self.layout.register_param(sp, p)
                    entries.append(sp)
                registered.append(entries)
        t = self.timed("register", t)
        narrowed = False  # values rounded to the compute dtype with no master to keep them
        reads = None
        if source is not None:  # the next block's tensors are read while this one is written
            reads = Prefetcher(*source, [list(b.parameters()) for b in self.blocks])
        try:
            for i, block in enumerate(self.blocks):
                # Per block, this rank's own work before and after the layout shares the
                # values (rank 0's broadcast: collective), each agreed on by every rank.
                with EveryRank(mesh, "materializing streamed block %d" % i):
                    values, t = self._block_values(block, group_of, reads, t)
                entries = registered[i]
                for sp, (v, _) in zip(entries, values):
                    self.layout.share_values(sp, v)
                with EveryRank(mesh, "writing streamed block %d's values" % i):
                    for sp, (v, group) in zip(entries, values):
                        narrowed = narrowed or opt is None and narrows(v, self.dtype)
                        self.layout.write_param(sp, v, opt, group)
                        self.by_id[id(sp.param)] = sp
                    grads = [sp for sp in entries if sp.trainable]
                    for j, sp in enumerate(grads):
                        sp.grad_index = j
                    self.layers.append(entries)
                    # The block's parameters give their storage up: they point at slot memory
                    # while acquired and at a placeholder otherwise.
                    for sp in entries:
                        sp.park(self.dtype, self.device)
                t = time.perf_counter()  # write_values timed the copies and the optimizer state
        finally:
            if reads is not None:
                reads.close()
        with EveryRank(mesh, "creating the executor"):
            self.close_weights()
            self.executor = core.Executor(
                self.runtime, [{"name": "layers.%d" % i,
                                "weights": [sp.weight for sp in entries],
                                "grads": [sp.grad for sp in entries if sp.trainable]}
                               for i, entries in enumerate(self.layers)],
                slot_budget=self.slot_budget)
            if opt is not None:
                opt.attach(self.executor)
            self.optimizer = opt
            # Built without an optimizer and nothing lost: the optimizer may lay it out again.
            self.relayable = opt is None and not narrowed
            self.timed("plan", t)
            self.layout.after_build()

    def _block_values(self, block, group_of, reads, t):
        """The block's values to write, per parameter (values, optimizer group), on the compute
        device or read from offload(weights=); and the time, its phases timed."""
        source = self.weights_source
        # A meta block gets storage and its init values on the compute device, one block at a
        # time, as `model.to_empty(device=...)` and `_init_weights` would give it: on a GPU its
        # random init runs there (torch's CPU generator is one sequential stream: 1.6-2.2 s
        # per 202M-element normal_, 52 s for a 7B model's blocks), and its values reach the
        # pinned arena by DMA.
        if source is None:
            _surgery.materialize(block, self.device, self.init)
        else:  # only the buffers: the parameters' values go from the file to the arena
            for m in block.modules():
                load_buffers(m, self.device, *source)
                _surgery.rebuild_meta_buffers(m, self.device)
        t = self.timed("init", t)
        read = None
        if reads is not None:
            read = reads.next()
            t = self.timed("read", t)  # waiting for the file (offload(weights=))
        values = []
        for k, p in enumerate(block.parameters()):
            group = 0 if group_of is None else group_of.get(id(p), 0)
            # A parameter loaded since offload (model.load_state_dict before the optimizer)
            # holds its values; the others of offload(weights=) the file's.
            loaded = _params.take_loaded(p)
            values.append((p.detach() if source is None or loaded else read[k], group))
        return values, t

    def place(self, layers, dram_budget, nvme_budget, state_placement=None, rates=None):
        """Choose where the streamed blocks' optimizer state and weights live, on NVMe or in
        DRAM (core.place: every split the budgets allow, simulated with the rates measured on
        this runtime, the fastest kept), and set the optimizer's options to realize it: its
        PLANNED state placement fills DRAM in forward order while keeping the staging slots
        free, so the DRAM budget puts the chosen blocks' state on NVMe (or, at the boundary
        block, a little less: placement_layers counts as the optimizer does, never below what
        it allocates). `layers`:
        core.placement_layers of the blocks; nvme_budget: what the placement may put on NVMe
        (the tier less its margins). With grads on the device the placement counts the DRAM
        buffer they are read through (its grad_fetch_bytes), which the optimizer takes from
        nvme_staging_bytes before its staging slots. `rates`: core.place's, those given not
        measured; under data parallelism the NVMe tier's, unless all three are given (alike on
        every rank), are one rank's measurement shared (disk_rates: collective)."""
        rates = dict(rates or {})
        if self.mesh is not None and not all(rates.get(k) for k in self.DISK_RATES):
            rates.update(self.disk_rates(layers, dram_budget, nvme_budget))
        with EveryRank(self.mesh, "choosing the placement of the training state"):
            choice = core.place(layers, runtime=self.runtime, dram_budget=dram_budget,
                                nvme_budget=nvme_budget, rates=rates)
        self.placement_choice, self.placement_layers = choice, layers
        # The optimizer fills DRAM param by param with the margin placement_layers counts,
        # so the block at the boundary may keep part of its state in DRAM. Nothing spilled: a
        # page kept free (0 would mean 1/8 of DRAM).
        staging = choice.info["staging_slots"] * choice.info["slot_bytes"] or 4096
        self.state_options = {"state_placement": state_placement or "planned",
                              "nvme_staging_bytes": staging + choice.info["grad_fetch_bytes"]}
        self.nvme_weight_blocks = choice.info["weight_nvme_layers"]

    # The NVMe tier's rates (core.place's names), and the others given as placeholders so that
    # core.place, which measures only the rates it is not given, measures the disk alone (the
    # placement it chooses with them is not used).
    DISK_RATES = ("nvme_read", "nvme_write", "nvme_mixed")
    _DISK_ONLY = {"h2d": 1.0, "d2h": 1.0, "update_elements": 1.0}

    def disk_rates(self, layers, dram_budget, nvme_budget):
        """Under data parallelism, the NVMe tier's rates this rank's placement counts
        (collective). The ranks of a host whose tier files are on the same file systems share
        those disks in training: the first of them measures them alone (the others wait) and
        each counts its share, the read and write rates divided by their number (nvme_mixed, a
        ratio, as measured). Each measuring at once moved k times the data (up to 4 GiB in
        each of 3 phases, a rank) to find the same share. A rank with disks of its own
        measures them, at once with the others."""
        mesh = self.mesh
        with EveryRank(mesh, "finding the NVMe tier's file systems") as disks:
            disks.value = (mesh.hosts[mesh.rank], _host.file_systems(self.nvme_files))
        sharing = [r for r, key in enumerate(disks.every) if key == disks.value]
        with EveryRank(mesh, "measuring the NVMe tier's rates") as step:
            if sharing[0] == mesh.rank:
                info = core.place(layers, runtime=self.runtime, dram_budget=dram_budget,
                                  nvme_budget=nvme_budget, rates=self._DISK_ONLY).info
                step.value = {k: info[k if k == "nvme_mixed" else k + "_bytes_per_second"]
                              for k in self.DISK_RATES}
        measured = step.every[sharing[0]]
        return {"nvme_read": measured["nvme_read"] / len(sharing),
                "nvme_write": measured["nvme_write"] / len(sharing),
                "nvme_mixed": measured["nvme_mixed"]}

    def predict(self, forward_seconds=0.0, backward_seconds=0.0, other_seconds=0.0):
        """The step Strata's model predicts for this session's streamed blocks (a
        core.Placement: its info's predicted_* fields, its text), given the device time of one
        streamed block's forward and backward pass (recomputation included) and of the rest
        of the model per step; with the homes and rates the placement chose (or, without
        NVMe, every tensor in DRAM, the executor's measured links and the CPU update's rate
        measured now)."""
        self.ensure_built()
        choice = self.placement_choice
        if choice is not None:
            # The homes chosen, fixed; of a spilled block's state, what the optimizer keeps in
            # the DRAM the placement left over is not staged (the choice counted it so).
            kept = [l.get("state_in_dram", 0) for l in json.loads(choice.json)["layers"]]
            layers = [dict(layer, weight_tier=w, state_tier=st,
                           state_bytes=layer["state_bytes"] - k)
                      for layer, (w, st), k in zip(self.placement_layers, choice.homes, kept)]
            info = choice.info
            rates = {"h2d": info["h2d_bytes_per_second"], "d2h": info["d2h_bytes_per_second"],
                     "nvme_read": info["nvme_read_bytes_per_second"],
                     "nvme_write": info["nvme_write_bytes_per_second"],
                     "nvme_mixed": info["nvme_mixed"],
                     "update_elements": info["update_elements_per_second"]}
            runtime = None
        else:
            element = torch.finfo(self.dtype).bits // 8
            counts = [[sp.param.numel() for sp in entries if sp.trainable]
                      for entries in self.layers]
            frozen = [[sp.param.numel() for sp in entries if not sp.trainable]
                      for entries in self.layers]
            layers = [dict(layer, weight_tier="dram", state_tier="dram")
                      for layer in core.placement_layers(
                          counts, element, frozen,
                          master_layout=_planning.master_layout(self.dtype),
                          **_planning.layout_grads(self.grads_home))]
            plan = self.executor.plan_info()
            rates = {"h2d": plan.h2d_bytes_per_second, "d2h": plan.d2h_bytes_per_second}
            runtime = self.runtime  # measures the update's rate (its own scratch memory)
        for layer in layers:
            layer.update(forward_seconds=forward_seconds, backward_seconds=backward_seconds)
        depth = max(1, self.executor.plan_info().forward_prefetch_depth)
        return core.place(layers, runtime=runtime, dram_budget=1 << 62, nvme_budget=1 << 62,
                          staging_slots=(choice.info["staging_slots"] or 1) if choice else 0,
                          prefetch_depth=depth, other_device_seconds=other_seconds,
                          rates=rates)

    def placement(self):
        """Where the training state lives, one line: the blocks kept resident on the device
        (and how many of them keep their activations, once measured), the optimizer's state
        in DRAM and on NVMe (how many params and blocks), the weights on NVMe, the staging
        slots, and the DRAM and NVMe budgets."""
        if self.optimizer is None:
            return "no optimizer yet: state is placed when strata.torch.AdamW is created"
        kept = self.resident_blocks
        head = ""
        keeper = self.activations
        said = keeper.describe() if keeper.decided or keeper.forced is not None or \
            keeper.forced_streamed is not None else ""
        if kept:
            head = "%d of %d blocks resident on the device (torch's AdamW there%s); " % (
                len(kept), len(kept) + len(self.blocks), "; " + said if said else "")
        elif said:
            head = said + "; "
        spilled = self.spill.describe()
        if spilled:
            head += spilled + "; "
        s = self.optimizer.stats()
        caps = self.runtime.capabilities()
        def size(n):
            return "%.2f GiB" % (n / (1 << 30)) if n >= 1 << 30 else "%.1f MiB" % (n / (1 << 20))

        line = head + ("optimizer state %s in DRAM, %s on NVMe (%d of %d params, %d of %d blocks)"
                % (size(s["state_bytes"] - s["staging_bytes"]), size(s["nvme_state_bytes"]),
                   s["nvme_state_params"], s["params"], s["nvme_state_layers"],
                   len(self.layers)))
        spilled = [i for i in range(len(self.layers)) if self.weight_home(i) == "nvme"]
        if spilled:
            line += "; the weights of %d blocks on NVMe (streamed blocks %d-%d)" % (
                len(spilled), spilled[0], spilled[-1])
        if s["staging_slots"]:
            line += ", staged through %d DRAM slots of %s" % (
                s["staging_slots"], size(s["staging_bytes"] // s["staging_slots"]))
        choice = self.placement_choice
        if choice is not None:
            i = choice.info
            line += ("; chosen from %d placements by predicted step: %.2f s before compute "
                     "(bottleneck %s; disk read %.2f s, write %.2f s, CPU update %.2f s)"
                     % (i["candidates"], i["predicted_step_seconds"], i["bottleneck"],
                        i["predicted_nvme_read_seconds"], i["predicted_nvme_write_seconds"],
                        i["predicted_update_seconds"]))
        line += "; " + self.accumulators_text(size)
        line += "; budgets: DRAM %s" % size(caps.tier_budget_bytes[1])
        if caps.tiers_available[2]:
            line += ", NVMe %s" % size(caps.tier_budget_bytes[2])
        if self.host_budget is not None:
            line += "; " + self.host_budget.describe()
        return line

    def host_pinned_extra_bytes(self):
        """Host memory strata.torch holds for this session beside the runtime's arena, counted
        against host_budget (strata.torch._planning.HostBudget): the resident parameters'
        paged optimizer state (strata.torch._paging) and the buffers of block checkpoints
        spilled to host memory (strata.torch._spill), kept from step to step."""
        if self.host_budget is None:
            return self.spill.host_bytes
        return sum(self.host_budget.held().values())

    def accumulators_text(self, size):
        """Where the streamed parameters' fp32 gradient accumulators live (the optimizer
        makes them at the first backward pass onto grads not zeroed since the last one: then
        where they are; before, where they will go with the DRAM free now). Part of
        placement()."""
        trained = [sp for layer in self.layers for sp in layer if sp.trainable]
        if not trained:
            return "no gradient accumulators (nothing streamed trains)"
        if self.grads_in_place:  # the grads on the device are the sums: no accumulator
            return "gradient sums in place on the GPU (%s)" % size(
                sum(sp.grad.nbytes for sp in trained))
        homes = []
        for sp in trained:
            try:
                homes.append(self.optimizer.state(sp.weight, "grad_accum").info().tier)
            except LookupError:
                break
        if len(homes) == len(trained):
            on_nvme = sum(1 for t in homes if t == core.TIERS["nvme"])
            if not on_nvme:
                return "gradient accumulators in DRAM"
            return ("gradient accumulators in DRAM for %d params, on NVMe for %d (staged "
                    "through the slots at each backward pass that adds)"
                    % (len(homes) - on_nvme, on_nvme))
        element = _planning.element_bytes(self.dtype)
        need = core.accum_bytes([[sp.weight.nbytes // element for sp in layer if sp.trainable]
                                 for layer in self.layers if any(sp.trainable for sp in layer)],
                                element)
        dram = self.runtime.tier_usage("dram")
        free = dram["budget"] - dram["used"]
        if need <= free:
            where = "in DRAM"
        elif self.runtime.capabilities().tiers_available[2]:
            where = ("on NVMe for some blocks, staged through DRAM (DRAM has %s free)"
                     % size(free))
        else:
            where = ("nowhere: DRAM has %s free and there is no NVMe tier, so accumulating "
                     "fails (raise host_budget or pass nvme=)" % size(free))
        return "gradient accumulators (%s, made at the first accumulation) %s" % (
            size(need), where)

    def weight_home(self, layer):
        """Where block `layer`'s weights live: the last nvme_weight_blocks blocks' on NVMe
        (offload chose that when DRAM cannot hold every weight), the others' in DRAM."""
        return "nvme" if layer >= len(self.blocks) - self.nvme_weight_blocks else "dram"

    def register_shape(self, sp, name, shape, trainable):
        sp.weight = self.runtime.register(name, shape, DTYPE_NAMES[self.dtype], "weight",
                                          self.weight_home(sp.layer))
        if trainable:
            # Summed in place: fp32 whatever the compute dtype (strata.h
            # STRATA_GRAD_SUM_IN_PLACE).
            dtype = "float32" if self.grads_in_place else DTYPE_NAMES[self.dtype]
            sp.grad = self.runtime.register(name + ".grad", shape, dtype, "grad",
                                            "dram" if self.grads_home == "dram" else "hbm")

    def write_values(self, sp, values, opt, group):
        """`values` (sp.weight's shape) into sp.weight; its optimizer state (the master from
        the fp32 values, when given in fp32)."""
        t = time.perf_counter()
        trains = sp.trainable and opt is not None
        layout = _planning.master_layout(self.dtype)
        # The master starts from fp32 values, not their rounded copy: a split one's low
        # halves are computed with the weight, where `values` are (on a GPU: there).
        split = trains and layout == "split" and values.dtype == torch.float32
        weight, rest = split_master(values) if split else (values.to(self.dtype), None)
        fill(sp.weight, weight)  # rounded where `values` are
        t = self.timed("weights", t)
        if trains:
            opt.add_param(sp.weight, sp.grad, group, master_layout=layout,
                          grad_sum=_planning.layout_grads(self.grads_home)["grad_sum"])
            if split:
                fill(opt.state(sp.weight, "master_low"), rest)
            elif values.dtype == torch.float32 and self.dtype != torch.float32:
                fill(opt.state(sp.weight, "master"), values)
            self.timed("optimizer_state", t)

    def blocks_train(self):
        """Whether some streamed block parameter requires grad now."""
        return any(p.requires_grad for b in self.blocks for p in b.parameters())

    def ensure_built(self):
        self.check_open()
        if self.executor is None:
            self.build()

    def unbuild(self):
        """Undo a build made without an optimizer, so that build() can lay the blocks out again
        with the optimizer's state: every block's weights back in its parameters (host memory,
        the compute dtype), the runtime's tensors and the executor gone. Only where the weights
        hold all the values did (`relayable`): values narrowed to the compute dtype at the
        build or since would otherwise start the masters rounded."""
        if self.optimizer is not None or self.in_step or not self.relayable:
            raise RuntimeError("strata.torch: internal: unbuild of a session that trained")
        values = [[self.read_weight(sp) for sp in entries] for entries in self.layers]
        self.executor.close()
        self.executor = None
        for entries, block_values in zip(self.layers, values):
            for sp, v in zip(entries, block_values):
                sp.weight.unregister()
                if sp.grad is not None:
                    sp.grad.unregister()
                sp.param.data = v
        self.layers, self.by_id = [], {}
        self.relayable = False

    def check_not_gathered(self, what):
        """Refuse `what` inside strata.torch.gathered: the streamed parameters hold gathered
        copies there, which a forward pass, an update or a load would bypass."""
        if self.gathered is not None:
            raise RuntimeError("strata.torch: %s inside strata.torch.gathered(...): the streamed "
                               "parameters hold gathered copies of their values there; leave "
                               "the with-block first" % what)

    def check_open(self):
        if self.closed:
            raise RuntimeError("strata.torch: this model's Strata session is closed "
                               "(model.strata.close()); offload a fresh model to train again")

    # --- the step ----------------------------------------------------------------------------

    def stream(self):
        return torch.cuda.current_stream(self.device).cuda_stream if self.cuda else None

    def bind(self, index, phase):
        """Point the block's parameters at its weights in the slot (zero-copy, DLPack)."""
        for sp in self.layers[index]:
            sp.check_untouched()
            sp.param.data = torch.from_dlpack(self.executor.view(index, phase, VIEW_WEIGHT,
                                                                 sp.index))

    def unbind(self, index):
        if self.executor is None:  # evaluated before the blocks moved: their own values back
            for p in self.blocks[index].parameters():
                p.data = self._unmoved.get(id(p), p.data)
            self._unmoved = {}
            return
        for sp in self.layers[index]:
            sp.park(self.dtype, self.device)

    def begin(self, index, phase):
        # Without the optimizer, trainable blocks have nowhere for their grads: before the
        # build, or after one made without it (a checkpoint loaded, predict: the optimizer may
        # lay the blocks out again, which grads in Strata would not survive). Once an
        # optimizer was made, frozen blocks unfrozen are check_trainable's to refuse.
        if self.optimizer is None and not self.optimizer_made and self.blocks_train():
            added = [self.prefixes[i] + name for i, b in enumerate(self.blocks)
                     for name, p in b.named_parameters()
                     if p.requires_grad and _params.owner(p) is not self]
            if added:
                raise RuntimeError(
                    "strata.torch: streamed blocks have trainable parameters that were added "
                    "after strata.torch.offload (%s%s): adapters (PEFT's get_peft_model, a LoRA "
                    "wrapper) must be applied to the model before offload, which then streams "
                    "them with their blocks" % (", ".join(added[:3]),
                                                ", ..." if len(added) > 3 else ""))
            raise RuntimeError(
                "strata.torch: create the optimizer (strata.torch.AdamW(model.parameters(), "
                "...)) after strata.torch.offload(model) and before the first forward pass with "
                "grad: the streamed blocks' grads live in its state. An optimizer created "
                "before offload, or one of torch.optim's, cannot update streamed parameters "
                "(evaluate under torch.no_grad(), or freeze the blocks, to run without one)")
        self.check_not_gathered("a forward or backward pass of a streamed block")
        self.ensure_built()
        if phase == FORWARD and index == 0:
            if self.in_step:
                # The last forward pass never got its backward (an exception after it, or a
                # forward whose result was dropped): as in plain PyTorch, that changes nothing.
                self.abort()
            self.check_trainable()
            if self.optimizer is not None:
                # Grads set to None since the last backward (model.zero_grad(), p.grad = None)
                # must be dropped before this backward lands, or it would add to them.
                self.sync_grads()
            self.executor.step_begin()
            self.landed_layers = set()
            self.in_step = True
            self.step_id += 1
            self.backward_next = len(self.layers) - 1
            self.forward_next = 0
        if phase == FORWARD and (not self.in_step or index != self.forward_next):
            raise RuntimeError(
                "strata.torch: streamed block %d ran its forward pass where block %d was next: "
                "with grad, the streamed blocks run in order, each once per forward pass, "
                "from block 0 (their weights stream in that order): skipping blocks "
                "(LayerDrop), repeating one or reordering them is not supported (under "
                "torch.no_grad() any order works)"
                % (index, self.forward_next if self.in_step else 0))
        if phase == BACKWARD and index == len(self.layers) - 1 and self.optimizer is not None:
            # Grads set to None between this pass's forward and its backward
            # (model.zero_grad(), p.grad = None) are dropped before it lands, as at the forward
            # pass above; opt.zero_grad() drops them itself.
            self.sync_grads()
        for call in self.on_forward_begin if phase == FORWARD else self.on_backward_begin:
            call(index)
        self.layout.acquire(index, phase)
        if phase == FORWARD:
            self.forward_next = index + 1

    def store_grads(self, index, params, grads):
        """After block `index`'s backward: the grads of its trainable StreamedParams `params`
        (None where a parameter got none) into the acquired layer's grad views."""
        self.layout.store_grads(index, params, grads)

    def end(self, index, phase):
        self.layout.release(index, phase)
        if phase == BACKWARD:
            self.backward_next = index - 1
            self.landed_layers.add(index)
            self.show_delivered_grads()
            if index == 0:
                self.in_step = False
                self.executor.step_end()
                self.grads_landed()
        self.layout.after_end(index, phase)

    def abort(self):
        """Abandon the running step after an exception: the next forward starts a fresh one.
        Grads of blocks whose backward finished stay, as autograd would have left them."""
        if self.executor is None or not self.in_step:
            return
        self.layout.before_abort()
        self.in_step = False
        self.backward_next = None
        self.delivered = []  # what landed is the optimizer's to say (grads_landed, below)
        for i in range(len(self.layers)):
            self.unbind(i)
        self.executor.step_abort(self.stream())
        self.grads_landed()

    def check_trainable(self):
        """Which block parameters get grads is fixed when the blocks move into Strata (their
        grad buffers and optimizer state are laid out then): a later requires_grad_ change is
        refused rather than silently ignored."""
        for entries in self.layers:
            for sp in entries:
                sp.check_untouched()
                if sp.param.requires_grad != sp.trainable:
                    raise RuntimeError(
                        "strata.torch: requires_grad of streamed parameter %r changed to %s after "
                        "the optimizer was created; freeze or unfreeze block parameters before "
                        "strata.torch.AdamW(...)" % (sp.name, sp.param.requires_grad))

    def show_delivered_grads(self):
        """As autograd sets .grad when a parameter's grad is accumulated, not when the whole
        backward pass ends: the parameters the block just released got grads for show them
        now (a lazy StreamedGrad: nothing waits for the copy). A backward pass that raises
        later leaves them visible, so zero_grad drops them as in plain PyTorch."""
        for sp in self.delivered:
            if id(sp.param) not in self.held or sp.param.grad is None:
                self.held.add(id(sp.param))
                sp.param.grad = StreamedGrad.of(self, sp)
        self.delivered = []

    def grads_landed(self):
        """After a backward pass: every trainable streamed parameter whose grads came shows
        them as its .grad (a StreamedGrad reading them from Strata)."""
        if self.optimizer is None:
            return
        for sp in self.ungraded:  # landed as zeros: back to none (waits for its layer's landing)
            self.optimizer.grad_zero(sp.weight, keep_zeros=False)
        self.ungraded = []
        for entries in self.layers:
            for sp in entries:
                if not sp.trainable or (id(sp.param) in self.held and sp.param.grad is not None):
                    continue
                has, _, _ = self.optimizer.grad_info(sp.weight)
                if has:
                    self.held.add(id(sp.param))
                    sp.param.grad = StreamedGrad.of(self, sp)
        # register_post_accumulate_grad_hook: called once per backward pass that accumulated
        # into the parameter, as autograd does.
        for index in sorted(self.landed_layers, reverse=True):
            for sp in self.layers[index]:
                hooks = getattr(sp.param, "_post_accumulate_grad_hooks", None)
                if sp.trainable and hooks:
                    for hook in list(hooks.values()):
                        hook(sp.param)
        self.landed_layers = set()

    def sync_grads(self):
        """Before a step or an update: a held grad the user set to None (model.zero_grad(),
        p.grad = None) is dropped in Strata too; a tensor assigned to it is refused."""
        for pid in list(self.held):
            sp = self.by_id[pid]
            g = sp.param.grad
            if g is None:
                self.optimizer.grad_zero(sp.weight, keep_zeros=False)
                self.held.discard(pid)
            elif not isinstance(g, StreamedGrad) or g._sp is not sp:
                raise RuntimeError(
                    "strata.torch: the .grad of streamed parameter %r was replaced by another "
                    "tensor; streamed grads live in Strata: change them in place "
                    "(p.grad.copy_(new), mul_, clamp_), zero them (zero_grad) or set them to None"
                    % sp.name)
        for entries in self.layers:
            for sp in entries:
                if sp.trainable and id(sp.param) not in self.held and sp.param.grad is not None:
                    raise RuntimeError(
                        "strata.torch: a tensor was assigned to the .grad of streamed parameter "
                        "%r; streamed grads come from backward passes only" % sp.name)

    def check_all_untouched(self):
        for entries in self.layers:
            for sp in entries:
                sp.check_untouched()

    def load_block(self, index):
        """For evaluation without grads: the block's weights copied from DRAM (no executor).
        Before the blocks move into Strata (no optimizer yet), their own values, on the device."""
        self.check_open()
        self.check_not_gathered("a forward pass of a streamed block")
        if self.executor is None:
            params = list(self.blocks[index].parameters())
            if any(p.is_meta for p in params):
                raise RuntimeError(
                    "strata.torch: streamed block %d has no values yet (a model built on the "
                    "meta device gets them when the optimizer is created, from its init or "
                    "offload(weights=)): create the optimizer (strata.torch.AdamW) before "
                    "evaluating, or load the weights with model.load_state_dict first" % index)
            self._unmoved = {id(p): p.data for p in params}
            for p in params:
                # In the compute dtype, as every forward pass after the build computes it (the
                # resident modules are in it already).
                p.data = p.data.to(self.device, self.dtype) if p.is_floating_point() else \
                    p.data.to(self.device)
            return
        if self.optimizer is not None:
            self.optimizer.synchronize()  # updates still running would be read half-done
        self.layout.load_block(index)

    def read_weight(self, sp):
        """A streamed parameter's current values (after any running update), on the CPU."""
        self.ensure_built()
        if self.optimizer is not None:
            self.optimizer.synchronize()
        return self.layout.read_weight(sp)

    def read_state(self, sp, kind):
        """A trainable streamed parameter's optimizer state of `kind` (fp32, on the CPU; the
        master put together whatever its layout)."""
        return self.layout.read_state(sp, kind)

    def write_state(self, sp, kind, value):
        """Set a state of `kind`; the master sets the weight too (rounded from it)."""
        if tuple(value.shape) != sp.shape:
            raise ValueError("strata.torch.AdamW.load_state_dict: state %r of %r has shape %s, "
                             "expected %s" % (kind, sp.name, list(value.shape), list(sp.shape)))
        self.layout.write_state(sp, kind, value)

    def read_grad(self, sp):
        """A streamed parameter's held grad as an fp32 CPU tensor (a copy)."""
        return self.layout.read_grad(sp)

    def grad_sums(self, params):
        """The sums of squares of the held grads of `params` (StreamedParams), in order."""
        return self.layout.grad_sums(params)

    def write_weight(self, sp, values):
        """Set a streamed parameter (weight and, when trained, its fp32 master)."""
        self.check_not_gathered("loading weights (model.load_state_dict)")
        self.ensure_built()
        if self.in_step:
            raise RuntimeError("strata.torch: weights can be loaded between steps only")
        if self.optimizer is not None:
            self.optimizer.synchronize()
        if tuple(values.shape) != sp.shape:
            raise ValueError("strata.torch: %r has shape %s, the value given has %s"
                             % (sp.name, list(sp.shape), list(values.shape)))
        if self.optimizer is None and narrows(values, self.dtype):
            # Narrowed here, with no master to keep them: the optimizer could not lay the
            # blocks out again from these values (unbuild).
            self.relayable = False
        self.store_weight(sp, values)

    def masters_from_weights(self):
        """After the weights were written behind the optimizer (a checkpoint loaded without its
        optimizer state): every trained streamed parameter's fp32 master becomes its weight,
        widened, as model.load_state_dict sets it, so the next update starts from the loaded
        weights and not from the masters of before (which would put the old weights back)."""
        if self.optimizer is None or self.dtype == torch.float32:
            return  # an fp32 weight is its own master
        self.layout.masters_from_weights()

    def weights_loaded(self):
        """Every block's weights were just written from a checkpoint without optimizer state:
        the masters follow them, as after model.load_state_dict (the optimizer's moments
        stay); before the optimizer exists, it may lay the blocks out again from them
        (unbuild)."""
        self.masters_from_weights()
        self.relayable = self.optimizer is None

    def optimizer_created(self):
        """strata.torch.AdamW was made for this session (its blocks laid out with it, or frozen
        ones kept as built): offload's fp32 copies of resident parameters are its masters'
        now or not needed (frozen ones: an 8B's embedding and head under LoRA, 4 GB), and
        go."""
        self.optimizer_made = True
        for p in self.kept_fp32:
            _params.drop_fp32(p)
        self.kept_fp32 = []

    def store_weight(self, sp, values):
        """write_weight's writes, its checks done: the weight and, when trained, the master."""
        self.layout.store_weight(sp, values)

    def _not_copyable(self, *args):
        raise TypeError(
            "strata.torch: an offloaded model cannot be pickled or deep-copied: it holds a live "
            "Strata runtime (pinned memory, threads). Save model.state_dict() or "
            "strata.torch.save_checkpoint(...), and load into a freshly built model")

    __deepcopy__ = _not_copyable
    __reduce_ex__ = _not_copyable

    def close(self):
        if self.closed:
            return
        self.closed = True
        self.close_weights()
        self.spill.close()
        self.runtime.close()

    def close_weights(self):
        """Let go of offload(weights=)'s checkpoint once the blocks hold its values."""
        source = self.weights_source
        if source is not None:
            source[0].close()
            self.weights_source = None
