"""The step-memory plan (strata_step_plan_*, strata.h "Step-memory plan"): what keeps one
training step inside the device's and the host's memory, decided by libstrata for every binding.

A binding measures (its allocator, its blocks' saved bytes, its batch) and passes what it knows
as a profile; the library decides, per block, resident or streamed, recompute / keep
selectively / keep wholly, and its checkpoint's home (the device or host memory), and for the
step the loss chunk, the host budget as counted, what a backward block may allocate and the
sequence tiles the blocks' MLP runs over at a long sequence (mlp_token_bytes, mlp_tiles), and how
much optimizer state an NVMe tier should take so that host memory holds the spilled checkpoints
(state_dram_bytes, nvme_free_bytes in; state_nvme_bytes, state_tier out). Every
decision and constant is the library's (runtime/step/); nothing here decides.

    plan = plan_step([Block(elements=n) for n in counts], device_total_bytes=...,
                     device_free_bytes=..., resident_bytes_per_param=16)
    plan.resident_blocks, plan.blocks[i]["keep"], plan.text
"""

import ctypes

from . import _lib, core
from .errors import check

L = _lib.lib

RESIDENCY = {"choose": 0, "resident": 1, "streamed": 2}
KEEP = {"recompute": 0, "selective": 1, "whole": 2}
# The points that end a measured step's intervals: a block's forward start ("f"), its backward
# start ("b"), the step's end ("end").
POINTS = {"f": 0, "b": 1, "end": 2}
# strata_step_profile_t.flags, by the keyword plan_step takes each as (True: set).
FLAGS = {"plan_checkpoints": 1 << 0, "plan_kept": 1 << 1, "allocator_returns_cache": 1 << 8,
         "block_saved_measured": 1 << 9, "loss_chunked": 1 << 10}
# strata_step_plan_info_t.planned, by the attribute StepPlan gives each as.
PLANNED = {"residency_planned": 1 << 0, "checkpoints_planned": 1 << 1, "keep_planned": 1 << 2}
# strata_step_plan_info_t.state_tier_reason (STRATA_STEP_STATE_*), by the name StepPlan gives it
# as info["state_tier"].
STATE_REASONS = {"not_planned": 0, "room": 1, "move": 2, "device_short": 3, "no_nvme": 4,
                 "no_state": 5, "too_little": 6}
_TIERS = {0: "hbm", 1: "dram"}
_NAMES = {"residency": {v: k for k, v in RESIDENCY.items()},
          "keep": {v: k for k, v in KEEP.items()}}
# The profile's scalar fields (strata_step_profile_t's, less the arrays).
FIELDS = tuple(name for name, _ in _lib.StepProfile._fields_
               if name not in ("struct_size", "blocks", "block_count", "interval_count",
                               "intervals", "flags"))


class Block:
    """One block of the profile (strata_step_block_t): its parameters, of them this process's
    (data parallel; 0 = all), what it saves for its backward when not recomputing, wholly and
    selectively (0: unmeasured / cannot), its residency ("choose", or fixed: "resident",
    "streamed"), how it keeps now ("recompute", "selective", "whole") and its forward's FLOPs a
    token through its weights (0: a dense block's 2 x elements; strata.torch._planning.
    active_flops measures a mixture-of-experts block's)."""

    __slots__ = ("elements", "rank_elements", "keep_whole_bytes", "keep_selective_bytes",
                 "residency", "keep", "active_flops")

    def __init__(self, elements, rank_elements=0, keep_whole_bytes=0, keep_selective_bytes=0,
                 residency="choose", keep="recompute", active_flops=0):
        self.elements, self.rank_elements = int(elements), int(rank_elements)
        self.keep_whole_bytes = int(keep_whole_bytes or 0)
        self.keep_selective_bytes = int(keep_selective_bytes or 0)
        self.residency, self.keep = residency, keep
        self.active_flops = int(active_flops or 0)


