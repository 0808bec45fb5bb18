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
    spill = sys.argv[3] == "1"  # every block's checkpoint spilled (into ordinary host memory)
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
    model = st.offload(model, device="cpu", resident_blocks=0, nvme=nvme,
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
                      "placement": model.strata.placement(),
                      "spill": model.strata.spill.describe(), "note": model.strata.spill.note()}))
""")


def run(tmp_path, nvme=False, host_budget=0, spill=False):
    env = dict(os.environ)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "tier") if nvme else "", str(host_budget),
         "1" if spill else "0"],
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


# --- the budget's arithmetic, in process ---------------------------------------------------

class _Pool:
    def __init__(self, nbytes=0):
        self.host_bytes = nbytes


def test_budget_arithmetic():
    """Given: the pools get the budget less the arena and what every pool holds, never less
    than nothing; a pool that is gone no longer counts. Default: the arena and half of the
    available memory (the library's step plan's rule)."""
    from strata.torch._planning import HostBudget
    budget = HostBudget(1000, 600)
    assert (budget.total, budget.arena, budget.room()) == (1000, 600, 400)
    spill, pager = _Pool(150), _Pool()
    budget.add("spilled checkpoints", spill)
    budget.add("paged optimizer state", pager)
    assert budget.room() == 250 and budget.held() == {"spilled checkpoints": 150,
                                                       "paged optimizer state": 0}
    pager.host_bytes = 300  # beyond what was left: nothing is left, not less
    assert budget.room() == 0
    del pager
    assert budget.room() == 250
    assert "host budget" in budget.describe() and "(given)" in budget.describe()
    default = HostBudget(None, 600, available=1000)
    assert default.total == 600 + 500 and default.room() == 500
    assert "(default)" in default.describe()


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
    assert HostBudget(None, 600, available=1000, ranks=2).total == 600 + 250
    assert HostBudget(None, 600, available=1000, ranks=2, beside=100).total == \
        600 + 100 + 200
    assert HostBudget(None, 600, available=1000, ranks=4, beside=300).total == 600 + 300
    assert HostBudget(1000, 600, available=1000, ranks=2, beside=100).total == 1000


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
    from strata.torch._paging import StatePager
    masters = [[torch.zeros(n) for n in g] for g in groups]
    return StatePager(types.SimpleNamespace(state={}), masters, torch.device("cpu"),
                      auto=auto, budget=budget)


def test_the_pager_pages_what_the_budget_leaves():
    """Each fp32 master pages 12 bytes an element (itself, its two moments): a count of
    blocks (or every resident parameter's) pages the first groups whose copies fit in what
    host_budget leaves, decided at construction; none fit: nothing pages and the pager is
    settled (the activation keeper does not wait for a sizing that never comes)."""
    import torch
    from strata.torch._planning import HostBudget
    budget = HostBudget(10_000 + 2 * 12_000 + 100, 10_000)
    pager = _pager([[1000]] * 3, budget)
    assert (len(pager.groups), pager.active) == (2, 2)
    assert budget.held() == {"paged optimizer state": 0}
    pager.registered.append(torch.zeros(5000, dtype=torch.uint8))
    assert budget.room() == 2 * 12_000 + 100 - 5000  # its host copies count once made
    none = _pager([[1000]] * 3, HostBudget(10_000 + 11_999, 10_000))
    assert none.active == 0 and none.groups == [] and none.settled


def test_auto_pages_what_the_budget_leaves_at_its_decision():
    """auto decides at the first step's end from the room left then: what the spilled
    checkpoints took meanwhile is not the pager's."""
    from strata.torch._planning import HostBudget
    budget = HostBudget(10_000 + 3 * 12_000, 10_000)
    pager = _pager([[1000]] * 3, budget, auto=True)
    pager.probe = "first"  # auto probes on CUDA; its decision is the same function here
    spill = _Pool(12_001)  # what the spilled checkpoints hold when auto decides
    budget.add("spilled checkpoints", spill)
    assert pager._probing(timed=False)  # not at the optimizer's creation
    assert not pager._probing(timed=True)
    assert pager.active == 1 and pager.decision["groups_fitting_host"] == 1
    assert pager.decision["host_room_bytes"] == 3 * 12_000 - 12_001
    starved = _pager([[1000]] * 3, HostBudget(10_000, 10_000), auto=True)
    starved.probe = "first"
    assert starved._probing(timed=True) and starved.active == 0 and starved.settled


def test_the_spill_pool_refuses_what_the_budget_lacks():
    """A buffer beyond what host_budget leaves is refused (its block keeps its checkpoint),
    counted apart from the host's own refusals; a buffer replaced by a larger one gives its
    room back first."""
    from strata.torch import _spill
    from strata.torch._planning import HostBudget
    budget = HostBudget(1000 + 3000, 1000)
    pool = _spill.HostPool(pinned=False, budget=budget)
    budget.add("spilled checkpoints", pool)
    assert pool.reserve(0, 1000) and pool.reserve(1, 1000)
    assert not pool.reserve(2, 1001) and pool.over_budget == 1 and pool.refused == 0
    assert pool.reserve(2, 1000) and budget.room() == 0
    assert pool.reserve(1, 1000)  # held already
    pool.release(2)
    assert pool.reserve(1, 2000)  # its own 1000 back, and the 1000 released
    assert budget.room() == 0 and pool.nbytes == 3000


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
