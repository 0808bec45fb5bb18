"""What streaming blocks takes of each tier, asked of the library (strata_layout_query): the
default budgets, the pinned part of the DRAM arena, the grads' and accumulators' bytes, and the
per-layer sizes a placement weighs. Re-exported by strata.core."""
import ctypes

from . import _lib
from ._abi import DTYPES, GRAD_SUMS, GRAD_TIERS, MASTER_LAYOUTS, OPTIMIZERS
from .errors import check

L = _lib.lib

# The dtype a layout is asked for, by element size: 2 bytes is bf16 (bf16 and f16 take the same
# bytes; only a split master, which needs bf16, tells them apart).
_LAYOUT_DTYPES = {4: "float32", 2: "bfloat16"}
_LAYOUT_LAYER_FIELDS = ("weight_bytes", "grad_bytes", "grad_hbm_bytes", "state_bytes",
                        "update_elements")


def layout_sizes(blocks, element_size, frozen=None, master_layout="separate", grads="dram",
                 staging_slots=4, nvme_budget=0, optimizer="adamw", momentum=False,
                 grad_sum="accumulator"):
    """What streaming `blocks` (per block, the element counts of its trainable tensors;
    `frozen`: of its frozen ones, weights only) in elements of `element_size` bytes takes of
    each tier, by the runtime's own rules (strata_layout_query): a dict of
    strata_layout_totals_t's fields (the default budgets dram_bytes, streaming_dram_bytes,
    streaming_hbm_bytes and nvme_bytes, the grad fetch buffer, the staging slot, the tiers'
    margins, nvme_placeable_bytes of an NVMe tier of `nvme_budget` bytes or of nvme_bytes) and
    "layers": per block a dict of strata_layout_layer_t's fields. grads: "dram" or "hbm";
    grad_sum: a key of GRAD_SUMS ("in_place" needs grads "hbm": the grads are counted as fp32
    sums in HBM and need no accumulators); optimizer: a key of OPTIMIZERS ("sgd" with a momentum
    buffer if `momentum`); staging_slots: the slots dram_bytes keeps room for."""
    if element_size not in _LAYOUT_DTYPES:
        raise ValueError("element_size %r: streamed weights are 2 (bf16, f16) or 4 (f32) bytes"
                         % (element_size,))
    for name, value, table in (("master_layout", master_layout, MASTER_LAYOUTS),
                               ("grads", grads, GRAD_TIERS), ("optimizer", optimizer, OPTIMIZERS),
                               ("grad_sum", grad_sum, GRAD_SUMS)):
        if value not in table:
            raise ValueError("%s %r is not one of %s" % (name, value, ", ".join(table)))
    frozen = frozen or [[] for _ in blocks]
    q = _lib.LayoutRequest()
    check(L.strata_layout_request_init(ctypes.byref(q)))
    q.dtype = DTYPES[_LAYOUT_DTYPES[element_size]]
    q.optimizer = OPTIMIZERS[optimizer]
    q.sgd_momentum = 1 if momentum else 0
    q.master_layout = MASTER_LAYOUTS[master_layout]
    q.grad_tier = GRAD_TIERS[grads]
    q.grad_sum = GRAD_SUMS[grad_sum]
    q.staging_slots = int(staging_slots)
    q.nvme_budget_bytes = int(nvme_budget)
    q.layer_count = len(blocks)
    arrays = []  # kept alive through the call
    for counts_field, elements_field, lists in (
            ("trainable_counts", "trainable_elements", blocks),
            ("frozen_counts", "frozen_elements", frozen)):
        counts = (ctypes.c_uint32 * max(1, len(lists)))(*[len(b) for b in lists])
        flat = [int(n) for b in lists for n in b]
        elements = (ctypes.c_uint64 * max(1, len(flat)))(*flat)
        arrays += [counts, elements]
        setattr(q, counts_field, counts)
        setattr(q, elements_field, elements)
    layers = (_lib.LayoutLayer * max(1, len(blocks)))()
    for layer in layers:
        layer.struct_size = ctypes.sizeof(_lib.LayoutLayer)
    totals = _lib.LayoutTotals()
    check(L.strata_layout_query(ctypes.byref(q), layers, ctypes.byref(totals)))
    out = {name: getattr(totals, name) for name, _ in _lib.LayoutTotals._fields_
           if name != "struct_size"}
    out["layers"] = [{name: getattr(layer, name) for name in _LAYOUT_LAYER_FIELDS}
                     for layer in layers[:len(blocks)]]
    return out


