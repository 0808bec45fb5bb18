"""Pythonic owners of the C ABI's handles: Runtime, Tensor, Graph, Plan, Executor, Optimizer.
Each frees its handle on close() (or garbage collection) in the order the header requires."""
import ctypes
import os
import pathlib

from . import _lib
from .errors import check
from .dlpack import capsule_from_managed, DLPackView

L = _lib.lib

# strata.h constants (the test abi_layout checks every table against the header)
BACKENDS = {"auto": 0, "cuda": 1, "host": 2}
TIERS = {"hbm": 0, "dram": 1, "nvme": 2}
DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2, "float64": 3, "int8": 4, "uint8": 5,
          "int16": 6, "int32": 7, "int64": 8, "bool": 9}
ROLES = {"weight": 0, "grad": 1, "optimizer_state": 2, "activation": 3, "other": 4}
FORWARD, BACKWARD = 0, 1
VIEW_WEIGHT, VIEW_GRAD, VIEW_ACTIVATION = 0, 1, 2
OPTIMIZERS = {"adamw": 0, "sgd": 1, "adam": 2, "lion": 3, "adagrad": 4}
UPDATE_MODES = {"auto": 0, "explicit": 1}
STATE_PLACEMENTS = {"dram": 0, "planned": 1, "nvme": 2}
STATES = {"master": 0, "exp_avg": 1, "exp_avg_sq": 2, "grad_accum": 3, "master_low": 4}
# How a bf16 weight's fp32 master is kept (strata.h STRATA_MASTER_*): "split" keeps only its low
# halves, the weight being the rest (2 bytes per parameter instead of 4).
MASTER_LAYOUTS = {"separate": 0, "split": 1}
LINKS = ["h2d", "d2h", "nvme_read", "nvme_write"]
# Where grads live (strata.h STRATA_TIER_HBM, STRATA_TIER_DRAM).
_GRAD_TIERS = {"hbm": 0, "dram": 1}
# How a param's grad sums the backward passes between two zeroings (strata.h
# STRATA_GRAD_SUM_*): "accumulator" (each pass lands in the grad tensor, zeroed at every backward
# load; the optimizer adds it into an fp32 accumulator in DRAM or on NVMe) or "in_place" (the
# grad tensor, fp32 in HBM, is the sum: the framework adds each pass into it, and it is zeroed
# only at a backward load where the param holds no grad; no accumulator exists).
GRAD_SUMS = {"accumulator": 0, "in_place": 1}


def version():
    """The library's version, "MAJOR.MINOR.PATCH" (strata_version_string)."""
    return L.strata_version_string().decode()


def library_path():
    """The file of the libstrata this process loaded (the order in which one is chosen:
    strata._lib._find_library, docs/install.md; library_source() names the rule that chose it)."""
    return _lib.library_file


def library_source():
    """Which rule found the loaded library: "STRATA_LIBRARY", "bundled", "checkout" or
    "system"."""
    return _lib.library_source


def _beside_library(*relatives):
    lib_dir = pathlib.Path(library_path()).parent  # the link's own directory, not its target's
    return [lib_dir / r for r in relatives]


def include_dir():
    """The directory holding strata/strata.h for the loaded library, for C and C++ users
    (-I$(python -c 'import strata.core as c; print(c.include_dir())')): the wheel's strata/include,
    or an install prefix's include/, or this checkout's include/ for a build of it."""
    candidates = _beside_library("../include", "../../include") + [
        pathlib.Path(__file__).resolve().parents[3] / "include"]
    for candidate in candidates:
        if (candidate / "strata" / "strata.h").exists():
            return str(candidate.resolve())
    raise FileNotFoundError("strata/strata.h not found beside %s (looked in %s)"
                            % (library_path(), ", ".join(map(str, candidates))))


def cmake_dir():
    """The directory of the loaded library's CMake package (strataConfig.cmake), to pass as
    strata_DIR or on CMAKE_PREFIX_PATH for find_package(strata): present in the wheel and in a
    cmake --install prefix, not in a build tree."""
    for candidate in _beside_library("cmake/strata"):
        if (candidate / "strataConfig.cmake").exists():
            return str(candidate.resolve())
    raise FileNotFoundError("no CMake package beside %s: pip install . or cmake --install the "
                            "build it comes from" % library_path())


def dtype_size(dtype):
    """Bytes per element of a dtype name ("bfloat16": 2), as the library says."""
    return L.strata_dtype_size(DTYPES[dtype])


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
                               ("grads", grads, _GRAD_TIERS), ("optimizer", optimizer, OPTIMIZERS),
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
    q.grad_tier = _GRAD_TIERS[grads]
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
        self.text = _dump(L.strata_placement_dump, handle, 1)
        self.json = _dump(L.strata_placement_dump, handle, 0)


