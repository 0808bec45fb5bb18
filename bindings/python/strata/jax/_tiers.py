"""A Trainer's runtime budgets and, with an NVMe tier, the library's placement of the blocks'
weights and optimizer state: the steps strata.torch.offload runs, from strata._tiering (one
implementation for both bindings; the library decides, this module passes its answer on to the
registration and the optimizer), and where everything is, read back from the runtime."""
import numpy as np

from .. import core
from .._host import disk_free


class _Tiers:
    """Trainer's budgets and placement (a mixin of Trainer: they set its attributes)."""

    def _layout_counts(self):
        """Per layer its leaves' element counts in the one element size the library's layout
        takes (2 bytes when any leaf is 16-bit, else 4), and that size. A float32 leaf beside
        16-bit ones counts as twice its elements: its weight's and grad's bytes exactly, its
        state (m and v, 8 bytes an element) as two 16-bit elements' (24), more than it takes,
        so that no budget or placement made of them plans less than the optimizer allocates."""
        element = min(d.itemsize for d in self.leaf_dtypes)
        return [[int(np.prod(shape)) * (d.itemsize // element)
                 for shape, d in zip(shapes, self.leaf_dtypes)]
                for shapes in self.shapes], element

    def _budgets(self, gpu_budget, host_budget, nvme, nvme_budget, state_placement):
        """The runtime's budgets: (HBM, DRAM, DRAM's pinned part, NVMe). HBM: a few blocks'
        slots (the library's streaming_budgets) or gpu_budget. Without nvme: DRAM what the
        blocks' weights, grads and state take (and, accumulating, the fp32 accumulators), or
        host_budget. With nvme: the NVMe plan every binding makes (core.plan_budgets, as
        strata.torch.offload): DRAM what everything needs or 85% of the available memory,
        whichever is less, at most host_budget; NVMe nvme_budget or room for everything that
        could spill; a budget that cannot hold the model even with its state and weights on
        NVMe is refused here, before the runtime exists. self._tiers keeps that plan for the
        placement chosen on the runtime (_place)."""
        itemsize = max(d.itemsize for d in self.leaf_dtypes)
        # Per layer, the elements this process's runtime holds (its chunks under data
        # parallel; data parallelism refuses nvme, so the NVMe plan below sees whole leaves).
        kept = [[self._layout.kept(int(np.prod(s))) for s in shapes] for shapes in self.shapes]
        hbm, dram = core.streaming_budgets([sum(k) for k in kept], itemsize)
        hbm = hbm if gpu_budget is None else gpu_budget
        self._tiers = None
        if nvme:
            counts, element = self._layout_counts()
            layers = core.placement_layers(
                counts, element, state_tier="nvme" if state_placement == "nvme" else "choose")
            for i, layer in enumerate(layers):
                layer["name"] = "layers.%d" % i
            self._tiers = core.plan_budgets("strata.jax.Trainer", layers, host_budget,
                                            nvme_budget, free_disk=lambda: disk_free(nvme))
            dram = self._tiers.host_budget
            # Only what the GPU's copies touch of the arena is pinned (core.pinned_dram).
            return hbm, dram, core.pinned_dram(counts, element, dram), self._tiers.nvme_budget
        if host_budget is None and self.block_optimizer.accumulation > 1:
            # Micro-batches' grads are summed in the optimizer's fp32 accumulators, in DRAM.
            dram += core.accum_bytes(kept, itemsize)
        dram = dram if host_budget is None else host_budget
        # Only what the GPU's copies touch of the arena is pinned (core.pinned_dram): each
        # leaf's weight and grad, not the optimizer's state.
        pinned = core.pinned_dram(kept, itemsize, dram)
        return hbm, dram, pinned, 0

    def _place(self, state_placement):
        """With nvme: the library chooses where each block's weights and optimizer state live,
        with the rates measured on this runtime (core.choose_placement, as strata.torch's
        Placer); `placement` is its choice (a core.Placement: homes per layer, info, text),
        and the optimizer's options realize it. Without: None, everything in DRAM."""
        self.placement, self._state_options = None, {}
        if self._tiers is None:
            return
        t = self._tiers
        try:
            self.placement, self._state_options = core.choose_placement(
                t.layers, self.runtime, t.host_budget, t.place_nvme, state_placement,
                updates_after_backward=self.block_optimizer.holds_grads)
        except MemoryError as e:  # the choice with measured rates fits wherever the check did
            raise ValueError("strata.jax.Trainer: %s; nothing was created" % e) from None

    def placement_info(self):
        """Where the blocks' training state lives, read back from the runtime: "weights" and
        "state", per layer per leaf, the tier ("dram" or "nvme") of its weight and of its
        optimizer state (its first moment: the master and the moments of a param share a
        home); "nvme_state_params", "nvme_state_layers", "nvme_state_bytes", "staging_slots"
        (the optimizer's stats); "nvme_used_bytes" (the NVMe tier's, 0 without one)."""
        names = {v: k for k, v in core.TIERS.items()}
        stats = self.optimizer.stats()
        out = {"weights": [[names[w.info().tier] for w in ws] for ws in self.weights],
               "state": [[names[self.optimizer.state(w, "exp_avg").info().tier] for w in ws]
                         for ws in self.weights],
               "nvme_used_bytes": (self.runtime.tier_usage("nvme")["used"]
                                   if self.runtime.capabilities().tiers_available[2] else 0)}
        for key in ("nvme_state_params", "nvme_state_layers", "nvme_state_bytes",
                    "staging_slots"):
            out[key] = stats[key]
        return out
