"""The DRAM arena's pinned part (issue 39, strata_runtime_config_t.dram_pinned_bytes): a
strata.torch session asks the library what its streamed blocks' GPU copies touch
(strata_layout_totals_t.dram_gpu_bytes), pins only that, and trains exactly as with the whole
arena pinned: the weights and grads in the pinned part, the optimizer's state in the other,
nothing displaced. On the CPU (the host backend) pinning is a no-op; the parts and the
routing are the library's all the same."""
import copy
import dataclasses

import pytest

torch = pytest.importorskip("torch")
import strata.core as core  # noqa: E402
import strata.torch as st  # noqa: E402
import strata.torch._planning as planning  # noqa: E402
from llama_zoo.torch_llama import LlamaForCausalLM, PRESETS  # noqa: E402
from torch_parity_models import train  # noqa: E402


def batches(config, n, batch=4, seq=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    pair = [torch.randint(0, config.vocab_size, (batch, seq), generator=g) for _ in range(2)]
    return [pair[i % 2] for i in range(n)]


def test_pinned_dram_is_the_layouts_gpu_bytes_or_everything():
    blocks, frozen = [[1000, 70001], [5000]], [[300], []]
    t = core.layout_sizes(blocks, 2, frozen)
    gpu = t["dram_gpu_bytes"]
    assert gpu == t["weight_bytes"] + t["grad_dram_bytes"] + t["dram_margin_bytes"]
    assert gpu < t["dram_bytes"]
    assert core.pinned_dram(blocks, 2, gpu + 1, frozen) == gpu
    # The whole budget or less: all pinned (0), as with no blocks.
    assert core.pinned_dram(blocks, 2, gpu, frozen) == 0
    assert core.pinned_dram([], 2, 1 << 30) == 0
    # Grads on the device: the buffer they are read through instead of the grads.
    h = core.layout_sizes(blocks, 2, frozen, grads="hbm")
    assert h["dram_gpu_bytes"] == h["weight_bytes"] + h["grad_fetch_bytes"] + \
        h["dram_margin_bytes"]


def test_a_session_pins_what_the_gpu_touches_and_trains_bit_for_bit(monkeypatch):
    torch.manual_seed(3)
    config = PRESETS["tiny"]
    base = LlamaForCausalLM(config)
    data = batches(config, 4, seed=3)
    runs = {}
    for mode in ("sized", "whole"):
        if mode == "whole":  # the arena as before 1.5: all of it pinned
            monkeypatch.setattr(planning, "pinned_dram", lambda *args, **kwargs: 0)
        model = st.offload(copy.deepcopy(base), device="cpu", dtype=torch.bfloat16,
                           resident_blocks=0)
        opt = st.AdamW(model, lr=3e-3, weight_decay=0.1)
        s = model.strata
        caps = s.runtime.capabilities()
        budget = caps.tier_budget_bytes[core.TIERS["dram"]]
        entries = [e for e in s.layers if e]
        trainable = [[sp.param.numel() for sp in e if sp.trainable] for e in entries]
        frozen = [[sp.param.numel() for sp in e if not sp.trainable] for e in entries]
        gpu = core.layout_sizes(trainable, 2, frozen, planning.master_layout(torch.bfloat16),
                                s.grads_home)["dram_gpu_bytes"]
        if mode == "sized":
            assert 0 < gpu < budget
            assert caps.dram_pinned_bytes == gpu
        else:
            assert caps.dram_pinned_bytes == budget
        losses, _ = train(model, opt, data)  # the ordinary loop
        opt.synchronize()
        usage = s.runtime.tier_usage("dram")
        assert usage["pinned_budget"] == caps.dram_pinned_bytes
        assert usage["dram_fallbacks"] == 0
        if mode == "sized":
            # The weights and grads fit the pinned part; the state (masters, moments) is
            # all in the other.
            assert usage["pinned_used"] <= gpu - core.NVME_DRAM_MARGIN
            per = core.state_bytes_per_param(2, planning.master_layout(torch.bfloat16))
            state = per * sum(sum(t) for t in trainable)
            assert usage["used"] - usage["pinned_used"] >= state
        weights = {n: p.detach().clone() for n, p in model.state_dict().items()}
        runs[mode] = (losses, weights)
        s.close()
    (la, wa), (lb, wb) = runs["sized"], runs["whole"]
    assert la == lb
    assert la[-1] < la[0]
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def test_parameters_unfrozen_after_offload_find_pinned_room():
    """Which parameters train is fixed at st.AdamW, not at st.offload, where the runtime and
    its pinned part are made: a model offloaded frozen (loaded for evaluation, say) and
    unfrozen before its optimizer, as strata.torch allows, must find pinned room for every
    grad. Sized from requires_grad at offload, 14 blocks went to the unpinned part (their
    copies pageable on a GPU)."""
    torch.manual_seed(0)
    # Blocks whose grads outgrow the library's margin (tiny's fit in it either way).
    config = dataclasses.replace(PRESETS["tiny"], hidden_size=512, intermediate_size=2048,
                                 num_attention_heads=8, num_key_value_heads=8)
    model = LlamaForCausalLM(config)
    model.requires_grad_(False)
    model = st.offload(model, device="cpu", dtype=torch.bfloat16, resident_blocks=0)
    try:
        model.requires_grad_(True)
        opt = st.AdamW(model, lr=1e-3)
        ids = batches(config, 1)[0]
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.synchronize()
        usage = model.strata.runtime.tier_usage("dram")
        assert usage["pinned_used"] > 0
        assert usage["dram_fallbacks"] == 0
    finally:
        model.strata.close()