class StepPlan:
    """A plan: `info` (strata_step_plan_info_t's fields: mlp_tiles and mlp_tile_tokens among
    them; state_nvme_bytes, the optimizer state it advises on NVMe, with state_tier its reason's
    STATE_REASONS name), `blocks` (per block a dict of residency, keep, checkpoint: "hbm" or "dram",
    group_start: the block whose checkpoint its input is regenerated from, its own index where
    it keeps one, mlp_tiles: the sequence tiles its MLP runs over, 1: whole, and
    transfer_bound: its weights load slower than it computes at the profile's batch), `text` and
    `json` (the dumps, every choice with its reason)."""

    def __init__(self, handle):
        info = _lib.StepPlanInfo()
        check(L.strata_step_plan_get_info(handle, ctypes.byref(info)))
        self.info = {name: getattr(info, name) for name, _ in _lib.StepPlanInfo._fields_
                     if name != "struct_size"}
        self.info.update({name: bool(info.planned & bit) for name, bit in PLANNED.items()})
        self.info["state_tier"] = {v: k for k, v in STATE_REASONS.items()}[info.state_tier_reason]
        self.blocks = []
        for i in range(info.blocks):
            b = _lib.StepBlock()
            check(L.strata_step_plan_get_block(handle, i, ctypes.byref(b)))
            self.blocks.append({"residency": _NAMES["residency"][b.residency],
                                "keep": _NAMES["keep"][b.keep],
                                "checkpoint": _TIERS[b.checkpoint_tier],
                                "group_start": b.group_start,
                                "mlp_tiles": b.mlp_tiles,
                                "transfer_bound": bool(b.transfer_bound)})
        self.text = core._dump(L.strata_step_plan_dump, handle, 1)
        self.json = core._dump(L.strata_step_plan_dump, handle, 0)

    def __getattr__(self, name):
        try:
            return self.__dict__["info"][name]
        except KeyError:
            raise AttributeError(name) from None

    def keeps(self):
        """Per block its keep mode, None for a block that recomputes."""
        return [None if b["keep"] == "recompute" else b["keep"] for b in self.blocks]


def _fitting(name, value, ctype):
    """int(value), refused unless its unsigned C field holds it (ctypes would wrap it)."""
    value = int(value)
    if not 0 <= value < 1 << (8 * ctypes.sizeof(ctype)):
        raise ValueError("strata.step_plan: %s is %d, not a %d-bit unsigned value"
                         % (name, value, 8 * ctypes.sizeof(ctype)))
    return value


def plan_step(blocks, intervals=(), **fields):
    """Plan the step (strata_step_plan_create). `blocks`: Block per block, model order.
    `intervals`: a measured step's (point, block, allocated peak, reserved peak), point one of
    POINTS. `fields`: the profile's scalars by their strata_step_profile_t names (FIELDS), and
    its flags by FLAGS' names (true: set); an unknown one is a ValueError, a value that does not
    fit its field too (ctypes would wrap it). Errors of the library (a profile it refuses)
    raise as strata.errors says."""
    flags = 0
    for name in [k for k in fields if k in FLAGS]:
        flags |= FLAGS[name] if fields.pop(name) else 0
    unknown = set(fields) - set(FIELDS)
    if unknown:
        raise ValueError("strata.step_plan: unknown profile field(s) %s; known: %s"
                         % (sorted(unknown), ", ".join(FIELDS)))
    structs = []
    for i, block in enumerate(blocks):
        d = _lib.StepBlock()
        check(L.strata_step_block_init(ctypes.byref(d)))
        for key in ("elements", "rank_elements", "keep_whole_bytes", "keep_selective_bytes",
                    "active_flops"):
            setattr(d, key, _fitting("block %d's %s" % (i, key), getattr(block, key),
                                     ctypes.c_uint64))
        for key, table in (("residency", RESIDENCY), ("keep", KEEP)):
            value = getattr(block, key)
            if value not in table:
                raise ValueError("strata.step_plan: block %d's %s %r is not one of %s"
                                 % (i, key, value, ", ".join(table)))
            setattr(d, key, table[value])
        structs.append(d)
    points = []
    for i, (point, block, allocated, reserved) in enumerate(intervals):
        if point not in POINTS:
            raise ValueError("strata.step_plan: interval %d's point %r is not one of %s"
                             % (i, point, ", ".join(POINTS)))
        t = _lib.StepInterval()
        check(L.strata_step_interval_init(ctypes.byref(t)))
        t.point = POINTS[point]
        t.block = _fitting("interval %d's block" % i, block, ctypes.c_uint32)
        t.allocated_peak_bytes = _fitting("interval %d's allocated peak" % i, allocated,
                                          ctypes.c_uint64)
        t.reserved_peak_bytes = _fitting("interval %d's reserved peak" % i, reserved,
                                         ctypes.c_uint64)
        points.append(t)
    q = _lib.StepProfile()
    check(L.strata_step_profile_init(ctypes.byref(q)))
    block_array = (ctypes.POINTER(_lib.StepBlock) * max(1, len(structs)))(
        *[ctypes.pointer(d) for d in structs])
    interval_array = (ctypes.POINTER(_lib.StepInterval) * max(1, len(points)))(
        *[ctypes.pointer(t) for t in points])
    q.blocks, q.block_count = block_array, len(structs)
    q.intervals, q.interval_count = interval_array, len(points)
    q.flags = flags
    for key, value in fields.items():
        ctype = dict(_lib.StepProfile._fields_)[key]
        # (a rate: the library refuses a negative or non-finite one, naming it)
        setattr(q, key, float(value) if ctype is ctypes.c_double else _fitting(key, value, ctype))
    handle = ctypes.c_void_p()
    check(L.strata_step_plan_create(ctypes.byref(q), ctypes.byref(handle)))
    try:
        return StepPlan(handle)
    finally:
        L.strata_step_plan_destroy(handle)
