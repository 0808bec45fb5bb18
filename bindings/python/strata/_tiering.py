"""A streamed model's training state across DRAM and NVMe, for every binding (strata.torch and
strata.jax run the same steps): the tier arguments checked (tier_arguments), the budgets
filled in and checked against the library's placement before a runtime exists (plan_budgets),
then the placement chosen on the runtime with its measured rates and handed over as what a
binding executes (choose: the optimizer's state options; the placement's per-layer homes say
where each layer's weights are registered). Where things go is the library's decision
(strata_layout_query's sizes, strata_placement_create's choice); this module asks it and
passes its answer on. Re-exported by strata.core."""
import dataclasses
import os

from ._host import mem_available
from ._placement import place
from ._sizes import layout_totals

# The share of the host's available memory a default host budget may take (the rest is left to
# the OS, the framework and the user): the arena with NVMe, and in strata.torch the room for the
# gradient accumulators beside it.
HOST_SHARE = 0.85

STATE_PLACEMENTS_WITH_NVME = ("planned", "nvme")


def tier_arguments(who, nvme, nvme_budget, state_placement):
    """nvme= and its options checked: (the NVMe tier's paths as a list, empty for none;
    nvme_budget, None read as 0). `who` names the caller in the errors ("strata.torch.offload")."""
    if isinstance(nvme, (str, bytes, os.PathLike)):
        nvme = [nvme]  # one path, not its characters
    nvme = list(nvme) if nvme else []
    nvme_budget = nvme_budget or 0  # None, as documented, is 0 (examples/train.py passes it)
    if nvme_budget and not nvme:
        raise ValueError("%s: nvme_budget=%d without nvme= (the NVMe tier's file paths)"
                         % (who, nvme_budget))
    if state_placement is not None and state_placement not in STATE_PLACEMENTS_WITH_NVME:
        raise ValueError("%s: state_placement is %r, not 'planned' or 'nvme'"
                         % (who, state_placement))
    if state_placement is not None and not nvme:
        raise ValueError("%s: state_placement=%r needs nvme= (the NVMe tier's file paths)"
                         % (who, state_placement))
    return nvme, nvme_budget


@dataclasses.dataclass
class TierPlan:
    """plan_budgets' answer: the layers the placement weighs, the runtime's DRAM arena and NVMe
    tier budgets, and what a placement may put on NVMe (the tier less its margins)."""
    layers: list
    host_budget: int
    nvme_budget: int
    place_nvme: int


def plan_budgets(who, layers, host_budget, nvme_budget, free_disk, available=mem_available,
                 ranks=1, agree=None):
    """With an NVMe tier: the budgets filled in where not given and checked, with no rates,
    against the library's placement (that some placement of `layers`, core.placement_layers of
    the streamed blocks, fits): nothing is created, and a budget that cannot hold the model
    even with its state and weights on NVMe raises a ValueError naming it. Returns a TierPlan.

    DRAM: what every tensor, the staging and the gradient accumulators need, or HOST_SHARE of
    the available memory (`available()`: MemAvailable, None where unknown; divided among the
    `ranks` processes of the host that each make such a budget), whichever is less; of a given
    host_budget at most what they need. NVMe: room for everything that could spill,
    accumulators included (the library's nvme_bytes), at most `free_disk()` (what the tier's
    file systems have free: the runtime preallocates its files). `agree(host, nvme)`, given:
    the budgets every process of a job plans with (data parallelism: the least of the ranks'),
    called before the check so that every rank checks the same placement."""
    sizes = layout_totals(layers)
    full = sizes["dram_bytes"] + sizes["accum_bytes"]
    if host_budget is None:
        memory = available()
        host_budget = full if memory is None else min(full, int(memory * HOST_SHARE) // ranks)
    else:
        host_budget = min(host_budget, full)
    if not nvme_budget:
        nvme_budget = min(sizes["nvme_bytes"], free_disk())
    if agree is not None:
        host_budget, nvme_budget = agree(host_budget, nvme_budget)
    # The NVMe tier holds what the placement puts there and the tier's margins (the library's
    # rule, strata_layout_totals_t: 64 MiB a block and 5%): the placement may use
    # nvme_placeable_bytes of it, the same figure in this check and in choose().
    place_nvme = layout_totals(layers, nvme_budget=nvme_budget)["nvme_placeable_bytes"]
    if place_nvme <= 0:
        raise ValueError("%s: nvme_budget %d bytes leaves no room for training state after the "
                         "tier's margins (64 MiB a block and 5%%); nothing was changed"
                         % (who, nvme_budget))
    try:
        place(layers, dram_budget=host_budget, nvme_budget=place_nvme)
    except MemoryError as e:
        short = ("host_budget %d bytes is below what DRAM needs" % host_budget
                 if "DRAM needs" in str(e) else
                 "nvme_budget %d bytes is below what NVMe needs" % nvme_budget)
        raise ValueError("%s: %s with training state and weights on NVMe (%s); nothing was "
                         "changed" % (who, short, e)) from None
    return TierPlan(layers, host_budget, nvme_budget, place_nvme)


def choose(layers, runtime, dram_budget, nvme_budget, state_placement=None, rates=None,
           updates_after_backward=True):
    """The placement of the streamed blocks' weights and optimizer state (core.place: every
    split the budgets allow, simulated with the rates measured on `runtime` unless given in
    `rates`, the fastest kept) and the optimizer options that realize it: (Placement, options
    for core.Optimizer). Its PLANNED state placement fills DRAM in forward order while keeping
    the staging slots free, so the DRAM budget puts the chosen blocks' state on NVMe (at the
    boundary block a little less: placement_layers counts as the optimizer does, never below
    what it allocates); with grads on the device the placement counts the DRAM buffer they are
    read through (grad_fetch_bytes), which the optimizer takes from nvme_staging_bytes before
    its slots. The Placement's homes say where each layer's weights are registered.
    nvme_budget: TierPlan.place_nvme; updates_after_backward: whether the updates wait for the
    whole backward pass (an explicit optimizer step, clipping, accumulation) or each layer's
    for its own grads, as core.place simulates them. Raises MemoryError when nothing fits."""
    choice = place(layers, runtime=runtime, dram_budget=dram_budget, nvme_budget=nvme_budget,
                   rates=rates, updates_after_backward=updates_after_backward)
    # Nothing staged: a page kept free (0 would mean 1/8 of DRAM).
    staging = choice.info["staging_slots"] * choice.info["slot_bytes"] or 4096
    return choice, {"state_placement": state_placement or "planned",
                    "nvme_staging_bytes": staging + choice.info["grad_fetch_bytes"]}
