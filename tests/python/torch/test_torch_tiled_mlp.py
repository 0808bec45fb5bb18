"""The blocks' MLP over sequence tiles (strata.torch._tiled_mlp, offload(mlp_tiles=); the rule
choosing the tiles is the library's, tests/unit/test_step_plan.cpp and
tests/python/core/test_step_plan.py).

Tolerances. The MLP is per token: a tile's rows are the rows the whole MLP computes, so the
forward output, the loss and the input's grad are bit for bit the untiled ones wherever the
matrix product computes a row the same whatever the number of rows (the CPU's fp32 kernels
here; asserted, so a kernel that did not would show). The weight grads are sums over the tiles
of per-tile products: the same sum in another order, so they agree to fp32 rounding of the sum
(relative to the grad's own scale, ~1e-7 a step; compared at 1e-6 as the parity suite does).
Trained over several steps, the weights then differ by what AdamW makes of those roundings
(the parity suite's PARAM_ATOL 1e-6 after 3 steps at LR 2e-3).

Also here: no tensor of sequence x sequence elements exists in a training step of a Hugging
Face Llama with SDPA attention and no padding mask through strata.torch (the causal mask is
SDPA's is_causal, the rotary tables [seq, head_dim])."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import strata.torch as st  # noqa: E402
from strata.torch import _tiled_mlp  # noqa: E402

import torch_parity_models as tpm  # noqa: E402

transformers.logging.set_verbosity_error()
STEPS = 3


@pytest.fixture(autouse=True)
def _threads(one_torch_thread):
    yield


def tiny(arch, layers=2, attention="sdpa", seed=0):
    torch.manual_seed(seed)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    config = cls[0](vocab_size=tpm.VOCAB, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                    pad_token_id=0)
    config._attn_implementation = attention
    return cls[1](config).train()


def batches(seq=24, batch=2):
    g = torch.Generator().manual_seed(0)
    pair = [torch.randint(3, tpm.VOCAB, (batch, seq), generator=g) for _ in range(2)]
    return [pair[i % 2] for i in range(STEPS)]


def run(model, data, opt):
    """Per step the loss and every grad after its backward; the weights at the end."""
    losses, seen = [], []
    for ids in data:
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        seen.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                     if p.grad is not None})
        opt.step()
        opt.zero_grad()
    tpm.synchronize(opt)
    return losses, seen, tpm.snapshot(model)


def strata_run(monkeypatch, arch, tiles, resident=0, data=None):
    """The run through offload(mlp_tiles=tiles), and the tile sizes each tiled MLP call made."""
    sizes = []
    split = _tiled_mlp._tiles_of

    def recording(x, count):
        parts = split(x, count)
        sizes.append(tuple(p.numel() // p.shape[-1] for p in parts))  # tokens a tile
        return parts

    monkeypatch.setattr(_tiled_mlp, "_tiles_of", recording)
    model = st.offload(tiny(arch), device="cpu", resident_blocks=resident, mlp_tiles=tiles)
    try:
        opt = st.AdamW(model.parameters(), lr=tpm.LR, weight_decay=tpm.WD)
        return run(model, data or batches(), opt), sizes
    finally:
        model.strata.close()


def plain_run(arch, data=None):
    model = tiny(arch)
    return run(model, data or batches(), tpm.plain_adamw(model.parameters()))


def assert_grads(got, expected, rtol=1e-6, later_rtol=1e-5):
    """Each grad within rtol of its own scale at the first step (the same weights: only the
    weight grads' sums are ordered otherwise), later_rtol after (the weights then differ by
    AdamW's response to those roundings: measured 1.3e-6 at the second step)."""
    for step, (g, e) in enumerate(zip(got, expected)):
        assert sorted(g) == sorted(e)
        for name in e:
            scale = e[name].abs().max().item() or 1.0
            diff = (g[name] - e[name]).abs().max().item()
            bound = (rtol if step == 0 else later_rtol) * scale
            assert diff <= bound, "step %d %s: %.3g of %.3g" % (step, name, diff, scale)


def test_the_tiled_function_equals_the_mlp():
    """One MLP, tiled 1..5 ways over 2 x 17 tokens (uneven tiles): the output and the input's
    grad bit for bit, the weight grads within fp32 rounding of their sum."""
    torch.manual_seed(0)
    mlp = tiny("llama").model.layers[0].mlp
    x = torch.randn(2, 17, 64)
    w = torch.randn(2, 17, 64)
    x0 = x.clone().requires_grad_()
    (mlp(x0) * w).sum().backward()
    expected = {n: p.grad.clone() for n, p in mlp.named_parameters()}
    for tiles in (1, 2, 3, 5):
        mlp.zero_grad()
        xt = x.clone().requires_grad_()
        out = _tiled_mlp.run_tiled(mlp, mlp.forward, xt, tiles)
        assert torch.equal(out, mlp(x))
        (out * w).sum().backward()
        assert torch.equal(xt.grad, x0.grad)
        assert_grads([{n: p.grad for n, p in mlp.named_parameters()}], [expected])
    with torch.no_grad():
        assert torch.equal(_tiled_mlp.run_tiled(mlp, mlp.forward, x, 4), mlp(x))


def test_the_mlps_bytes_a_token_are_measured():
    """A Llama MLP (intermediate 128, fp32) saves, per token beside its input: gate's output
    (silu's input), silu's output and up's output (the product's operands), and the product
    (down's input): 4 x 128 x 4 bytes. A block without `mlp`, or an MLP returning more than one
    tensor, measures 0 (never tiled by the plan)."""
    block = tiny("llama").model.layers[0]
    hidden = torch.randn(2, 24, 64)
    assert _tiled_mlp.token_bytes(block, hidden, torch.device("cpu")) == 4 * 128 * 4

    class TwoOutputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = torch.nn.Linear(64, 64)
            self.mlp.forward = lambda x: (torch.nn.functional.linear(
                x, self.mlp.weight, self.mlp.bias), x.sum())

    assert _tiled_mlp.token_bytes(TwoOutputs(), hidden, torch.device("cpu")) == 0
    assert _tiled_mlp.token_bytes(torch.nn.Linear(64, 64), hidden, torch.device("cpu")) == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("resident", [0, 1])
def test_tiled_equals_untiled_and_plain_pytorch(monkeypatch, arch, resident):
    """offload(mlp_tiles=3) against the same offload untiled and plain PyTorch, over 3 AdamW
    steps of 2 x 24 tokens (tiles of 16, 16 and 16): the first step's loss bit for bit (rows
    computed alike), every grad within 1e-6 of its scale, the weights within the parity
    suite's tolerance; each tiled MLP ran over its 3 tiles in the forward and the recompute."""
    (t_losses, t_grads, t_state), calls = strata_run(monkeypatch, arch, 3, resident)
    (u_losses, u_grads, u_state), untiled_calls = strata_run(monkeypatch, arch, None, resident)
    p_losses, p_grads, p_state = plain_run(arch)
    assert t_losses[0] == u_losses[0]
    # The first backward: every grad but the MLP weights' bit for bit (the MLP's input grad is).
    first, untiled_first = t_grads[0], u_grads[0]
    assert all(torch.equal(first[n], untiled_first[n]) for n in untiled_first
               if ".mlp." not in n)
    tpm.assert_losses_close(t_losses, u_losses)
    tpm.assert_losses_close(t_losses, p_losses)
    assert_grads(t_grads, u_grads)
    assert_grads(t_grads, p_grads)
    # AdamW divides each grad by its running RMS: where a weight's grads are small against
    # their roundings, the tiles' other order moves it by a little more than the parity
    # suite's 1e-6 (measured 1.34e-6 on one element of 8192 after 3 steps): a few elements
    # per tensor to 1e-5.
    tpm.assert_state_close(t_state, u_state, outliers=4, outlier_atol=1e-5)
    tpm.assert_state_close(t_state, p_state, outliers=4, outlier_atol=1e-5)
    # 48 tokens in 3 tiles at every call: per step and block a forward, a recompute (a
    # streamed block's backward; a resident one's checkpoint) and the tiles' backward.
    assert set(calls) == {(16, 16, 16)}
    assert len(calls) == STEPS * 2 * 3
    assert untiled_calls == []


def test_mlp_tiles_is_checked():
    with pytest.raises(ValueError, match="mlp_tiles is 0"):
        st.offload(tiny("llama"), device="cpu", mlp_tiles=0)
    with pytest.raises(ValueError, match="mlp_tiles is True"):
        st.offload(tiny("llama"), device="cpu", mlp_tiles=True)


def test_placement_names_the_tiles_and_too_many_are_refused():
    model = st.offload(tiny("llama"), device="cpu", resident_blocks=0, mlp_tiles=2)
    try:
        opt = st.AdamW(model.parameters(), lr=tpm.LR)
        ids = batches()[0]
        model(ids, labels=ids).loss.backward()
        opt.step()
        assert "over 2 sequence tiles" in model.strata.placement()
    finally:
        model.strata.close()
    model = st.offload(tiny("llama"), device="cpu", resident_blocks=0, mlp_tiles=1000)
    try:
        opt = st.AdamW(model.parameters(), lr=tpm.LR)
        ids = batches()[0]
        with pytest.raises(ValueError, match="mlp_tiles=1000 is more than this batch's %d tokens"
                           % ids.numel()):
            model(ids, labels=ids)
    finally:
        model.strata.close()


def test_forced_tiles_on_an_mlp_returning_a_tuple_raise_naming_it():
    model = tiny("llama", layers=1)
    mlp = model.model.layers[0].mlp
    inner = mlp.forward
    mlp.forward = lambda x: (inner(x), None)
    model.model.layers[0].forward = _tuple_mlp_block(model.model.layers[0])
    model = st.offload(model, device="cpu", resident_blocks=0, mlp_tiles=2)
    try:
        opt = st.AdamW(model.parameters(), lr=tpm.LR)
        ids = batches()[0]
        with pytest.raises(TypeError, match="model.layers.0.mlp returned tuple"):
            model(ids, labels=ids)
        del opt
    finally:
        model.strata.close()


def _tuple_mlp_block(block):
    original = block.forward

    def forward(hidden_states, *args, **kwargs):
        block.mlp(hidden_states)  # (the tuple's first element would be used)
        return original(hidden_states, *args, **kwargs)
    return forward


def test_no_sequence_squared_tensor_in_a_long_step():
    """A training step of an HF Llama (SDPA attention, no padding mask) through strata.torch
    at 1 x 512 tokens, tiled: no op makes a tensor of seq x seq / 2 elements or more (the
    largest legitimate ones: the logits and the MLP's intermediates, 512 x 128), in the forward,
    the recompute or the backward."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    seq = 512
    model = st.offload(tiny("llama"), device="cpu", resident_blocks=1, mlp_tiles=2)
    limit = seq * seq // 2
    seen = []

    class Watching(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if torch.is_tensor(t) and t.numel() >= limit:
                    seen.append((str(func), tuple(t.shape)))
            return out

    try:
        opt = st.AdamW(model.parameters(), lr=tpm.LR)
        ids = torch.randint(3, tpm.VOCAB, (1, seq), generator=torch.Generator().manual_seed(1))
        with Watching():
            model(ids, labels=ids).loss.backward()
        opt.step()
        assert not seen, seen
        # The watch sees such a tensor where one is made: with a padding mask, Hugging Face's
        # sdpa path builds a [1, 1, seq, seq] boolean mask (which the step above does not).
        mask = torch.ones(1, seq, dtype=torch.long)
        mask[0, :3] = 0
        with Watching(), torch.no_grad():
            model(ids, attention_mask=mask)
        assert (1, 1, seq, seq) in [shape for _, shape in seen]
    finally:
        model.strata.close()


class _Block(torch.nn.Module):
    """A block with an `mlp` (of no Hugging Face class) beside a sequence-wide part."""

    def __init__(self, hidden=64, intermediate=512):
        super().__init__()
        self.mix = torch.nn.Linear(hidden, hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, intermediate), torch.nn.ReLU(),
                                       torch.nn.Linear(intermediate, hidden))

    def forward(self, x):
        x = x + self.mix(x)
        return x + self.mlp(x)


def test_the_plan_tiles_the_mlp_only_when_the_device_is_short(monkeypatch):
    """strata.torch's part of the automatic decision (strata.torch._spill's, as on a GPU: the
    device's figures made up): the MLP's bytes a token measured (ReLU's output, which the
    second product reuses: 512 x 4 bytes) reach the plan, and its tiles are what the blocks'
    MLPs run over. 4 blocks at 2 x 2048 tokens (1 MiB checkpoints, the MLP's 8 MiB): with
    room for the untiled working set the MLP runs whole; with room for about 12 MiB beside
    what torch holds, the plan tiles it (and spills every checkpoint)."""
    from strata.torch import _spill
    from strata.torch.activations.keeper import ActivationKeeper
    gb = 1 << 30
    memory = {"total": 100 * gb, "free": 0, "reserved": 0, "allocated": 0}
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: memory["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: memory["reserved"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (memory["free"], memory["total"]))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a: type("Properties", (), {"total_memory": memory["total"]}))
    block = _Block()
    x = torch.zeros(2, 2048, 64)

    def decided(room):
        # usable (free + reserved) less the 10% margin less what torch holds: `room`.
        memory.update(free=50 * gb, reserved=10 * gb, allocated=50 * gb - room)
        spiller = _spill.Spiller(torch.device("cpu"), None,
                                 ActivationKeeper(torch.device("cpu"), []), 4)
        spiller.cuda = True  # decided as on a GPU; nothing is copied here
        spiller.forward_begins(block.forward, block, (x,), {})
        spiller.close()
        return spiller

    roomy = decided(200 << 20)
    assert roomy.measured_mlp == {4096: 512 * 4}
    assert [roomy.tiles_at(i) for i in range(4)] == [1] * 4
    assert "mlp: 1 tile of 4096 tokens" in roomy.plan_text
    short = decided(12 << 20)
    tiles = [short.tiles_at(i) for i in range(4)]
    assert 1 < tiles[0] <= 4 and set(tiles) == {tiles[0]}
    assert "MLP over %d tiles" % tiles[0] in short.plan_text
    assert short.fits
