"""Sizing, before anything is built: how strata.torch lays out a streamed parameter's fp32
master, the budgets a session's runtime gets by default, how many of the first blocks stay
resident in HBM, whether the streamed blocks fit the host budget, and with NVMe which placement
of their training state the budgets allow, and the one host budget the runtime holds for the
arena and strata.torch's own host memory beside it (HostBudget). The byte counts are the runtime's (strata.core asks
the C library); what is decided here is strata.torch's policy on top of them."""

import os
import weakref

import torch

from .. import core, errors, host_buffers, step_plan
from . import _host, _step
from ._distributed import chunk_elements, disk_sharing

# The dtypes streamed weights may have, by the runtime's names for them.
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def master_layout(dtype):
    """How strata.torch keeps a streamed parameter's fp32 master: split for bf16 weights (the
    weight is its upper half, the optimizer keeps the low 16 bits: strata.h STRATA_MASTER_SPLIT),
    a separate fp32 tensor for fp16 ones (fp32 weights are their own). Every caller reads it
    through this module (`_planning.master_layout`), so one setting reaches the budgets, the
    placement and the optimizer's layout alike."""
    return "split" if dtype == torch.bfloat16 else "separate"


def element_bytes(dtype):
    return torch.finfo(dtype).bits // 8


# Where a session's streamed grads live (offload's grads= and grad_dtype=, resolved by
# strata.torch._offload): "dram"; "hbm" (in the compute dtype, zeroed at every backward load; an
# accumulation is summed by the optimizer into fp32 accumulators in DRAM or on NVMe); or
# "hbm_sums" (fp32 in HBM, each backward pass's grad added in place: the tensor is the sum, and
# no accumulator exists: strata.h STRATA_GRAD_SUM_IN_PLACE).
GRAD_HOMES = ("dram", "hbm", "hbm_sums")


def layout_grads(grads):
    """strata.core's layout keywords (grads, grad_sum) for a grads home (GRAD_HOMES)."""
    if grads not in GRAD_HOMES:
        raise ValueError("internal: grads home %r is not one of %s" % (grads, GRAD_HOMES))
    return {"grads": "dram" if grads == "dram" else "hbm",
            "grad_sum": "in_place" if grads == "hbm_sums" else "accumulator"}


def kept_elements(numel, mesh=None):
    """Elements of a streamed parameter of `numel` elements that this process's runtime holds
    (its weight, grad and optimizer state): all of them; under data parallelism (`mesh`) this
    rank's chunk (strata._sharding.chunk_elements); with the state across hosts
    (DataParallel(state_across_hosts=True), mesh.pieces > 1) this rank's piece of that chunk,
    what strata.torch.layout registers (the chunk itself is in the host replica:
    replica_bytes)."""
    if mesh is None:
        return numel
    return chunk_elements(numel, mesh.shard_size, mesh.pieces) // mesh.pieces


def block_elements(blocks, mesh=None):
    """Elements per block that this process's runtime keeps in DRAM (kept_elements)."""
    return [sum(kept_elements(p.numel(), mesh) for p in b.parameters()) for b in blocks]


def replica_bytes(blocks, dtype, mesh=None):
    """Pinned host bytes this process keeps beside the arena for the streamed blocks: with the
    state across hosts (mesh.pieces > 1) the layout's host replica of the weights, every
    streamed parameter's whole chunk in the compute dtype (strata.torch.layout.replica.HostReplica,
    counted as a HostBudget pool once made); else 0."""
    if mesh is None or mesh.pieces == 1:
        return 0
    return element_bytes(dtype) * sum(chunk_elements(p.numel(), mesh.shard_size, mesh.pieces)
                                      for b in blocks for p in b.parameters())


# The share of the host's available memory a default host budget may take to make room for
# the gradient accumulators (the same share plan_nvme leaves the OS, torch and the user): the
# library bindings' one figure (strata._tiering).
HOST_SHARE = core.HOST_SHARE


