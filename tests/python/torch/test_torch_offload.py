"""strata.torch against plain PyTorch on the CPU (the host backend): the same model, seed and
data give the same losses, step after step; and evaluation without grads sees the updated
weights."""
import copy

import pytest

torch = pytest.importorskip("torch")
import strata.torch as st  # noqa: E402
from llama_zoo.torch_llama import LlamaForCausalLM, PRESETS  # noqa: E402

STEPS = 6
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def batches(config, n, batch=4, seq=32, seed=0):
    """Two fixed batches in turn: a model that learns them shows a falling loss."""
    g = torch.Generator().manual_seed(seed)
    pair = [torch.randint(0, config.vocab_size, (batch, seq), generator=g) for _ in range(2)]
    return [pair[i % 2] for i in range(n)]


def train(model, opt, data, device):
    """The ordinary loop, for both sides; the losses of its steps."""
    losses = []
    for ids in data:
        ids = ids.to(device)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def plain_losses(model, data, lr, wd, device="cpu"):
    model = model.to(device)
    return train(model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd), data, device)


def strata_losses(model, data, lr, wd, device="cpu", **kwargs):
    model = st.offload(model, device=device, **kwargs)
    opt = st.AdamW(model, lr=lr, weight_decay=wd)
    losses = train(model, opt, data, device)
    opt.synchronize()
    return model, losses


@pytest.mark.parametrize("device", DEVICES)
def test_losses_match_plain_pytorch_in_fp32(device):
    # On the GPU: no TF32, so both runs do the same fp32 arithmetic (recomputation included).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    config = PRESETS["tiny"]
    base = LlamaForCausalLM(config)
    data = batches(config, STEPS)
    expected = plain_losses(copy.deepcopy(base), data, 3e-3, 0.1, device)
    model, got = strata_losses(copy.deepcopy(base), data, 3e-3, 0.1, device)
    assert expected[-1] < expected[0] - 0.1  # it learns
    for e, g in zip(expected, got):
        assert abs(e - g) <= 1e-5 * abs(e), (expected, got)
    # Evaluation (no grads) reads the updated blocks from DRAM.
    with torch.no_grad():
        ids = data[0].to(device)
        assert model(ids, labels=ids).loss.item() < got[0]
    stats = model.strata.optimizer.stats()
    assert stats["step"] == STEPS
    model.strata.close()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_offload_inside_no_grad_trains_as_outside(mode):
    # A user's setup code under torch.no_grad() (weight surgery, a loader) or inference_mode:
    # offload makes its graph anchor with grad regardless, and training after it is the same.
    torch.manual_seed(0)
    config = PRESETS["tiny"]
    base = LlamaForCausalLM(config)
    data = batches(config, 2)
    _, expected = strata_losses(copy.deepcopy(base), data, 3e-3, 0.1)
    model = copy.deepcopy(base)  # (a model made in inference mode cannot train anywhere)
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context:
        model = st.offload(model, device="cpu")
    opt = st.AdamW(model, lr=3e-3, weight_decay=0.1)
    got = train(model, opt, data, "cpu")
    opt.synchronize()
    model.strata.close()
    assert got == expected


def test_streaming_through_two_slots_changes_nothing():
    torch.manual_seed(1)
    config = PRESETS["tiny"]
    base = LlamaForCausalLM(config)
    data = batches(config, 3, seed=1)
    _, wide = strata_losses(copy.deepcopy(base), data, 1e-3, 0.0)
    block = sum(p.numel() for p in base.model.layers[0].parameters()) * 4
    # Two slots of one block (weights + grad buffers) each: every block is streamed in, and
    # its slot reused, in both passes.
    model, narrow = strata_losses(copy.deepcopy(base), data, 1e-3, 0.0,
                                  slot_budget=2 * 2 * block + 2 * 4096 * 20)
    assert wide == narrow
    assert model.strata.executor.plan_info().slots == 2
    model.strata.close()


def test_a_gpu_budget_given_in_gib_is_refused_naming_its_unit():
    model = LlamaForCausalLM(PRESETS["tiny"])
    with pytest.raises(ValueError, match=r"gpu_budget=8 bytes .* in bytes \(8 << 30 for 8 GiB\)"):
        st.offload(model, device="cpu", gpu_budget=8)
    assert getattr(model, "strata", None) is None  # nothing was changed


