"""host_budget as a promise (issue 36, item 4): what libstrata and strata.torch take of the
host's memory for a run is the runtime's DRAM budget (the pinned arena: weights, grads,
optimizer state, staging slots, gradient accumulators), what host_budget leaves beside it to
strata.torch's own host memory (the resident parameters' paged optimizer state, the spilled
block checkpoints: strata.torch._planning.HostBudget) and a bounded constant
(docs/python-guide.md, "What host_budget covers"). Measured in a subprocess on the CPU (host
backend) by its peak resident set (VmHWM), reset once the model is built and torch has run a
step of its own, so torch's own memory (the library, its thread pools, the model's resident
parts, the batch's activations at this size) stays out of the figure. The budget's arithmetic,
the pager's sizing from it (the pager sizes on CUDA only: tested on fake numbers) and the spill
pool's refusals are tested in process."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

# Beside the DRAM budget (and the host backend's simulated HBM, which is host memory on the
# CPU): the NVMe tier's pinned staging slots (2 x io_queue_depth x io_block_size, 64 MiB by
# default), its read and write bounce buffers (a few 1 MiB blocks), the update pool's
# per-thread zeros (4 MiB a thread, for params stepped with a zero grad), transient bounce
# buffers of calls that copy one parameter (its bytes, a few times), and torch's own
# transients for what strata.torch computes on the CPU. docs/python-guide.md lists them.
OUTSIDE_BUDGET = 96 << 20
NVME_STAGING = 64 << 20

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, transformers
    import strata.torch as st

    nvme, host_budget = sys.argv[1] or None, int(sys.argv[2]) or None
    spill = sys.argv[3] == "1"  # every block's checkpoint spilled (into the runtime's buffers)
    resident = int(sys.argv[4])  # resident blocks, their optimizer state paged to host memory
    if resident:
        st.AdamW.PAGED_STATE = None  # every resident parameter's (on the CPU too)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=512, intermediate_size=1536,
                                   num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=4, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    # torch's own step first, on a plain copy of the parts that stay torch's (and its thread
    # pools, allocator caches): not Strata's.
    warm = transformers.LlamaForCausalLM(cfg)
    warm(ids, labels=ids).loss.backward()
    del warm

    def status(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = status("VmRSS")
    model = st.offload(model, device="cpu", resident_blocks=resident, nvme=nvme,
                       host_budget=host_budget, spill_checkpoints=spill or None)
    opt = st.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        for micro in range(3):  # accumulation: the fp32 sums too
            (model(ids, labels=ids).loss / 3).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    opt.synchronize() if hasattr(opt, "synchronize") else None
    caps = model.strata.runtime.capabilities()
    budget = model.strata.host_budget
    print(json.dumps({"growth": status("VmHWM") - base, "dram": caps.tier_budget_bytes[1],
                      "hbm": caps.tier_budget_bytes[0], "total": budget.total,
                      "held": budget.held(), "spilled": model.strata.spill.count,
                      "paged": opt._residents.pager.paged_bytes if opt._residents.pager is not None else 0,
                      "placement": model.strata.placement(),
                      "spill": model.strata.spill.describe(), "note": model.strata.spill.note()}))
""")


def run(tmp_path, nvme=False, host_budget=0, spill=False, resident=0):
    env = dict(os.environ)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "tier") if nvme else "", str(host_budget),
         "1" if spill else "0", str(resident)],
        env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
@pytest.mark.parametrize("nvme", [False, True], ids=["dram", "nvme"])
def test_peak_host_memory_is_the_budget_and_a_constant(nvme, tmp_path):
    """The default budget (with room for the accumulators), and with nvme= a host_budget too
    small for the state and all the sums (some on NVMe, staged): the process's peak
    resident memory grows by at most the DRAM budget, the simulated HBM, the NVMe tier's
    staging and OUTSIDE_BUDGET."""
    host_budget = 0
    if nvme:
        import strata.core as core
        counts = [[512 * 512] * 2 + [512 * 256] * 2 + [512 * 1536] * 3 + [512] * 2] * 4
        layers = core.placement_layers(counts, 4)
        everything = sum(l["weight_bytes"] + l["grad_bytes"] + l["state_bytes"] for l in layers)
        # Every tensor and the state, and three quarters of the sums: some layers' sums go
        # to NVMe, staged through a slot.
        host_budget = everything + core.accum_bytes(counts, 4) * 3 // 4
    got = run(tmp_path, nvme, host_budget)
    limit = got["dram"] + got["hbm"] + OUTSIDE_BUDGET + (NVME_STAGING if nvme else 0)
    assert got["growth"] <= limit, (got, limit)
    # The budget was used: the arena is resident (mapped, faulted in and pinned at start).
    assert got["growth"] >= got["dram"], got
    if nvme:
        assert "on NVMe for" in got["placement"], got["placement"]