def with_accumulators(dram, counts, element, ranks=1, beside=0, grads="dram"):
    """A default DRAM budget of `dram` bytes, with room for the gradient accumulators of the
    streamed blocks (`counts`: per block its trainable tensors' elements, or one count) added
    when the host's available memory holds both: then accumulating (a backward pass onto
    grads not zeroed since the last one) keeps the fp32 sums in DRAM. Else `dram` as it is,
    and the optimizer puts the sums on NVMe when there is an NVMe tier, or the first
    accumulating step fails naming host_budget and nvme= (docs/optimizer.md, "Gradient
    accumulators"). A budget is pinned whole when the runtime starts: the room is spent
    whether or not the run accumulates. `ranks`: the processes of this host that each make
    such a budget (data parallelism): each may take its share of the available memory.
    `beside`: host bytes the process pins beside the arena from that share (replica_bytes).
    `grads`: the grads home (GRAD_HOMES); summed in place ("hbm_sums") they need no
    accumulators, and `dram` is returned as it is."""
    accum = core.accum_bytes(counts, element, **layout_grads(grads))
    available = _host.mem_available()
    if available is not None and dram + accum + beside <= available * HOST_SHARE / ranks:
        return dram + accum
    return dram


def arena_need(counts, dtype, grads):
    """(the DRAM the streamed blocks of `counts` elements need without NVMe, the room their
    gradient accumulators take): core.streaming_budgets' and core.accum_bytes', the library's
    figures (no accumulators for grads summed in place). The arena never uses more than their
    sum."""
    element = element_bytes(dtype)
    _, dram = core.streaming_budgets(counts, element, master_layout(dtype), **layout_grads(grads))
    return dram, core.accum_bytes(counts, element, **layout_grads(grads))


def arena_budget(blocks, dtype, mesh, grads, host_budget):
    """Without NVMe, the runtime's DRAM arena out of a given host_budget: what the budget
    leaves beside the host replica of the weights (replica_bytes; state across hosts only), at
    most what the arena can use (arena_need: the blocks and their accumulators; pinned whole at
    start, more would be memory nobody uses), the rest of the budget left to strata.torch's own
    host memory (HostBudget). None: the default (session_budgets)."""
    if host_budget is None:
        return None
    dram, accum = arena_need(block_elements(blocks, mesh), dtype, grads)
    return min(host_budget - replica_bytes(blocks, dtype, mesh), dram + accum)


def hbm_budget(counts, dtype, grads, gpu_budget):
    """The HBM tier of a session's runtime (allocated whole when it is created): the given
    gpu_budget (the slots'), or what the streamed blocks of `counts` elements need
    (core.streaming_budgets); with grads in HBM (GRAD_HOMES) their bytes beside a given
    gpu_budget (the default counts them already)."""
    element = element_bytes(dtype)
    if gpu_budget is None:
        hbm, _ = core.streaming_budgets(counts, element, master_layout(dtype),
                                        **layout_grads(grads))
        return hbm
    if grads != "dram":
        gpu_budget += core.grads_hbm_bytes(counts, element, layout_grads(grads)["grad_sum"])
    return gpu_budget


def session_budgets(counts, dtype, grads, gpu_budget, host_budget, mesh=None, beside=0):
    """The HBM and DRAM budgets of a session's runtime: the given ones (a DRAM one is the
    arena's share of host_budget: arena_budget, plan_nvme), or what the streamed blocks of
    `counts` elements need (core.streaming_budgets), with room for the gradient accumulators
    where the host has it (with_accumulators). With grads in HBM a given gpu_budget is the
    slots' and the grads come beside it (hbm_budget). `mesh`: under data parallelism, the
    accumulators' room is judged against this rank's share of the host, less `beside` (the
    host replica this rank pins beside the arena: replica_bytes)."""
    element = element_bytes(dtype)
    _, dram = core.streaming_budgets(counts, element, master_layout(dtype), **layout_grads(grads))
    if host_budget is None:
        dram = with_accumulators(dram, counts, element,
                                 1 if mesh is None else mesh.ranks_on_host(), beside, grads)
    return (hbm_budget(counts, dtype, grads, gpu_budget),
            dram if host_budget is None else host_budget)