def _dump(fn, handle, format):
    """A strata_*_dump (plan, placement) as text: its length asked first, then the text."""
    n = ctypes.c_size_t()
    check(fn(handle, format, None, 0, ctypes.byref(n)))
    buf = ctypes.create_string_buffer(n.value + 1)
    check(fn(handle, format, buf, n.value + 1, ctypes.byref(n)))
    return buf.value.decode()


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
        if grad_tier not in _GRAD_TIERS:
            raise ValueError("layer %d: grad_tier %r is not one of %s"
                             % (i, grad_tier, ", ".join(_GRAD_TIERS)))
        d.grad_tier = _GRAD_TIERS[grad_tier]
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


class Runtime:
    """A Strata runtime: the device backend and the HBM, DRAM (pinned, budgeted) and NVMe tiers.

    backend: "auto" (cuda where a GPU is usable, host otherwise), "cuda" or "host".
    Budgets in bytes; nvme: list of file paths (striped) or None. dram_fault_threads: threads
    that fault the DRAM arena in at creation (0: the library's default, one per core up to its
    cap)."""

    def __init__(self, backend="auto", hbm_budget=0, dram_budget=0, nvme=None, nvme_budget=0,
                 device=0, dram_fault_threads=0, dram_pinned=0):
        # dram_pinned: the DRAM arena's pinned part (strata_runtime_config_t.dram_pinned_bytes),
        # 0 = all of it.
        config = _lib.RuntimeConfig()
        check(L.strata_runtime_config_init(ctypes.byref(config)))
        config.dram_pinned_bytes = int(dram_pinned)
        config.device_backend = BACKENDS[backend]
        config.device_ordinal = device
        config.dram_fault_threads = int(dram_fault_threads)
        config.hbm_budget_bytes = int(hbm_budget)
        config.dram_budget_bytes = int(dram_budget)
        config.nvme_budget_bytes = int(nvme_budget)
        self._paths = None
        if isinstance(nvme, (str, bytes, os.PathLike)):
            nvme = [nvme]  # one path, not a sequence of characters
        if nvme:
            self._paths = (ctypes.c_char_p * len(nvme))(*[os.fsencode(p) for p in nvme])
            config.nvme_paths = self._paths
            config.nvme_path_count = len(nvme)
        handle = ctypes.c_void_p()
        check(L.strata_runtime_create(ctypes.byref(config), ctypes.byref(handle)))
        self._handle = handle
        self._owned = []  # graphs, plans, executors, optimizers: closed before the runtime

    @property
    def handle(self):
        if self._handle is None:
            raise ValueError("the runtime is closed")
        return self._handle

    def capabilities(self):
        caps = _lib.Capabilities()
        check(L.strata_runtime_capabilities(self.handle, ctypes.byref(caps)))
        return caps

    @property
    def backend(self):
        return {v: k for k, v in BACKENDS.items()}[self.capabilities().device_backend]

    def tier_usage(self, tier):
        u = _lib.TierUsage()
        check(L.strata_runtime_tier_usage(self.handle, TIERS[tier], ctypes.byref(u)))
        return {"budget": u.budget_bytes, "used": u.used_bytes, "largest_free": u.largest_free_bytes,
                "tensors": u.tensor_count, "pinned_budget": u.pinned_budget_bytes,
                "pinned_used": u.pinned_used_bytes, "dram_fallbacks": u.dram_fallbacks}

    def link_stats(self):
        out = {}
        for i, name in enumerate(LINKS):
            s = _lib.LinkStats()
            check(L.strata_runtime_link_stats(self.handle, i, ctypes.byref(s)))
            out[name] = {"bytes": s.bytes, "transfers": s.transfers, "busy_seconds": s.busy_ns * 1e-9}
        return out

    def reset_stats(self):
        check(L.strata_runtime_reset_stats(self.handle))

    def register(self, name, shape, dtype="float32", role="other", tier="dram"):
        shape = [int(d) for d in shape]
        dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        desc = _lib.TensorDesc(name=name.encode(), dtype=DTYPES[dtype], ndim=len(shape),
                               shape=dims, role=ROLES[role], home_tier=TIERS[tier])
        handle = ctypes.c_void_p()
        check(L.strata_tensor_register(self.handle, ctypes.byref(desc), ctypes.byref(handle)))
        return Tensor(self, handle)

    def trace_start(self):
        check(L.strata_trace_start(self.handle, None))

    def trace_flush(self, path):
        check(L.strata_trace_stop(self.handle))
        check(L.strata_trace_flush(self.handle, str(path).encode()))

    def save_checkpoint(self, path, optimizer=None):
        check(L.strata_checkpoint_save(self.handle, optimizer.handle if optimizer else None,
                                       str(path).encode()))

    def load_checkpoint(self, path, optimizer=None):
        check(L.strata_checkpoint_load(self.handle, optimizer.handle if optimizer else None,
                                       str(path).encode()))

    def close(self):
        if self._handle is None:
            return
        for obj in reversed(self._owned):
            obj.close()
        self._owned.clear()
        handle, self._handle = self._handle, None
        check(L.strata_runtime_destroy(handle))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Tensor:
    """A registered tensor (the handle stays valid until unregister())."""

    def __init__(self, runtime, handle):
        self.runtime = runtime
        self.handle = handle

    def info(self):
        i = _lib.TensorInfo()
        check(L.strata_tensor_get_info(self.runtime.handle, self.handle, ctypes.byref(i)))
        return i

    @property
    def name(self):
        return self.info().name.decode()

    @property
    def nbytes(self):
        return self.info().nbytes

    def write(self, data, offset=0):
        """Copy a bytes-like or contiguous buffer (anything with the buffer protocol) in."""
        view = memoryview(data).cast("B")
        buf = (ctypes.c_char * len(view)).from_buffer_copy(view) if view.readonly else \
            (ctypes.c_char * len(view)).from_buffer(view)
        check(L.strata_tensor_write(self.runtime.handle, self.handle, offset, buf, len(view)))

    def write_pointer(self, pointer, nbytes, offset=0):
        check(L.strata_tensor_write(self.runtime.handle, self.handle, offset, pointer, nbytes))

    def read(self, nbytes=None, offset=0):
        n = self.nbytes - offset if nbytes is None else nbytes
        buf = ctypes.create_string_buffer(n)
        check(L.strata_tensor_read(self.runtime.handle, self.handle, offset, buf, n))
        return buf.raw

    def data_pointer(self):
        """The address of the data in its tier (a pinned host pointer in DRAM, a device pointer
        in HBM on cuda); valid until the tensor moves or is unregistered."""
        out = ctypes.c_void_p()
        check(L.strata_tensor_data_pointer(self.runtime.handle, self.handle, ctypes.byref(out)))
        return out.value

    def read_pointer(self, pointer, nbytes, offset=0):
        check(L.strata_tensor_read(self.runtime.handle, self.handle, offset, pointer, nbytes))

    def __dlpack__(self, stream=None, max_version=None, **kwargs):
        out = ctypes.POINTER(_lib.DLManagedTensorVersioned)()
        check(L.strata_tensor_export_dlpack(self.runtime.handle, self.handle, ctypes.byref(out)))
        return capsule_from_managed(out, max_version)

    def __dlpack_device__(self):
        out = ctypes.POINTER(_lib.DLManagedTensorVersioned)()
        check(L.strata_tensor_export_dlpack(self.runtime.handle, self.handle, ctypes.byref(out)))
        device = (out.contents.dl_tensor.device.device_type, out.contents.dl_tensor.device.device_id)
        out.contents.deleter(out)
        return device

    def unregister(self):
        check(L.strata_tensor_unregister(self.runtime.handle, self.handle))