# The tiny Llama of SCRIPT: its streamed blocks' trainable elements, and one block's
# checkpoint at its batch (2 x 16 tokens of 512 fp32 values).
COUNTS = [[512 * 512] * 2 + [512 * 256] * 2 + [512 * 1536] * 3 + [512] * 2] * 4
CHECKPOINT = 2 * 16 * 512 * 4


def arena_need():
    """What the tiny Llama's arena can use (float32, grads in DRAM): the library's figures."""
    import torch
    from strata.torch import _planning
    dram, accum = _planning.arena_need([sum(c) for c in COUNTS], torch.float32, "dram")
    return dram + accum


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_spilled_checkpoints_stay_inside_the_budget(tmp_path):
    """A host_budget above what the arena can use: the arena takes only that, and the spilled
    checkpoints (every block's, forced on the CPU) the rest, two of four blocks' worth: two
    spill, the others stay and say why, naming host_budget; the peak resident memory grows
    by at most the budget, the simulated HBM and OUTSIDE_BUDGET."""
    need = arena_need()
    host_budget = need + 2 * CHECKPOINT + CHECKPOINT // 2
    got = run(tmp_path, host_budget=host_budget, spill=True)
    # The runtime rounds the arena up to its pages; the pools get what is left of that.
    assert need <= got["dram"] < need + CHECKPOINT // 2 and got["total"] == host_budget, got
    assert got["spilled"] == 2, got
    assert got["held"]["spilled checkpoints"] == 2 * CHECKPOINT, got
    assert "2 more kept on the device: host_budget has no room" in got["spill"], got
    assert "2 more kept on the device" in got["placement"], got["placement"]
    assert "raise host_budget" in got["note"], got
    limit = host_budget + got["hbm"] + OUTSIDE_BUDGET
    assert got["growth"] <= limit, (got, limit)


# A resident block of the tiny Llama: its parameters, and what its training state takes on the
# device, which on the CPU is host memory outside host_budget as the simulated HBM is (fp32
# weight, grad and AdamW's two moments); what pages of it (the moments: the fp32 weights are
# their own masters) goes to host buffers under the budget.
RESIDENT_PARAMS = sum(COUNTS[0])
RESIDENT_STATE = 16 * RESIDENT_PARAMS


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_peak_host_memory_with_spilling_and_paging_is_the_budget_and_a_constant(tmp_path):
    """Every host byte through libstrata (issue 50): with a given host_budget, block
    checkpoints spilled (forced) and a resident block's optimizer state paged (forced), both
    into host buffers of the runtime under its one budget, the process's peak resident memory
    (VmHWM) grows by at most host_budget, the simulated HBM, the resident block's own state on
    the "device" (the CPU) and OUTSIDE_BUDGET; the budget held both pools."""
    need = arena_need()
    paged = 8 * RESIDENT_PARAMS + (1 << 20)  # the moments, 512-byte aligned, whole pages
    host_budget = need + paged + 2 * CHECKPOINT + CHECKPOINT // 2
    got = run(tmp_path, host_budget=host_budget, spill=True, resident=1)
    assert got["total"] == host_budget, got
    assert got["paged"] > 0 and got["held"]["paged optimizer state"] >= got["paged"], got
    assert got["spilled"] >= 2 and got["held"]["spilled checkpoints"] >= 2 * CHECKPOINT, got
    assert sum(got["held"].values()) <= host_budget - got["dram"], got
    limit = host_budget + got["hbm"] + RESIDENT_STATE + OUTSIDE_BUDGET
    assert got["growth"] <= limit, (got, limit)


# --- the budget's arithmetic, in process, on host-backend runtimes -------------------------

PAGE = 4096  # what a host buffer is charged in (strata.h: its size rounded up to 4 KiB)
ARENA = 1 << 20  # each test runtime's DRAM arena (a multiple of the page: not rounded)


def _runtime():
    from strata import core
    return core.Runtime(backend="host", hbm_budget=1 << 20, dram_budget=ARENA)