def check_device_memory(blocks, dtype, mesh, grads, gpu_budget, device, backend):
    """With the grads' sums on the device (grads "hbm_sums": offload(grads="device",
    grad_dtype=torch.float32), the default under data parallelism): the HBM tier the runtime
    allocates whole at its creation (hbm_budget: the slots and 4 bytes per parameter of this
    rank's chunks for the sums) must fit the device's free memory, else a ValueError naming
    the bytes and the other ways, before anything is created. Not on the host backend (its
    "HBM" is host memory) nor for the other grad homes (the runtime's creation refuses a tier
    the device cannot hold: OutOfMemory)."""
    if grads != "hbm_sums" or backend != "cuda" or device.type != "cuda":
        return
    counts = block_elements(blocks, mesh)
    need = hbm_budget(counts, dtype, grads, gpu_budget)
    free, _ = torch.cuda.mem_get_info(device)
    if need <= free:
        return
    sums = core.grads_hbm_bytes(counts, element_bytes(dtype), "in_place")
    raise ValueError(
        "strata.torch.offload: grads='device' with fp32 gradient sums (grad_dtype=torch.float32%s) "
        "needs an HBM tier of %d bytes on %s, %d of them the sums (4 bytes per parameter%s), and "
        "the device has %d bytes free; pass grads='host' (the grads and their sums in host "
        "memory), a smaller gpu_budget, or train over more GPUs; nothing was changed"
        % (", the default under data parallelism" if mesh is not None else "", need, device,
           sums, " of this rank's shard" if mesh is not None else "", free))


def pinned_dram(blocks, dtype, grads, dram_budget, mesh=None):
    """The part of the session runtime's DRAM arena to pin (core.pinned_dram, the library's
    rule) for the streamed blocks' tensors as this process registers them (kept_elements),
    each in its own arena blocks: their weights and grads (or the grads' fetch buffer), not the
    optimizer's state (issue 39: the arena's set-up is then bound by its fault-in). Every block
    parameter is counted as trainable: the runtime exists from st.offload on, while which
    parameters train is fixed only at st.AdamW (check_trainable), so one unfrozen in between
    must still find pinned room for its grad (else its copies are pageable: counted in
    tier_usage("dram")["dram_fallbacks"]). A frozen parameter's grad room is pinned for
    nothing; where that reaches the budget, everything is pinned, as before 1.5."""
    every = [[kept_elements(p.numel(), mesh) for p in b.parameters()] for b in blocks]
    return core.pinned_dram(every, element_bytes(dtype), dram_budget, None,
                            master_layout(dtype), **layout_grads(grads))


def estimate_dram(blocks, dtype, mesh=None, grads="dram"):
    """The pinned DRAM the streamed blocks need without NVMe (weights, grads, masters and
    moments, alignment and headroom)."""
    _, dram = core.streaming_budgets(block_elements(blocks, mesh), element_bytes(dtype),
                                     master_layout(dtype), **layout_grads(grads))
    return dram


def check_host_budget(blocks, dtype, mesh, grads_home, host_budget):
    """Without NVMe, a given host_budget must hold the streamed blocks (and with the state
    across hosts, beside them, the host replica of their weights): else a ValueError that says
    what they need (and what grads='device' would), before anything is created."""
    if host_budget is None:
        return
    replica = replica_bytes(blocks, dtype, mesh)
    need = estimate_dram(blocks, dtype, mesh, grads_home) + replica
    if host_budget >= need:
        return
    hint = ""
    if grads_home == "dram":  # (under data parallelism grads='device' sums them there in fp32)
        hint = ("; grads='device' needs %d (the grads on the GPU)"
                % estimate_dram(blocks, dtype, mesh, "hbm" if mesh is None else "hbm_sums"))
    beside = ""
    if replica:
        beside = (", and beside them %d bytes for the host replica of their weights "
                  "(DataParallel(state_across_hosts=True))" % replica)
    raise ValueError("strata.torch.offload: host_budget %d bytes is below the %d bytes the "
                     "streamed blocks need in pinned DRAM (their weights, %sfp32 masters "
                     "and AdamW moments, 2%% for page alignment, and a fixed 256 MiB of "
                     "headroom beyond them%s; or pass nvme= to put state on NVMe%s); nothing "
                     "was changed" % (host_budget, need,
                                      "grads, " if grads_home == "dram" else
                                      "one block's grads, ", beside, hint))