class Executor:
    """A graph of layers, planned and executed: the streaming loop's handle.

    layers: list of dicts {"name", "weights": [Tensor], "grads": [Tensor],
    "forward_flops", "backward_flops"}."""

    def __init__(self, runtime, layers, slot_budget=0, micro_batches=1, residents=()):
        self.runtime = runtime
        self._graph = ctypes.c_void_p()
        self._plan = ctypes.c_void_p()
        self._handle = ctypes.c_void_p()
        check(L.strata_graph_create(runtime.handle, ctypes.byref(self._graph)))
        try:
            for i, layer in enumerate(layers):
                w = (ctypes.c_void_p * len(layer["weights"]))(*[t.handle.value for t in layer["weights"]])
                grads = layer.get("grads", [])
                g = (ctypes.c_void_p * max(len(grads), 1))(*[t.handle.value for t in grads])
                desc = _lib.LayerDesc(name=layer.get("name", "layer.%d" % i).encode(), weights=w,
                                      weight_count=len(layer["weights"]), grads=g,
                                      grad_count=len(grads),
                                      forward_flops=layer.get("forward_flops", 0.0),
                                      backward_flops=layer.get("backward_flops", 0.0))
                check(L.strata_graph_add_layer(self._graph, ctypes.byref(desc), None))
            for t in residents:
                check(L.strata_graph_add_resident(self._graph, t.handle))
            config = _lib.PlanConfig()
            check(L.strata_plan_config_init(ctypes.byref(config)))
            config.hbm_slot_budget_bytes = int(slot_budget)
            config.micro_batches = micro_batches
            check(L.strata_plan_create(self._graph, ctypes.byref(config), ctypes.byref(self._plan)))
            check(L.strata_executor_create(self._plan, ctypes.byref(self._handle)))
        except BaseException:
            self.close()
            raise
        runtime._owned.append(self)

    @property
    def handle(self):
        return self._handle

    def plan_info(self):
        info = _lib.PlanInfo()
        check(L.strata_plan_get_info(self._plan, ctypes.byref(info)))
        return info

    def plan_text(self):
        return _dump(L.strata_plan_dump, self._plan, 1)

    def stats(self):
        s = _lib.ExecutorStats()
        check(L.strata_executor_get_stats(self._handle, ctypes.byref(s)))
        return {k: getattr(s, k) for k in ("steps", "loads", "reused_loads", "bytes_in", "bytes_out")}

    def step_begin(self):
        check(L.strata_step_begin(self._handle))

    def step_end(self):
        check(L.strata_step_end(self._handle))

    def step_abort(self, stream=None):
        """Abandon the running step (no-op without one): the next step_begin starts afresh."""
        check(L.strata_step_abort(self._handle, stream))

    def acquire(self, layer, phase, stream=None, host_wait=False):
        """host_wait: block this thread until the layer's data is in HBM (for frameworks whose
        streams Strata cannot see, such as JAX); else `stream` is made to wait."""
        views = _lib.LayerViews()
        check(L.strata_layer_acquire(self._handle, layer, phase, stream, 2 if host_wait else 0,
                                     ctypes.byref(views)))
        return views

    def write_view(self, layer, phase, role, index, pointer, nbytes):
        """Copy nbytes from a device or host address into a view (synchronously)."""
        check(L.strata_layer_write_view(self._handle, layer, phase, role, index, pointer, nbytes))

    def release(self, layer, phase, stream=None):
        check(L.strata_layer_release(self._handle, layer, phase, stream))

    def view(self, layer, phase, role, index):
        """A DLPack producer for one view of the acquired layer (valid until release)."""
        out = ctypes.POINTER(_lib.DLManagedTensorVersioned)()
        check(L.strata_layer_export_dlpack(self._handle, layer, phase, role, index,
                                           ctypes.byref(out)))
        return DLPackView(out)

    def close(self):
        if self._handle:
            h, self._handle = self._handle, ctypes.c_void_p()
            check(L.strata_executor_destroy(h))
        if self._plan:
            check(L.strata_plan_destroy(self._plan))
            self._plan = ctypes.c_void_p()
        if self._graph:
            check(L.strata_graph_destroy(self._graph))
            self._graph = ctypes.c_void_p()