class _Pool:
    """A pool of real host buffers of the budget's runtime."""

    def __init__(self, budget, nbytes=0):
        self.budget, self.buffers = budget, []
        if nbytes:
            self.take(nbytes)

    def take(self, nbytes):
        buf, why = self.budget.allocate(nbytes, "test pool")
        assert buf is not None, why
        self.buffers.append(buf)

    @property
    def host_bytes(self):
        return sum(b.charged for b in self.buffers)


def test_budget_arithmetic():
    """Given: the pools get the budget less the arena and what every pool holds, never less
    than nothing; a pool that is gone no longer counts. Default: the arena and half of the
    available memory (the library's step plan's rule). The runtime holds the figures: one
    budget for its arena and its host buffers."""
    import gc
    from strata import host_buffers
    from strata.torch._planning import HostBudget
    rt = _runtime()
    budget = HostBudget(rt, ARENA + 400 * PAGE)
    assert (budget.total, budget.arena, budget.room()) == (ARENA + 400 * PAGE, ARENA, 400 * PAGE)
    assert host_buffers.usage(rt)["budget"] == budget.total
    spill, pager = _Pool(budget, 150 * PAGE), _Pool(budget)
    budget.add("spilled checkpoints", spill)
    budget.add("paged optimizer state", pager)
    assert budget.room() == 250 * PAGE and budget.held() == {"spilled checkpoints": 150 * PAGE,
                                                             "paged optimizer state": 0}
    pager.take(250 * PAGE)
    assert budget.room() == 0 and budget.allocate(1, "one more") == (None, "budget")
    del pager
    gc.collect()
    assert budget.room() == 250 * PAGE
    # A budget below what is held leaves nothing, not less.
    host_buffers.set_budget(rt, ARENA + 100 * PAGE)
    assert budget.room() == 0
    host_buffers.set_budget(rt, budget.total)
    assert "host budget" in budget.describe() and "(given)" in budget.describe()
    default = HostBudget(_runtime(), None, available=1000 * PAGE)
    assert default.total == ARENA + 500 * PAGE and default.room() == 500 * PAGE
    assert "(default)" in default.describe()
    # A given budget below the arena is the arena's: no room.
    assert HostBudget(_runtime(), ARENA - 1).room() == 0


def test_the_arena_takes_at_most_what_it_can_use(monkeypatch):
    """Of a host_budget the arena takes what the blocks and their accumulators need at most
    (it is pinned whole at start); a smaller budget is the arena's whole; no budget stays the
    default (session_budgets)."""
    import torch
    from strata.torch import _planning
    blocks = [torch.nn.Linear(64, 64) for _ in range(3)]
    counts = _planning.block_elements(blocks)
    dram, accum = _planning.arena_need(counts, torch.float32, "dram")
    assert accum > 0
    assert _planning.arena_budget(blocks, torch.float32, None, "dram", 10 * dram) == \
        dram + accum
    assert _planning.arena_budget(blocks, torch.float32, None, "dram", dram + 1) == dram + 1
    assert _planning.arena_budget(blocks, torch.float32, None, "dram", None) is None


def test_accumulators_room_is_judged_per_rank_of_the_host(monkeypatch):
    """The default DRAM budget adds the gradient accumulators' room when the host's available
    memory holds it; under data parallelism each process of the host makes such a budget, so
    each judges against its share (two ranks that each took 85% of the host would pin 170%)."""
    import types
    import torch
    from strata.torch import _host, _planning
    blocks = [torch.nn.Linear(64, 64) for _ in range(3)]
    counts = _planning.block_elements(blocks)
    element = _planning.element_bytes(torch.float32)
    dram, accum = _planning.arena_need(counts, torch.float32, "dram")
    # Room for one rank's arena and accumulators, not for two.
    available = int((dram + accum) / _planning.HOST_SHARE * 1.5)
    monkeypatch.setattr(_host, "mem_available", lambda: available)
    assert _planning.with_accumulators(dram, counts, element) == dram + accum
    assert _planning.with_accumulators(dram, counts, element, ranks=2) == dram
    two = types.SimpleNamespace(ranks_on_host=lambda: 2)
    _, alone = _planning.session_budgets(counts, torch.float32, "dram", None, None)
    _, shared = _planning.session_budgets(counts, torch.float32, "dram", None, None, two)
    assert (alone, shared) == (dram + accum, dram)