# Where a model's config says how many of its routed experts a token uses, and of how many,
# under Hugging Face's names: the first of each tuple the config has (Mixtral, GPT-OSS:
# num_local_experts; Qwen3-MoE, OLMoE: num_experts; DeepSeek-V3: n_routed_experts).
_TOP_K = ("num_experts_per_tok", "experts_per_token")
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")


def routing(config):
    """(top_k, experts) of a model's routed experts from its config (a vision-language
    model's text config), or None where it names none."""
    text = getattr(config, "get_text_config", None)
    config = text() if callable(text) else config

    def first(names):
        values = [getattr(config, n, None) for n in names]
        return next((v for v in values if isinstance(v, int) and v > 0), None)

    top_k, experts = first(_TOP_K), first(_EXPERTS)
    return (min(top_k, experts), experts) if top_k and experts else None


def active_flops(block, config):
    """The FLOPs of `block`'s forward pass a token through its weights, for the step plan
    (strata_step_block_t.active_flops): 2 x the parameters one token's products use. Routed
    experts (parameters under a submodule named `experts`; a shared expert is not one) count
    at top_k / experts (`config`'s routing: a Qwen3-30B-A3B block computes 8 of its 128
    experts a token), the rest of the block whole; a block without them, or a model whose
    config names no routing, all of its parameters."""
    total = routed = 0
    for name, p in block.named_parameters():
        total += p.numel()
        if "experts" in name.split(".")[:-1]:
            routed += p.numel()
    share = routing(config) if routed else None
    if share is None:
        return 2 * total
    top_k, experts = share
    return 2 * (total - routed) + 2 * routed * top_k // experts


def _auto_resident_blocks(model, blocks, dtype, device, gpu_budget, grads="dram", mesh=None):
    """How many of the first blocks to keep resident in HBM: the library's step plan
    (strata.step_plan; runtime/step/residency.cpp has the rule: a share of the device memory
    left beside Strata's HBM tier and the rest of the model), from what strata.torch measures:
    the device's free memory, the bytes a resident parameter takes (the compute-dtype weight
    and grad, an fp32 master unless the weights are fp32, AdamW's m and v; resident blocks are
    trained by torch's AdamW with whole fp32 masters, never split), the parameters outside the
    blocks not yet on the device (a meta model's embedding and head), and with grads in HBM
    their bytes (under data parallelism, `mesh`, this rank's chunks'), and each block's forward
    FLOPs a token (active_flops: a mixture-of-experts block's routed share; with no batch or
    rates here the plan does not judge transfers, and residency is the first blocks whatever
    their FLOPs). 0 on the CPU."""
    if device.type != "cuda":
        return 0
    element = element_bytes(dtype)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    coming = sum(p.numel() for p in model.parameters()
                 if id(p) not in in_blocks and p.device != device)
    counts, kept = block_elements(blocks), block_elements(blocks, mesh)
    grad_bytes = hbm_grads = 0
    if grads != "dram":
        hbm_grads = core.grads_hbm_bytes(kept, element, layout_grads(grads)["grad_sum"])
        # (blocks with no parameters have no grads in HBM: nothing is handed back for them)
        grad_bytes = (4 if grads == "hbm_sums" else element) if hbm_grads else 0
    figures = _step.device_figures(device)
    plan = step_plan.plan_step(
        [step_plan.Block(n, rank_elements=mine,
                         active_flops=active_flops(b, getattr(model, "config", None)))
         for b, n, mine in zip(blocks, counts, kept)],
        resident_bytes_per_param=2 * element + core.state_bytes_per_param(element),
        hbm_tier_bytes=gpu_budget or 0, outside_elements=coming,
        streamed_grad_bytes_per_param=grad_bytes, streamed_grads_hbm_bytes=hbm_grads,
        device_total_bytes=figures["device_total_bytes"],
        device_free_bytes=figures["device_free_bytes"])
    return plan.resident_blocks