def test_nvme_budget_none_is_no_nvme_tier():
    """nvme_budget=None, documented as 0 and what examples/train.py passes without --nvme,
    offloads without an NVMe tier instead of failing in the runtime's config."""
    model = st.offload(LlamaForCausalLM(PRESETS["tiny"]), device="cpu", nvme_budget=None)
    assert model.strata.runtime.capabilities().tier_budget_bytes[2] == 0
    model.strata.close()


def test_a_forward_without_its_backward_changes_nothing():
    """A forward pass with grad whose loss is dropped (or raised after) is abandoned at the next
    forward pass, as in plain PyTorch; without an optimizer, a forward with grad is refused with
    the way to fix it."""
    config = PRESETS["tiny"]
    model = st.offload(LlamaForCausalLM(config), device="cpu")
    ids = batches(config, 1)[0]
    with pytest.raises(RuntimeError, match="create the optimizer"):
        model(ids, labels=ids)
    torch.manual_seed(4)
    base = LlamaForCausalLM(config)
    expected = plain_losses(copy.deepcopy(base), [ids], 1e-3, 0.0)
    model = st.offload(copy.deepcopy(base), device="cpu")
    opt = st.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    model(ids, labels=ids)  # no backward
    got = train(model, opt, [ids], "cpu")
    assert abs(got[0] - expected[0]) <= 1e-6 * abs(expected[0])
    model.strata.close()


def bf16_reference_losses(model, data, lr, wd, device):
    """Plain PyTorch with the arithmetic Strata's bf16 mode does: bf16 parameters computing in
    bf16, fp32 master copies updated by torch's AdamW and rounded back after every step."""
    model = model.to(device)
    masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    model.to(torch.bfloat16)
    opt = torch.optim.AdamW(masters, lr=lr, weight_decay=wd)
    losses = []
    for ids in data:
        ids = ids.to(device)
        loss = model(ids, labels=ids).loss
        loss.backward()
        for p, m in zip(model.parameters(), masters):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_compute_with_fp32_masters_tracks_the_same_recipe_in_plain_pytorch(device):
    # Same recipe on both sides; what differs is the order of operations in fp32 (the CPU
    # AdamW vs torch's) and in recomputation, whose results bf16 rounds: a weight that lands
    # on the other side of a bf16 rounding boundary changes the next step's matmuls by up to
    # 2^-8 relative. Over 6 steps the losses agree to well under 1% (measured: 2e-4 on the CPU); the
    # bound is 1%, far below the loss's own step-to-step change (~5%).
    torch.manual_seed(2)
    config = PRESETS["tiny"]
    base = LlamaForCausalLM(config)
    data = batches(config, STEPS, seed=2)
    expected = bf16_reference_losses(copy.deepcopy(base), data, 3e-3, 0.1, device)
    model, got = strata_losses(copy.deepcopy(base), data, 3e-3, 0.1, device, dtype=torch.bfloat16)
    assert expected[-1] < expected[0] - 0.1
    for e, g in zip(expected, got):
        assert abs(e - g) <= 1e-2 * abs(e), (expected, got)
    model.strata.close()


def test_hugging_face_llama_and_qwen2_train_like_plain_pytorch():
    transformers = pytest.importorskip("transformers")
    for cls, cfg in ((transformers.LlamaForCausalLM, transformers.LlamaConfig),
                     (transformers.Qwen2ForCausalLM, transformers.Qwen2Config)):
        torch.manual_seed(3)
        config = cfg(vocab_size=256, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=128)
        base = cls(config)
        data = batches(PRESETS["tiny"], 4, seq=16, seed=3)
        data = [d % 256 for d in data]
        expected = plain_losses(copy.deepcopy(base), data, 3e-3, 0.1)
        model, got = strata_losses(copy.deepcopy(base), data, 3e-3, 0.1)
        assert len(model.strata.blocks) == 3
        for e, g in zip(expected, got):
            assert abs(e - g) <= 1e-5 * abs(e), (cls.__name__, expected, got)
        model.strata.close()