def test_a_default_budget_is_this_processs_share_of_the_host():
    """Under data parallelism each of the host's ranks makes a default budget: its pools get
    half of its share of the available memory (k ranks: half of the host together); a pool
    the process cannot do without and has not yet allocated (the host replica of the weights,
    `beside`) is held by the budget, beside half of what it leaves of the share. A given
    budget is the process's whatever the ranks."""
    from strata.torch._planning import HostBudget
    available = 1000 * PAGE
    assert HostBudget(_runtime(), None, available=available, ranks=2).total == \
        ARENA + 250 * PAGE
    assert HostBudget(_runtime(), None, available=available, ranks=2,
                      beside=100 * PAGE).total == ARENA + 100 * PAGE + 200 * PAGE
    assert HostBudget(_runtime(), None, available=available, ranks=4,
                      beside=300 * PAGE).total == ARENA + 300 * PAGE
    assert HostBudget(_runtime(), ARENA + available, available=available, ranks=2,
                      beside=100 * PAGE).total == ARENA + available


def test_state_across_hosts_budgets_count_the_pieces_and_the_host_replica(monkeypatch):
    """DataParallel(state_across_hosts=True): each rank's runtime holds its pieces
    (chunk_elements(numel, S, pieces) // pieces a parameter) and the layout pins the whole
    chunks' weights beside the arena (the host replica): a given host_budget must hold both
    (refused one byte short, naming the replica), and its arena is the budget less the
    replica; the default arena's accumulator room is judged with the replica beside it."""
    import types
    import pytest
    import torch
    from strata.torch import _host, _planning
    from strata.torch._distributed import chunk_elements
    blocks = [torch.nn.Linear(64, 64) for _ in range(3)]
    hsdp = types.SimpleNamespace(shard_size=2, pieces=1, ranks_on_host=lambda: 1)
    across = types.SimpleNamespace(shard_size=2, pieces=2, ranks_on_host=lambda: 1)
    chunks = [[chunk_elements(p.numel(), 2, 2) for p in b.parameters()] for b in blocks]
    counts = [sum(c // 2 for c in b) for b in chunks]
    assert _planning.block_elements(blocks, across) == counts
    assert _planning.block_elements(blocks, hsdp) == \
        [sum(chunk_elements(p.numel(), 2) for p in b.parameters()) for b in blocks]
    replica = 4 * sum(map(sum, chunks))
    assert _planning.replica_bytes(blocks, torch.float32, across) == replica
    assert _planning.replica_bytes(blocks, torch.float32, hsdp) == 0
    assert _planning.replica_bytes(blocks, torch.float32, None) == 0
    need, accum = _planning.arena_need(counts, torch.float32, "dram")
    assert _planning.estimate_dram(blocks, torch.float32, across) == need
    budget = need + replica
    _planning.check_host_budget(blocks, torch.float32, across, "dram", budget)
    with pytest.raises(ValueError, match="below the %d bytes.*%d bytes for the host replica"
                       % (budget, replica)):
        _planning.check_host_budget(blocks, torch.float32, across, "dram", budget - 1)
    assert _planning.arena_budget(blocks, torch.float32, across, "dram", budget) == need
    assert _planning.arena_budget(blocks, torch.float32, across, "dram", 10 * budget) == \
        need + accum
    # The accumulators' room: the arena's need and accumulators fit the share, not with the
    # replica beside them.
    available = int((need + accum + replica // 2) / _planning.HOST_SHARE)
    monkeypatch.setattr(_host, "mem_available", lambda: available)
    _, without = _planning.session_budgets(counts, torch.float32, "dram", None, None, across)
    _, beside = _planning.session_budgets(counts, torch.float32, "dram", None, None, across,
                                          replica)
    assert (without, beside) == (need + accum, need)


def _pager(groups, budget, auto=False):
    """A StatePager over CPU masters of `groups` sizes (elements), with no optimizer state
    yet (the sizing counts the moments to come from the masters)."""
    import types
    import torch
    from strata.torch.paging.pager import StatePager
    masters = [[torch.zeros(n) for n in g] for g in groups]
    return StatePager(types.SimpleNamespace(state={}), masters, torch.device("cpu"),
                      auto=auto, budget=budget)


def test_the_pager_pages_what_the_budget_leaves():
    """Each fp32 master pages 12 bytes an element (itself, its two moments): a count of
    blocks (or every resident parameter's) pages the first groups whose copies fit in what
    host_budget leaves, decided at construction; none fit: nothing pages and the pager is
    settled (the activation keeper does not wait for a sizing that never comes). Its host
    copies are host buffers of the runtime, counted once made."""
    from strata.torch._planning import HostBudget
    budget = HostBudget(_runtime(), ARENA + 2 * 12_000 + 100)
    pager = _pager([[1000]] * 3, budget)
    assert (len(pager.groups), pager.active) == (2, 2)
    assert budget.held() == {"paged optimizer state": 0}
    pager.copies.memory(5000)  # charged two pages
    assert pager.copies.host_bytes == 2 * PAGE
    assert budget.room() == 2 * 12_000 + 100 - 2 * PAGE  # its host copies count once made
    none = _pager([[1000]] * 3, HostBudget(_runtime(), ARENA + 11_999))
    assert none.active == 0 and none.groups == [] and none.settled


def test_auto_pages_what_the_budget_leaves_at_its_decision():
    """auto decides at the first step's end from the room left then: what the spilled
    checkpoints took meanwhile is not the pager's."""
    from strata.torch._planning import HostBudget
    budget = HostBudget(_runtime(), ARENA + 3 * 12_000)
    pager = _pager([[1000]] * 3, budget, auto=True)
    pager.sizing.probe = "first"  # auto probes on CUDA; its decision is the same function here
    spill = _Pool(budget, 12_001)  # what the spilled checkpoints hold when auto decides
    budget.add("spilled checkpoints", spill)
    assert spill.host_bytes == 3 * PAGE  # 12,001 bytes charged in whole pages
    assert pager._probing(timed=False)  # not at the optimizer's creation
    assert not pager._probing(timed=True)
    assert pager.active == 1 and pager.sizing.decision["groups_fitting_host"] == 1
    assert pager.sizing.decision["host_room_bytes"] == 3 * 12_000 - 3 * PAGE
    starved = _pager([[1000]] * 3, HostBudget(_runtime(), ARENA), auto=True)
    starved.probe = "first"
    assert starved._probing(timed=True) and starved.active == 0 and starved.settled


def test_the_spill_pool_refuses_what_the_budget_lacks():
    """A buffer beyond what host_budget leaves is refused (its block keeps its checkpoint),
    counted apart from the host's own refusals; a buffer replaced by a larger one gives its
    room back first."""
    from strata.torch import _spill_pool
    from strata.torch._planning import HostBudget
    budget = HostBudget(_runtime(), ARENA + 3 * PAGE)
    pool = _spill_pool.HostPool(budget=budget)
    budget.add("spilled checkpoints", pool)
    assert pool.reserve(0, PAGE) and pool.reserve(1, PAGE)
    assert not pool.reserve(2, PAGE + 1) and pool.over_budget == 1 and pool.refused == 0
    assert pool.reserve(2, PAGE) and budget.room() == 0
    assert pool.reserve(1, PAGE)  # held already
    pool.release(2)
    assert pool.reserve(1, 2 * PAGE)  # its own page back, and the page released
    assert budget.room() == 0 and pool.nbytes == 3 * PAGE
    assert budget.held() == {"spilled checkpoints": 3 * PAGE}


def test_the_spill_pool_refuses_what_the_machine_lacks():
    """A buffer the budget has room for, which would leave less than the runtime's reserve of
    the machine's memory available, is refused as the host's, not the budget's, and the note
    names the reserve."""
    from strata import host_buffers
    from strata.torch import _spill_pool
    from strata.torch._planning import HostBudget
    rt = _runtime()
    budget = HostBudget(rt, 1 << 62)
    pool = _spill_pool.HostPool(budget=budget)
    too_big = host_buffers.usage(rt)["available"] + PAGE
    assert not pool.reserve(0, too_big)
    assert (pool.refused, pool.over_budget, pool.last_refusal) == (1, 0, "host")
    assert "reserve of the machine's memory" in pool.host_refusal()
    assert budget.held() == {} and host_buffers.usage(rt)["buffers"] == 0


def test_ranks_of_a_host_share_its_cores_for_the_fault_in():
    """Under data parallelism each rank faults its arena in with its share of the cores (the
    ranks of a host create their arenas at once; torchrun leaves each the whole affinity);
    one process leaves it to the runtime's default (every core of its affinity)."""
    import os
    import types
    from strata.torch import _host
    cores = len(os.sched_getaffinity(0))
    assert _host.fault_threads(None) == 0
    for ranks in (1, 2, 3, 64 * cores):
        mesh = types.SimpleNamespace(ranks_on_host=lambda ranks=ranks: ranks)
        assert _host.fault_threads(mesh) == max(1, cores // ranks)