def plan_nvme(blocks, dtype, grads_home, state_placement, host_budget, nvme, nvme_budget,
              mesh=None):
    """With nvme=: training state may spill to NVMe. The placement (strata_placement_*)
    chooses, from the budgets and the rates measured on the runtime, which blocks' state and
    weights go there, fastest predicted step first (docs/optimizer.md, "State on NVMe"). Here
    it only checks, with no rates, that some placement fits: nothing is created otherwise.
    Returns (layers: per block the sizes the placement weighs, the arena's DRAM budget,
    nvme_budget, what the placement may put on NVMe), the budgets filled in where not given:
    DRAM what every tensor and the gradient accumulators need or 85% of the available memory,
    whichever is less, and of a given host_budget at most what they need (the rest is
    strata.torch's own host memory's: HostBudget); the placement puts state in DRAM first:
    what is left holds accumulators, the rest of them go to NVMe at the first accumulation; NVMe room for everything that could spill,
    accumulators included, at most what the disks have free (the runtime preallocates its
    files).

    Under data parallelism (`mesh`, collective) each rank plans its chunks of the blocks
    (block_elements' rule) with `nvme` its own files (strata.torch._distributed.rank_files): the
    defaults are its share of the host, 85% of the available memory and the free disk divided
    among the ranks of the host (of the ranks with files on the same file system), and the
    ranks agree on the smallest of their budgets, so that every rank checks, and later
    chooses, one placement of equal chunks within equal budgets."""
    element = element_bytes(dtype)
    counts = [[kept_elements(p.numel(), mesh) for p in b.parameters() if p.requires_grad]
              for b in blocks]
    frozen = [[kept_elements(p.numel(), mesh) for p in b.parameters() if not p.requires_grad]
              for b in blocks]
    layers = core.placement_layers(counts, element, frozen,
                                   "nvme" if state_placement == "nvme" else "choose",
                                   master_layout=master_layout(dtype), **layout_grads(grads_home))
    for i, layer in enumerate(layers):
        layer["name"] = "blocks.%d" % i
    # The budgets' rules and the check are every binding's (strata._tiering); what is
    # strata.torch's here is the probes (read through _host, which tests replace) and the ranks.
    def agree(host, disk):  # one placement: every rank's within the same budgets
        every = mesh.gather_objects((host, disk))
        return min(b[0] for b in every), min(b[1] for b in every)

    plan = core.plan_budgets(
        "strata.torch.offload", layers, host_budget, nvme_budget,
        free_disk=lambda: _host.disk_free(nvme) // (1 if mesh is None else
                                                    disk_sharing(mesh, nvme)),
        available=_host.mem_available, ranks=1 if mesh is None else mesh.ranks_on_host(),
        agree=agree if mesh is not None else None)
    return layers, plan.host_budget, plan.nvme_budget, plan.place_nvme


