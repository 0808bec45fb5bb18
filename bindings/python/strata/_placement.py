"""Where a streamed model's weights and optimizer state should live (strata_placement_*):
place() and the Placement it returns. Re-exported by strata.core."""
import ctypes

from . import _lib
from ._abi import GRAD_TIERS, dump_text
from .errors import check

L = _lib.lib

_HOMES = {"choose": -1, "dram": 1, "nvme": 2}
_PLACEMENT_RATES = ("h2d", "d2h", "nvme_read", "nvme_write", "nvme_mixed", "update_elements")


class Placement:
    """Where a streamed model's weights and optimizer state should live (strata_placement_*):
    `homes` per layer ("dram" or "nvme" for its weights and its state), `info` (a dict of
    strata_placement_info_t's fields: staging slots, bytes per tier, the rates used and the
    predicted step with each resource's busy time), `text` and `json` (the dumps)."""

    def __init__(self, handle):
        info = _lib.PlacementInfo()
        check(L.strata_placement_get_info(handle, ctypes.byref(info)))
        self.info = {name: getattr(info, name) for name, _ in _lib.PlacementInfo._fields_
                     if name != "struct_size"}
        self.info["bottleneck"] = info.bottleneck.decode()
        names = {1: "dram", 2: "nvme"}
        self.homes = []
        for i in range(info.layers):
            w, st = ctypes.c_int32(), ctypes.c_int32()
            check(L.strata_placement_get_layer(handle, i, ctypes.byref(w), ctypes.byref(st)))
            self.homes.append((names[w.value], names[st.value]))
        self.text = dump_text(L.strata_placement_dump, handle, 1)
        self.json = dump_text(L.strata_placement_dump, handle, 0)



def place(layers, runtime=None, dram_budget=0, nvme_budget=0, staging_slots=0,
          max_staging_slots=4, prefetch_depth=1, other_device_seconds=0.0, rates=None,
          updates_after_backward=True):
    """Choose where each layer's weights and optimizer state live (strata_placement_create).

    layers: per layer (forward order) a dict with weight_bytes, grad_bytes, state_bytes,
    update_elements, and optionally name, forward_seconds, backward_seconds, weight_tier and
    state_tier ("choose", the default, "dram" or "nvme") and grad_tier ("dram", the default,
    or "hbm": grads on the device, read through one DRAM buffer). rates: h2d, d2h, nvme_read,
    nvme_write (bytes/s), nvme_mixed (0.5..1), update_elements (per second); one missing or 0
    is measured on `runtime` (or not counted without one). Budgets 0: what the runtime's tiers
    have free. Returns a Placement."""
    rates = dict(rates or {})
    unknown = set(rates) - set(_PLACEMENT_RATES)
    if unknown:
        raise ValueError("unknown placement rate(s) %s; known: %s"
                         % (sorted(unknown), ", ".join(_PLACEMENT_RATES)))
    structs = []
    for i, layer in enumerate(layers):
        d = _lib.PlacementLayer()
        check(L.strata_placement_layer_init(ctypes.byref(d)))
        if layer.get("name") is not None:
            d.name = layer["name"].encode()
        for key in ("weight_bytes", "grad_bytes", "state_bytes", "update_elements"):
            setattr(d, key, int(layer.get(key, 0)))
        d.forward_seconds = float(layer.get("forward_seconds", 0.0))
        d.backward_seconds = float(layer.get("backward_seconds", 0.0))
        for key in ("weight_tier", "state_tier"):
            home = layer.get(key, "choose")
            if home not in _HOMES:
                raise ValueError("layer %d: %s %r is not one of %s" % (i, key, home,
                                                                      ", ".join(_HOMES)))
            setattr(d, key, _HOMES[home])
        grad_tier = layer.get("grad_tier", "dram")
        if grad_tier not in GRAD_TIERS:
            raise ValueError("layer %d: grad_tier %r is not one of %s"
                             % (i, grad_tier, ", ".join(GRAD_TIERS)))
        d.grad_tier = GRAD_TIERS[grad_tier]
        structs.append(d)
    pointers = (ctypes.POINTER(_lib.PlacementLayer) * max(1, len(structs)))(
        *[ctypes.pointer(d) for d in structs])
    q = _lib.PlacementRequest()
    check(L.strata_placement_request_init(ctypes.byref(q)))
    q.layers = pointers
    q.layer_count = len(structs)
    q.staging_slots = int(staging_slots)
    q.max_staging_slots = int(max_staging_slots)
    q.prefetch_depth = int(prefetch_depth)
    q.dram_budget_bytes = int(dram_budget)
    q.nvme_budget_bytes = int(nvme_budget)
    q.other_device_seconds = float(other_device_seconds)
    for key in _PLACEMENT_RATES:
        field = key + ("_bytes_per_second" if key in ("h2d", "d2h", "nvme_read", "nvme_write")
                       else "_per_second" if key == "update_elements" else "")
        setattr(q, field, float(rates.get(key, 0.0)))
    q.updates_after_backward = 1 if updates_after_backward else 0
    handle = ctypes.c_void_p()
    check(L.strata_placement_create(runtime.handle if runtime is not None else None,
                                    ctypes.byref(q), ctypes.byref(handle)))
    try:
        return Placement(handle)
    finally:
        L.strata_placement_destroy(handle)
