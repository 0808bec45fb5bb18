"""Where the session's training state lives (strata.torch.session.session's Placer): chosen
with NVMe (place: core.place over the budgets, with the rates measured on this runtime or, under
data parallelism, shared by the ranks of a host), predicted (predict) and described in one
line (placement)."""

import json

import torch

from ... import core
from .. import _host, _planning
from .._agreement import EveryRank


class Placer:
    """The session's placement (one per session, which calls it). What it chose that the layout
    reads or replaces (placement_choice, state_options, nvme_weight_blocks) is the session's;
    the layers it weighed are this object's own."""

    def __init__(self, session):
        self.session = session
        self.placement_layers = None  # with NVMe: the layers place() weighed

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
        s = self.session
        rates = dict(rates or {})
        if s.mesh is not None and not all(rates.get(k) for k in self.DISK_RATES):
            rates.update(self.disk_rates(layers, dram_budget, nvme_budget))
        with EveryRank(s.mesh, "choosing the placement of the training state"):
            # The choice and the optimizer options that realize it: every binding's
            # (strata._tiering.choose).
            choice, s.state_options = core.choose_placement(
                layers, s.runtime, dram_budget, nvme_budget, state_placement, rates)
        s.placement_choice, self.placement_layers = choice, layers
        s.nvme_weight_blocks = choice.info["weight_nvme_layers"]

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
        s = self.session
        mesh = s.mesh
        with EveryRank(mesh, "finding the NVMe tier's file systems") as disks:
            disks.value = (mesh.hosts[mesh.rank], _host.file_systems(s.nvme_files))
        sharing = [r for r, key in enumerate(disks.every) if key == disks.value]
        with EveryRank(mesh, "measuring the NVMe tier's rates") as step:
            if sharing[0] == mesh.rank:
                info = core.place(layers, runtime=s.runtime, dram_budget=dram_budget,
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
        s = self.session
        s.ensure_built()
        choice = s.placement_choice
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
            element = torch.finfo(s.dtype).bits // 8
            counts = [[sp.param.numel() for sp in entries if sp.trainable]
                      for entries in s.layers]
            frozen = [[sp.param.numel() for sp in entries if not sp.trainable]
                      for entries in s.layers]
            layers = [dict(layer, weight_tier="dram", state_tier="dram")
                      for layer in core.placement_layers(
                          counts, element, frozen,
                          master_layout=_planning.master_layout(s.dtype),
                          **_planning.layout_grads(s.grads_home))]
            plan = s.executor.plan_info()
            rates = {"h2d": plan.h2d_bytes_per_second, "d2h": plan.d2h_bytes_per_second}
            runtime = s.runtime  # measures the update's rate (its own scratch memory)
        for layer in layers:
            layer.update(forward_seconds=forward_seconds, backward_seconds=backward_seconds)
        depth = max(1, s.executor.plan_info().forward_prefetch_depth)
        return core.place(layers, runtime=runtime, dram_budget=1 << 62, nvme_budget=1 << 62,
                          staging_slots=(choice.info["staging_slots"] or 1) if choice else 0,
                          prefetch_depth=depth, other_device_seconds=other_seconds,
                          rates=rates)

    def describe(self):
        """Where the training state lives, one line: the blocks kept resident on the device
        (and how many of them keep their activations, once measured), the optimizer's state
        in DRAM and on NVMe (how many params and blocks), the weights on NVMe, the staging
        slots, and the DRAM and NVMe budgets."""
        s = self.session
        if s.optimizer is None:
            return "no optimizer yet: state is placed when strata.torch.AdamW is created"
        kept = s.resident_blocks
        head = ""
        keeper = s.activations
        said = keeper.describe() if keeper.decided or keeper.forced is not None or \
            keeper.forced_streamed is not None else ""
        if kept:
            head = "%d of %d blocks resident on the device (torch's AdamW there%s); " % (
                len(kept), len(kept) + len(s.blocks), "; " + said if said else "")
        elif said:
            head = said + "; "
        spilled = s.spill.describe()
        if spilled:
            head += spilled + "; "
        stats = s.optimizer.stats()
        caps = s.runtime.capabilities()
        def size(n):
            return "%.2f GiB" % (n / (1 << 30)) if n >= 1 << 30 else "%.1f MiB" % (n / (1 << 20))

        line = head + ("optimizer state %s in DRAM, %s on NVMe (%d of %d params, %d of %d blocks)"
                % (size(stats["state_bytes"] - stats["staging_bytes"]),
                   size(stats["nvme_state_bytes"]), stats["nvme_state_params"],
                   stats["params"], stats["nvme_state_layers"], len(s.layers)))
        spilled = [i for i in range(len(s.layers)) if self.weight_home(i) == "nvme"]
        if spilled:
            line += "; the weights of %d blocks on NVMe (streamed blocks %d-%d)" % (
                len(spilled), spilled[0], spilled[-1])
        if stats["staging_slots"]:
            line += ", staged through %d DRAM slots of %s" % (
                stats["staging_slots"], size(stats["staging_bytes"] // stats["staging_slots"]))
        choice = s.placement_choice
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
        if s.host_budget is not None:
            line += "; " + s.host_budget.describe()
        return line

    def host_pinned_extra_bytes(self):
        """Host memory strata.torch holds for this session beside the runtime's arena, counted
        against host_budget (strata.torch._planning.HostBudget): the resident parameters'
        paged optimizer state (strata.torch.paging) and the buffers of block checkpoints
        spilled to host memory (strata.torch._spill), kept from step to step."""
        s = self.session
        if s.host_budget is None:
            return s.spill.host_bytes
        return sum(s.host_budget.held().values())

    def accumulators_text(self, size):
        """Where the streamed parameters' fp32 gradient accumulators live (the optimizer
        makes them at the first backward pass onto grads not zeroed since the last one: then
        where they are; before, where they will go with the DRAM free now). Part of
        placement()."""
        s = self.session
        trained = [sp for layer in s.layers for sp in layer if sp.trainable]
        if not trained:
            return "no gradient accumulators (nothing streamed trains)"
        if s.grads_in_place:  # the grads on the device are the sums: no accumulator
            return "gradient sums in place on the GPU (%s)" % size(
                sum(sp.grad.nbytes for sp in trained))
        homes = []
        for sp in trained:
            try:
                homes.append(s.optimizer.state(sp.weight, "grad_accum").info().tier)
            except LookupError:
                break
        if len(homes) == len(trained):
            on_nvme = sum(1 for t in homes if t == core.TIERS["nvme"])
            if not on_nvme:
                return "gradient accumulators in DRAM"
            return ("gradient accumulators in DRAM for %d params, on NVMe for %d (staged "
                    "through the slots at each backward pass that adds)"
                    % (len(homes) - on_nvme, on_nvme))
        element = _planning.element_bytes(s.dtype)
        need = core.accum_bytes([[sp.weight.nbytes // element for sp in layer if sp.trainable]
                                 for layer in s.layers if any(sp.trainable for sp in layer)],
                                element)
        dram = s.runtime.tier_usage("dram")
        free = dram["budget"] - dram["used"]
        if need <= free:
            where = "in DRAM"
        elif s.runtime.capabilities().tiers_available[2]:
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
        s = self.session
        return "nvme" if layer >= len(s.blocks) - s.nvme_weight_blocks else "dram"