class HostBudget:
    """host_budget as a promise: what one session's run takes of the host's memory. The
    runtime holds it (strata.h "Host buffers"): one budget for its DRAM arena (pinned whole at
    start: `arena`) and every host buffer strata.torch takes beside it (the paged optimizer
    state, the spilled checkpoints, the host replica of the weights), each a buffer of the
    runtime (allocate) charged against the budget; a pool that gets no room takes less (fewer
    groups page, fewer blocks spill) and says so. This object sets the budget and names what
    holds it: the pools add() themselves and report what they hold (`host_bytes`, their
    buffers' charges). `given`: the user's host_budget (under data parallelism each rank's),
    or None: then the budget is the arena and half of this process's share of the host
    memory available now (made just after the runtime, so the arena is not counted twice).
    `available`: that memory (None: read it). `ranks`: the processes of this host that each
    make such a budget (data parallelism: Mesh.ranks_on_host; every one's arena made
    already), each taking its share of the available memory, so that k ranks of a host take
    half of it together, not k times that. `beside`: bytes this process adds later as a pool
    it cannot do without (the host replica of the weights: replica_bytes): a default budget
    holds them, and half of the share they leave. The default is the library's step plan's
    (strata.step_plan; runtime/step/residency.cpp: kPoolShare, the paged state alone took
    half of the available memory at the first step's end before the pools were counted
    together). A given budget below the arena (the runtime rounds the arena up to its pages)
    is the arena's; one that holds the arena and `beside` but for the runtime's page roundings
    is raised by them (less than a page each)."""

    def __init__(self, runtime, given, available=None, ranks=1, beside=0):
        self.runtime = runtime
        self.given = given
        self.arena = host_buffers.usage(runtime)["arena"]
        if given is not None:
            total = int(given)
        else:
            if available is None:
                available = available_host_bytes()
            total = step_plan.plan_step(
                [], arena_bytes=self.arena, host_available_bytes=int(available),
                ranks_on_host=ranks, beside_bytes=beside).host_total_bytes
        # The pool it cannot do without is made first, under no limit but the machine's: a
        # given budget that holds it but for the runtime's roundings (its charge, the arena's
        # pages) is raised by them rather than refusing it.
        self.beside = None
        if beside:
            host_buffers.set_budget(runtime, _UNLIMITED)
            self.beside = host_buffers.HostBuffer(runtime, beside, "host replica of the weights")
            total = max(total, self.arena + self.beside.charged)
        host_buffers.set_budget(runtime, max(total, self.arena))
        self.total = host_buffers.usage(runtime)["budget"]
        self._pools = []  # (name, weakref to an object with host_bytes)

    def take_beside(self):
        """The buffer made for the pool declared `beside` (the host replica), once."""
        buf, self.beside = self.beside, None
        return buf

    def add(self, name, pool):
        """Count `pool` (an object whose host_bytes is what its buffers are charged now) under
        `name` in held() and describe() while it lives."""
        self._pools.append((name, weakref.ref(pool)))

    def held(self):
        """{pool name: host bytes it holds now} of the pools alive."""
        out = {}
        for name, ref in self._pools:
            pool = ref()
            if pool is not None:
                out[name] = out.get(name, 0) + int(pool.host_bytes)
        return out

    def room(self):
        """Host bytes one more buffer may be charged now: the budget less the arena and every
        live buffer (the runtime's figure; 0 when nothing is left)."""
        return host_buffers.usage(self.runtime)["room"]

    def reserve(self):
        """The machine memory a buffer must leave available (the runtime's rule)."""
        return host_buffers.usage(self.runtime)["reserve"]

    def allocate(self, nbytes, name, before_free=None):
        """(a host buffer of the runtime, None), or (None, why not): "budget" (the budget's
        room is smaller) or "host" (the machine would keep less than its reserve available, or
        the memory could not be mapped or pinned). Its memory is zero; tensor() views it.
        `before_free`: strata.host_buffers.HostBuffer's."""
        if nbytes > self.room():
            return None, "budget"
        try:
            return host_buffers.HostBuffer(self.runtime, nbytes, name, before_free), None
        except errors.OutOfMemory:
            return None, "budget" if nbytes > self.room() else "host"

    def describe(self):
        """'host budget X (given|default): DRAM arena Y, <pool> Z, ..., W left', for
        placement()."""
        held = self.held()
        parts = ["DRAM arena %s" % _size(self.arena)]
        parts += ["%s %s" % (name, _size(n)) for name, n in held.items() if n]
        return "host budget %s (%s): %s, %s left" % (
            _size(self.total), "given" if self.given is not None else "default",
            ", ".join(parts), _size(self.room()))


_UNLIMITED = (1 << 64) - 1


def tensor(buffer):
    """A uint8 tensor over a host buffer's memory (strata.host_buffers.HostBuffer), keeping the
    buffer alive while it or a view of it is."""
    return torch.frombuffer(buffer.buffer(), dtype=torch.uint8)


def available_host_bytes():
    """The host memory available now (Linux's MemAvailable: free plus what the kernel can
    reclaim), or the free pages where /proc/meminfo cannot be read."""
    available = _host.mem_available()
    if available is not None:
        return available
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _size(n):
    return "%.2f GiB" % (n / (1 << 30)) if n >= 1 << 30 else "%.1f MiB" % (n / (1 << 20))