def streaming_budgets(block_params, element_size, master_layout="separate", grads="dram",
                      grad_sum="accumulator"):
    """Default (HBM, DRAM) budgets in bytes for streaming blocks of `block_params` parameters
    each, stored in elements of `element_size` bytes and trained with AdamW
    (strata_layout_totals_t's streaming_hbm_bytes and streaming_dram_bytes): DRAM holds each
    parameter's weight and grad plus fp32 m and v and, unless the weights are fp32 (their own
    masters), an fp32 master (a split one: its low halves), with 2% for the state's page
    alignment and 256 MiB; HBM holds slots for a few blocks (weights and grad buffers) and the
    planner's margin. grads="hbm": the grads live in HBM instead (docs/optimizer.md, "Grads on
    the device"), and DRAM holds only the buffer the optimizer reads one block's grads
    through; with grad_sum="in_place" those grads are fp32 sums (4 bytes a parameter of HBM,
    and the buffer sized for them)."""
    t = layout_sizes([[n] for n in block_params], element_size, master_layout=master_layout,
                     grads=grads, grad_sum=grad_sum)
    return t["streaming_hbm_bytes"], t["streaming_dram_bytes"]


def pinned_dram(blocks, element_size, dram_budget, frozen=None, master_layout="separate",
                grads="dram", grad_sum="accumulator"):
    """The DRAM arena's part to pin (Runtime(dram_pinned=...),
    strata_runtime_config_t.dram_pinned_bytes) for streaming `blocks` (per block, its trainable
    tensors' element counts; `frozen`: its frozen ones'), each tensor registered on its own:
    what the GPU's copies read or write (strata_layout_totals_t.dram_gpu_bytes: the weights,
    the grads in DRAM or HBM-homed grads' fetch buffer, the arena's margin). The optimizer's
    state, staging and accumulators (the CPU's only) stay unpinned, so the arena's set-up is
    bound by its fault-in rather than the driver's registration. 0 (all pinned) when that is
    `dram_budget` or more, or there are no blocks. No margin beyond the library's: a block the
    pinned part has no room for goes to the unpinned one (a pageable copy, counted in
    tier_usage("dram")["dram_fallbacks"]), never fails."""
    if not blocks:
        return 0
    gpu = layout_sizes(blocks, element_size, frozen, master_layout, grads,
                       grad_sum=grad_sum)["dram_gpu_bytes"]
    return 0 if gpu >= dram_budget else gpu


def grads_hbm_bytes(block_params, element_size, grad_sum="accumulator"):
    """HBM the streamed blocks' grads take when they live there: their bytes (as fp32 sums with
    grad_sum="in_place"), 1% and 64 KiB a block for the HBM arena's per-tensor alignment
    (strata_layout_totals_t.grad_hbm_bytes)."""
    return layout_sizes([[n] for n in block_params], element_size, grads="hbm",
                        grad_sum=grad_sum)["grad_hbm_bytes"]


def accum_bytes(blocks, element_size, grads="dram", grad_sum="accumulator"):
    """DRAM the optimizer's fp32 gradient accumulators take when a backward pass adds to grads
    not zeroed since the last one (explicit update mode: one per trainable tensor, created at
    the first accumulation): each one's 4 KiB pages and a page, summed
    (strata_layout_totals_t.accum_bytes; `blocks`: per block, its trainable tensors' element
    counts, or one count for the block). The optimizer puts them in DRAM when its free space
    holds them, else the last layers' on NVMe, staged; with neither, the accumulating step
    fails, naming these numbers. Grads summed in place (grads="hbm", grad_sum="in_place") need
    none: 0."""
    blocks = [b if isinstance(b, (list, tuple)) else [b] for b in blocks]
    return layout_sizes(blocks, element_size, grads=grads, grad_sum=grad_sum)["accum_bytes"]