class Optimizer:
    """The runtime's optimizer (AdamW, SGD, Adam, Lion or Adagrad: `kind`, a key of OPTIMIZERS)
    over DRAM weights: fp32 masters and state."""

    def __init__(self, runtime, kind="adamw", update_mode="auto", state_placement="dram",
                 **hyper):
        config = _lib.OptimizerConfig()
        check(L.strata_optimizer_config_init(OPTIMIZERS[kind], ctypes.byref(config)))
        config.update_mode = UPDATE_MODES[update_mode]
        if state_placement not in STATE_PLACEMENTS:
            raise ValueError("state_placement %r is not one of %s"
                             % (state_placement, ", ".join(STATE_PLACEMENTS)))
        config.state_placement = STATE_PLACEMENTS[state_placement]
        for key, value in hyper.items():
            if not hasattr(config, key) or key == "struct_size":
                raise ValueError("unknown optimizer setting %r" % key)
            setattr(config, key, value)
        self.runtime = runtime
        self._handle = ctypes.c_void_p()
        check(L.strata_optimizer_create(runtime.handle, ctypes.byref(config), ctypes.byref(self._handle)))
        runtime._owned.append(self)

    @property
    def handle(self):
        return self._handle

    def add_param(self, weight, grad, group=0, master_layout="separate", grad_sum="accumulator"):
        """Make `weight` (with its grad tensor `grad`) a param of group `group`. master_layout:
        a key of MASTER_LAYOUTS; grad_sum: a key of GRAD_SUMS ("in_place": `grad` is an fp32
        tensor in HBM that the framework adds every backward pass's grad into, and the sum the
        update reads; strata_param_desc_t.grad_sum)."""
        for name, value, table in (("master_layout", master_layout, MASTER_LAYOUTS),
                                   ("grad_sum", grad_sum, GRAD_SUMS)):
            if value not in table:
                raise ValueError("%s must be one of %s, not %r" % (name, sorted(table), value))
        desc = _lib.ParamDesc(weight=weight.handle.value, grad=grad.handle.value, group=group,
                              master_layout=MASTER_LAYOUTS[master_layout],
                              grad_sum=GRAD_SUMS[grad_sum])
        check(L.strata_optimizer_add_param(self._handle, ctypes.byref(desc)))

    def master_read(self, weight, pointer, count):
        """The param's fp32 master (any layout or tier) into `count` floats at `pointer`."""
        check(L.strata_optimizer_master_read(self._handle, weight.handle, pointer, count))

    def master_write(self, weight, pointer, count):
        """Set the param's fp32 master from `count` floats at `pointer`, and its weight to it
        rounded (as an update writes them)."""
        check(L.strata_optimizer_master_write(self._handle, weight.handle, pointer, count))

    def set_group(self, group, lr, weight_decay, betas=None, eps=None):
        """A group's lr and weight decay and, when given, AdamW's betas and eps: read by the
        next update that has not started (torch reads its param groups at every step)."""
        if betas is None and eps is None:
            check(L.strata_optimizer_set_group(self._handle, group, lr, weight_decay))
            return
        # Every field given (what strata.torch passes at each step): nothing to read first.
        whole = betas is not None and eps is not None
        h = _lib.GroupHyperparams() if whole else self.group(group)
        h.lr, h.weight_decay = lr, weight_decay
        if betas is not None:
            h.beta1, h.beta2 = betas
        if eps is not None:
            h.eps = eps
        check(L.strata_optimizer_set_group_hyperparams(self._handle, group, ctypes.byref(h)))

    def group(self, group):
        """The group's current hyperparameters (a GroupHyperparams: lr, weight_decay, beta1,
        beta2, eps); a group not created yet reads as group 0."""
        h = _lib.GroupHyperparams()
        check(L.strata_optimizer_get_group(self._handle, group, ctypes.byref(h)))
        return h

    def attach(self, executor):
        check(L.strata_optimizer_attach(self._handle, executor.handle))

    def step(self):
        check(L.strata_optimizer_step(self._handle))

    def synchronize(self):
        check(L.strata_optimizer_synchronize(self._handle))

    def grad_info(self, weight):
        """Explicit mode: (has_grad, sum of squares, update count) of a param's held grad."""
        info = _lib.GradInfo()
        check(L.strata_optimizer_grad_info(self._handle, weight.handle, ctypes.byref(info)))
        return bool(info.has_grad), info.sum_squares, info.step

    def grad_read(self, weight, pointer, count):
        check(L.strata_optimizer_grad_read(self._handle, weight.handle, pointer, count))

    def grad_scale(self, weight, factor):
        check(L.strata_optimizer_grad_scale(self._handle, weight.handle, float(factor)))

    def grad_write(self, weight, pointer, count):
        """Set the param's held grad to `count` floats at `pointer` (stored in its grad tensor's
        dtype, or exactly in the fp32 accumulator after accumulation)."""
        check(L.strata_optimizer_grad_write(self._handle, weight.handle, pointer, count))

    def grad_zero(self, weight, keep_zeros=False):
        check(L.strata_optimizer_grad_zero(self._handle, weight.handle, 1 if keep_zeros else 0))

    def set_param_step(self, weight, step):
        check(L.strata_optimizer_set_param_step(self._handle, weight.handle, int(step)))

    def state(self, weight, kind):
        out = ctypes.c_void_p()
        check(L.strata_optimizer_get_state(self._handle, weight.handle, STATES[kind], ctypes.byref(out)))
        return Tensor(self.runtime, out)

    def stats(self):
        s = _lib.OptimizerStats()
        check(L.strata_optimizer_get_stats(self._handle, ctypes.byref(s)))
        out = {k: getattr(s, k) for k, _ in _lib.OptimizerStats._fields_ if k != "struct_size"}
        out["isa"] = s.isa.decode()
        out["binding"] = s.binding.decode()
        return out

    def close(self):
        if self._handle:
            h, self._handle = self._handle, ctypes.c_void_p()
            check(L.strata_optimizer_destroy(h))