def test_automatic_resident_blocks_leave_room_for_the_rest_of_a_meta_model(monkeypatch):
    """On a GPU, offload keeps as many blocks resident as 40% of the free memory holds at 16
    bytes per parameter (bf16: weight, grad, fp32 master, m, v; the update's fp32 grads exist a
    chunk at a time), counting as used what the parameters outside the blocks that
    are not on the device yet (a meta model's embedding and head) will take. Without that, a
    128k-vocabulary 8B kept 7 blocks on an 80 GB GPU and ran out of memory."""
    import dataclasses

    from strata.torch._planning import _auto_resident_blocks
    from strata.torch._surgery import find_blocks
    # A large vocabulary: the embedding and head outweigh several blocks, as at 8B with 128k.
    config = dataclasses.replace(PRESETS["tiny"], vocab_size=8192)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    blocks = list(find_blocks(model))
    per_block = sum(p.numel() for p in blocks[0].parameters()) * 16
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    rest = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks) * 16
    assert rest > 10 * per_block
    # Room for the rest of the model, then 40% of what is left holds exactly 2 blocks (40% of
    # all the free memory would hold every block: at most all but one stream).
    free = rest + (2 * per_block * 5 + 1) // 2
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    device = torch.device("cuda", 0)
    assert _auto_resident_blocks(model, blocks, torch.bfloat16, device, 0) == 2
    # Less free memory than the rest of the model needs: no block stays.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (rest, 2 * free))
    assert _auto_resident_blocks(model, blocks, torch.bfloat16, device, 0) == 0