def state_bytes_per_param(element_size, master_layout="separate"):
    """AdamW's state per parameter: m and v, and an fp32 master unless the weight is fp32 (a
    split master: its low halves, 2 bytes; the bf16 weight is the rest): what the optimizer
    allocates (strata_layout_totals_t.state_bytes_per_element)."""
    return layout_sizes([[1]], element_size, master_layout=master_layout)[
        "state_bytes_per_element"]


# DRAM beyond the tensors' rounded sizes, with state on NVMe (the arena's own alignment): the
# library's figure (strata_layout_totals_t.dram_margin_bytes).
NVME_DRAM_MARGIN = layout_sizes([[1]], 2)["dram_margin_bytes"]


def placement_layers(blocks, element_size, frozen=None, state_tier="choose",
                     master_layout="separate", grads="dram", grad_sum="accumulator"):
    """Per block, the sizes a placement (place()) weighs for streaming `blocks` (per block, the
    element counts of its trainable tensors; `frozen`: of its frozen ones, weights only) with
    AdamW, as strata_layout_query counts them: bf16/f16/f32 weights and grads, each at the DRAM
    arena's 4 KiB rounding and a page more, and the state (an fp32 master unless the weights
    are fp32, m, v) as the optimizer's PLANNED placement counts a param's state (its bytes, 1/64
    more and 24 KiB), so a placement never plans more into DRAM than the optimizer then puts
    there. grads="hbm": the grads live on the device (grad_tier "hbm"), and grad_bytes is what
    one read of them copies to DRAM, as the optimizer lays them out (the placement keeps one
    buffer of the largest block's: grad_fetch_bytes; fp32 sums with grad_sum="in_place"). Each
    dict also carries what it was computed from (key "_layout"), for full_dram and
    layout_totals."""
    if not blocks:
        return []
    frozen = frozen or [[] for _ in blocks]
    sizes = layout_sizes(blocks, element_size, frozen, master_layout, grads, grad_sum=grad_sum)
    return [{"weight_bytes": s["weight_bytes"], "grad_bytes": s["grad_bytes"],
             "state_bytes": s["state_bytes"], "update_elements": s["update_elements"],
             "state_tier": state_tier, "grad_tier": grads,
             "_layout": (list(b), list(f), element_size, master_layout, grads, grad_sum)}
            for s, b, f in zip(sizes["layers"], blocks, frozen)]


def layout_totals(layers, staging_slots=4, nvme_budget=0):
    """strata_layout_query's totals (layout_sizes) for `layers` made by placement_layers (in
    any order or combination of such lists, made with one element size, master layout, grads
    and grad sum): the default DRAM budget for `staging_slots` slots (dram_bytes), the NVMe tier's
    margins, its default budget (nvme_bytes) and what a placement may put on a tier of
    `nvme_budget` bytes (nvme_placeable_bytes; of nvme_bytes when 0)."""
    made = [layer.get("_layout") for layer in layers]
    if not made or None in made:
        raise ValueError("layout_totals and full_dram take the layers placement_layers made")
    kinds = {m[2:] for m in made}
    if len(kinds) != 1:
        raise ValueError("the layers were made with different element sizes, master layouts, "
                         "grads or grad sums: %s" % sorted(kinds))
    element_size, master_layout, grads, grad_sum = kinds.pop()
    return layout_sizes([m[0] for m in made], element_size, [m[1] for m in made], master_layout,
                        grads, staging_slots=staging_slots, nvme_budget=nvme_budget,
                        grad_sum=grad_sum)


def grad_fetch_bytes(blocks, element_size, grad_sum="accumulator"):
    """DRAM the optimizer reads HBM-homed grads through (strata_layout_totals_t's
    grad_fetch_bytes): the largest block's grads (fp32 sums with grad_sum="in_place"), each
    64-byte aligned, rounded to the arena's pages, and a page."""
    return layout_sizes(blocks, element_size, grads="hbm",
                        grad_sum=grad_sum)["grad_fetch_bytes"]


def full_dram(layers, slots=4):
    """DRAM for `layers` (placement_layers) with every tensor in DRAM, room to stage `slots`
    blocks' state, and the arena's margin: what host_budget defaults to, at most
    (strata_layout_totals_t.dram_bytes)."""
    return layout_totals(layers, staging_slots=slots)["dram_bytes"]
