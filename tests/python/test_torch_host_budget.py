"""host_budget as a promise (issue 36, item 4): what libstrata and strata.torch take of the
host's memory for a run is the runtime's DRAM budget (the pinned arena: weights, grads,
optimizer state, staging slots, gradient accumulators) and, beside it, a bounded constant
(docs/python-guide.md, "What host_budget covers"). Measured in a subprocess on the CPU (host
backend) by its peak resident set (VmHWM), reset once the model is built and torch has run a
step of its own, so torch's own memory (the library, its thread pools, the model's resident
parts, the batch's activations at this size) stays out of the figure."""

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
                       host_budget=host_budget)
    opt = st.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        for micro in range(3):  # accumulation: the fp32 sums too
            (model(ids, labels=ids).loss / 3).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    opt.synchronize() if hasattr(opt, "synchronize") else None
    caps = model.strata.runtime.capabilities()
    print(json.dumps({"growth": status("VmHWM") - base, "dram": caps.tier_budget_bytes[1],
                      "hbm": caps.tier_budget_bytes[0],
                      "placement": model.strata.placement()}))
""")


def run(tmp_path, nvme=False, host_budget=0):
    env = dict(os.environ)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "tier") if nvme else "", str(host_budget)],
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