def test_main_job_starts_from_a_checkpoint(tmp_path):
    """examples/train.py --weights: the main job fine-tunes a safetensors checkpoint. A
    checkpoint of all zeros gives all-zero logits, so the first loss is exactly ln(vocab); a
    random init would not."""
    import math
    import pathlib
    import subprocess
    import sys

    from safetensors.torch import save_model

    model = LlamaForCausalLM(PRESETS["tiny"])
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    save_model(model, str(tmp_path / "model.safetensors"))
    root = pathlib.Path(__file__).resolve().parents[3]
    out = subprocess.run(
        [sys.executable, str(root / "examples" / "train.py"), "--model", "tiny", "--steps", "2",
         "--batch", "2", "--seq", "16", "--device", "cpu", "--weights", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    first = float(out.stdout.split("loss ")[-1].split(" ->")[0])
    assert first == pytest.approx(math.log(PRESETS["tiny"].vocab_size), abs=1e-4), out.stdout


def _split_keeps(initial, got):
    """A split master reads back as the fp32 value it was given, but for one case: a value
    exactly halfway between two bf16 values that rounded down to the even one comes back one
    ulp nearer it (strata.h STRATA_MASTER_SPLIT)."""
    u = initial.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    g = got.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    tie_down = ((u & 0xFFFF) == 0x8000) & (((u >> 16) & 1) == 0)
    return bool(torch.equal(g, torch.where(tie_down, u - 1, u)))


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_split_masters_train_as_separate_ones_in_less_dram(device, monkeypatch):
    """strata.torch keeps a bf16 model's fp32 masters split (strata.h STRATA_MASTER_SPLIT: the
    bf16 weight is the master's upper half, the optimizer keeps the low 16 bits). The masters
    start as the model's fp32 values (split where the values are: on a GPU, there), training
    gives the losses, weights and masters of separate fp32 masters (the layout before), and
    DRAM holds 2 bytes per streamed parameter less."""
    import strata.torch._planning as session
    torch.manual_seed(5)
    config = PRESETS["tiny"]
    base = LlamaForCausalLM(config)
    initial = {n: p.detach().clone() for n, p in base.named_parameters()}
    # Values the split must get right: halfway cases rounding down and up, a subnormal.
    name = "model.layers.1.mlp.down_proj.weight"
    special = [0x3F808000, 0x3F818000, 0xBF808000, 0x00000001, 0x00008000]
    with torch.no_grad():
        flat = dict(base.named_parameters())[name].view(-1)
        bits = torch.tensor(special, dtype=torch.int64).to(torch.uint32).view(torch.int32)
        flat[:len(special)] = bits.view(torch.float32)
        initial[name] = flat.view(initial[name].shape).clone()
    data = batches(config, STEPS, seed=5)
    runs = {}
    for layout in ("separate", "split"):
        monkeypatch.setattr(session, "master_layout", lambda dtype, layout=layout: layout)
        model = st.offload(copy.deepcopy(base), device=device, dtype=torch.bfloat16,
                           resident_blocks=0)
        opt = st.AdamW(model, lr=3e-3, weight_decay=0.1)
        s = model.strata
        streamed = [sp for entries in s.layers for sp in entries if sp.trainable]
        for sp in streamed:
            got = s.read_state(sp, "master")
            want = initial[sp.name].cpu()
            assert _split_keeps(want, got) if layout == "split" else torch.equal(got, want), \
                sp.name
        elements = sum(sp.param.numel() for sp in streamed)
        used = s.runtime.tier_usage("dram")["used"]
        losses = train(model, opt, data, device)
        opt.synchronize()
        masters = {sp.name: s.read_state(sp, "master") for sp in streamed}
        weights = {n: p.detach().cpu().clone() for n, p in model.state_dict().items()}
        runs[layout] = (losses, masters, weights, used, elements)
        model.strata.close()
    (la, ma, wa, ua, n), (lb, mb, wb, ub, _) = runs["separate"], runs["split"]
    assert la[-1] < la[0] - 0.1
    # From the same master an update writes the same weight in both layouts; a nudged master
    # (below) may later round an element differently: losses within 1e-6, weights one bf16 ulp
    # apart at most, in a handful of elements.
    for a, b in zip(la, lb):
        assert abs(a - b) <= 1e-6 * abs(a), (la, lb)
    for key in wa:
        if wa[key].dtype != torch.bfloat16:
            assert torch.equal(wa[key], wb[key]), key
            continue
        ulps = (wa[key].view(torch.int16).int() - wb[key].view(torch.int16).int()).abs()
        assert int(ulps.max()) <= 1 and int((ulps > 0).sum()) <= 4, key
    # The masters: equal but where a halfway value was nudged one ulp (about 1 in 2^17 updated
    # values) and the few updates since rounded on from there.
    for key in ma:
        ulps = (ma[key].view(torch.int32).long() - mb[key].view(torch.int32).long()).abs()
        assert int(ulps.max()) <= 16 and int((ulps > 0).sum()) <= max(4, ulps.numel() // 1000), \
            (key, int(ulps.max()), int((ulps > 0).sum()))
    # 2 bytes per parameter less (each tensor's page rounding and skew on top).
    saved = ua - ub
    assert 2 * n <= saved + 2 * 4096 * len(ma) and saved <= 2 * n + 2 * 4096 * len(ma), (saved, n)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,layout", [(torch.bfloat16, "split"), (torch.bfloat16, "separate"),
                                          (torch.float16, "separate")])
def test_weights_loaded_without_the_optimizer_are_what_the_next_steps_train(dtype, layout, device,
                                                                            monkeypatch, tmp_path):
    """Idiom: mid-training, st.load_checkpoint(path, model) with no optimizer (the weights of a
    checkpoint, the optimizer's moments kept), or model.load_state_dict(weights), as in plain
    PyTorch: the next steps start from the loaded weights. A bf16/fp16 weight's fp32 master
    (streamed: Strata's, in either layout; resident: strata.torch's torch AdamW's) must become
    the loaded weight: a master left as it was would put the old weights back at the next
    update. Checked sharply: a step at lr 0 then changes nothing; and both loads then train
    alike."""
    import strata.torch._planning as session
    monkeypatch.setattr(session, "master_layout", lambda d: layout)
    config = PRESETS["tiny"]
    torch.manual_seed(6)
    base = LlamaForCausalLM(config)
    data = batches(config, 7, seed=6)
    path = str(tmp_path / "weights")
    runs = []
    for load in ("load_checkpoint", "load_state_dict"):
        # One block resident (with the embedding, norm and head): their masters are torch's.
        model = st.offload(copy.deepcopy(base), device=device, dtype=dtype, resident_blocks=1)
        opt = st.AdamW(model, lr=3e-3, weight_decay=0.1)
        train(model, opt, data[:2], device)
        if load == "load_checkpoint":
            st.save_checkpoint(path, model)  # the weights, no optimizer state
        weights = {n: t.clone() for n, t in model.state_dict().items()}
        train(model, opt, data[2:4], device)  # the masters move on
        if load == "load_checkpoint":
            st.load_checkpoint(path, model)
        else:
            model.load_state_dict(weights)
        s = model.strata
        for sp in (sp for entries in s.layers for sp in entries if sp.trainable):
            assert torch.equal(s.read_state(sp, "master"), weights[sp.name].cpu().float()), sp.name
        for g in opt.param_groups:
            g["lr"], g["weight_decay"] = 0.0, 0.0
        train(model, opt, data[4:5], device)
        for name, value in model.state_dict().items():
            assert torch.equal(value, weights[name]), (load, name)
        for g in opt.param_groups:
            g["lr"], g["weight_decay"] = 3e-3, 0.1
        losses = train(model, opt, data[5:], device)
        opt.synchronize()
        runs.append((losses, {n: t.clone() for n, t in model.state_dict().items()}))
        model.strata.close()
    (la, wa), (lb, wb) = runs
    assert la == lb
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key
