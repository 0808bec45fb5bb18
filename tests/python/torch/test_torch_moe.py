"""Mixture-of-experts models through strata.torch (issue 53 item 3), on the CPU: every family
users fine-tune (Mixtral, Qwen3-MoE, OLMoE, GPT-OSS, DeepSeek-V3; tiny configs from
moe_models), against plain PyTorch on the same seed.

- The activation keeper's and the spill's measurement (a forward on fake tensors) of a block
  whose expert weights are streamed, i.e. parked on their zero-stride placeholders: the same
  figure as with the weights' values, under each of Hugging Face's experts implementations
  (its grouped_mm checks its operands' strides and refused the placeholders: measured on an
  H100, "Invalid strides/sizes, got (0, 0, 0) ... [128, 2048, 1536]").
- The router's auxiliary loss (output_router_logits=True) trains through strata.torch, with
  its chunked loss, as plain PyTorch does.
- Hugging Face's experts implementations agree with one another, and strata.torch leaves the
  model's choice as it is."""
import logging

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import strata.torch as st  # noqa: E402
from strata.torch._measure import measure  # noqa: E402
from strata.torch._streamed import StreamedParam  # noqa: E402

from moe_models import FAMILIES, ROUTED, experts_implementations, moe_model  # noqa: E402
from torch_parity_models import (  # noqa: E402
    DEVICE, assert_losses_close, assert_state_close, batches, deepcopy, plain_adamw, snapshot,
    synchronize)

transformers.logging.set_verbosity_error()
IMPLEMENTATIONS = experts_implementations()


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny models: one intra-op thread (conftest's one_torch_thread)."""


def block_inputs(model, tokens=16, rows=2):
    """A decoder block's inputs: hidden states and the model's rotary embeddings."""
    hidden = torch.randn(rows, tokens, model.config.hidden_size, device=DEVICE)
    positions = torch.arange(tokens, device=DEVICE)[None].expand(rows, -1)
    return (hidden,), dict(position_embeddings=model.model.rotary_emb(hidden, positions),
                           attention_mask=None)


class MetaFailures(logging.Handler):
    """What torch's fake tensors log when an op's shape function refuses its inputs."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


@pytest.mark.parametrize("implementation", [i for i in IMPLEMENTATIONS if i != "eager"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_parked_expert_block_is_measured(name, implementation):
    """The last block (the routed experts' in every family) measured with its parameters
    parked as strata.torch parks a streamed block's (StreamedParam.park: one NaN element
    expanded to the shape) gives what it gives with their values, the same figure each time,
    and torch logs no refused op. (Hugging Face's eager loop over the experts a batch hits
    has a data-dependent shape, which fake tensors cannot follow: such a block is not
    measured, and stays checkpointed.)"""
    model = moe_model(name, experts_implementation=implementation)
    assert model.config._experts_implementation == implementation
    block = model.model.layers[-1]
    args, kwargs = block_inputs(model)
    params = list(block.parameters())
    assert any(p.dim() == 3 for p in params)  # the experts' weights: one 3-D tensor each
    with_values = measure(block, args, kwargs, torch.device(DEVICE), params)
    assert with_values is not None and with_values[0] > 0
    for i, (local, p) in enumerate(block.named_parameters()):
        StreamedParam(p, local, local, None, i).park(p.dtype, p.device)
    assert all(p.untyped_storage().nbytes() == p.element_size() for p in params)
    failures = MetaFailures()
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    fake_log.addHandler(failures)
    try:
        parked = measure(block, args, kwargs, torch.device(DEVICE), params)
    finally:
        fake_log.removeHandler(failures)
    assert failures.records == []
    assert parked == with_values
    assert measure(block, args, kwargs, torch.device(DEVICE), params) == parked


def steps(model, opt, data, aux=None):
    """The ordinary loop: the losses per step (and each step's auxiliary loss appended to
    `aux`, a list, where given: the router's loss on)."""
    losses = []
    for ids in data:
        out = model(ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
        if aux is not None:
            aux.append(out.aux_loss.item())
    return losses


def strata_adamw(model):
    """st.AdamW with plain_adamw's hyperparameters."""
    defaults = plain_adamw([torch.zeros(1)]).defaults
    return st.AdamW(model.parameters(), lr=defaults["lr"],
                    weight_decay=defaults["weight_decay"])


@pytest.mark.parametrize("kept", [False, True], ids=["recomputed", "kept"])
@pytest.mark.parametrize("resident", [0, 1])
@pytest.mark.parametrize("name", ROUTED)
def test_router_aux_loss_trains_as_plain_pytorch(name, resident, kept, offload):
    """output_router_logits=True with router_aux_loss_coef: through strata.torch, its chunked
    loss on (8 tokens a chunk: the head never computes the whole logits), blocks streamed or
    one resident, recomputed or keeping their costly ops' outputs (the activation keeper's
    selective mode, forced: on a GPU it is measured), the total loss, the auxiliary loss and
    every parameter after four AdamW steps are plain PyTorch's; the auxiliary loss is in the
    total."""
    base = moe_model(name, output_router_logits=True, router_aux_loss_coef=0.5)
    data = batches(4)
    plain = deepcopy(base)
    expected_aux, got_aux = [], []
    expected = steps(plain, plain_adamw(plain.parameters()), data, expected_aux)
    model = offload(deepcopy(base), resident_blocks=resident, chunked_loss=8)
    if kept:
        model.strata.activations.forced_streamed = len(model.strata.blocks)  # the streamed
        model.strata.activations.forced = len(model.strata.resident_blocks)
    heads = []
    model.get_output_embeddings().register_forward_hook(
        lambda m, a, out: heads.append(out.shape[1]))
    opt = strata_adamw(model)
    got = steps(model, opt, data, got_aux)
    synchronize(opt)
    assert heads and set(heads) == {0}  # chunked: no whole logits
    assert_losses_close(got, expected)
    assert_losses_close(got_aux, expected_aux)
    # The chunked loss sums its cross-entropy in another order than the whole logits' (one
    # fp32 rounding of the grads); AdamW divides a grad by its running RMS, so where an
    # element's grads are a few eps that rounding moves it by up to lr x noise / eps: one or
    # two elements of a tensor here (torch 2.15, transformers 5.25: two of Mixtral's and
    # Qwen3-MoE's expert gate_up_proj, by at most 9e-6 after four steps; torch_parity_models'
    # key bias case). Every other element is within 1e-6. (Without the chunked loss Mixtral's
    # every element is; Qwen3-MoE's embedding still has one such element, 7.5e-6 off: the
    # streamed blocks' backward sums in its own order too.)
    assert_state_close(snapshot(model), snapshot(plain), outliers=2, outlier_atol=2e-5)
    # The auxiliary loss is in the total: without it the first loss is 0.5 x aux_loss less.
    unrouted = deepcopy(base)
    unrouted.config.output_router_logits = False
    losses = steps(unrouted, plain_adamw(unrouted.parameters()), data)
    assert abs(losses[0] + 0.5 * expected_aux[0] - expected[0]) <= 1e-5 * abs(expected[0])
    assert 0.5 * expected_aux[0] > 1e-3


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_experts_implementations_agree(name):
    """Hugging Face's experts implementations (its eager loop, batched_mm, grouped_mm) give the
    same loss and grads on the same weights (fp32: within a few roundings)."""
    results = {}
    for implementation in IMPLEMENTATIONS:
        model = moe_model(name, experts_implementation=implementation)
        ids = batches(1)[0]
        loss = model(ids, labels=ids).loss
        loss.backward()
        results[implementation] = (loss.item(), {n: p.grad.clone() for n, p in
                                                 model.named_parameters() if p.grad is not None})
    loss, grads = results["eager"]
    for implementation, (other_loss, other_grads) in results.items():
        assert abs(other_loss - loss) <= 1e-6 * abs(loss), implementation
        assert other_grads.keys() == grads.keys()
        for n, g in grads.items():
            assert torch.allclose(other_grads[n], g, rtol=1e-5, atol=1e-7), (implementation, n)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_each_experts_implementation_trains_as_plain_pytorch(implementation, offload):
    """strata.torch runs the experts through the implementation the model chose (Hugging
    Face's default, grouped_mm, or the user's), left as it was, and trains as plain PyTorch
    does with the same one."""
    base = moe_model("qwen3_moe", experts_implementation=implementation)
    data = batches(3)
    plain = deepcopy(base)
    expected = steps(plain, plain_adamw(plain.parameters()), data)
    model = offload(deepcopy(base))
    assert model.config._experts_implementation == implementation
    opt = strata_adamw(model)
    got = steps(model, opt, data)
    synchronize(opt)
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), snapshot(plain))


def test_grouped_mm_is_hugging_faces_default():
    """A model built without experts_implementation runs its experts through grouped_mm (which
    uses torch's grouped matrix product where the device has one): strata.torch need not set
    it."""
    if "grouped_mm" not in IMPLEMENTATIONS:
        pytest.skip("transformers %s has no grouped_mm experts" % transformers.__version__)
    assert moe_model("qwen3_moe").config._experts_implementation == "grouped_mm"


def test_a_router_recorded_for_its_loss_is_never_run_in_mlp_tiles(offload):
    """The sequence tiles of a block's MLP (strata.torch._tiled_mlp) and the router's loss:
    run in tiles inside the tiled function, without grad, the routers' logits would be recorded
    once per tile and carry no gradient. With output_router_logits=True the user's forced
    tiles refuse, naming the MLP; without it the same MoE MLP runs in tiles and trains as plain
    PyTorch; once Hugging Face's recording hooks sit on the MLP the plan is told it cannot tile
    it (its bytes a token measure 0)."""
    from strata.torch import _tiled_mlp
    routed = offload(moe_model("qwen3_moe", output_router_logits=True,
                               router_aux_loss_coef=0.5), mlp_tiles=2)
    opt = strata_adamw(routed)
    ids = batches(1)[0]
    with pytest.raises(TypeError, match=r"cannot tile the MLP model\.layers\.0\.mlp"):
        routed(ids, labels=ids)
    del opt
    # The hooks are on the MLP now: the plan's measure says it cannot be tiled.
    block = routed.model.layers[0]
    (hidden,), _ = block_inputs(routed)
    assert _tiled_mlp.token_bytes(block, hidden, torch.device(DEVICE)) == 0

    base = moe_model("qwen3_moe")
    data = batches(3)
    plain = deepcopy(base)
    expected = steps(plain, plain_adamw(plain.parameters()), data)
    tiled = offload(deepcopy(base), mlp_tiles=2)
    calls = []
    tiled.strata.allow_inner_hooks = True  # the hook below only observes
    tiled.model.layers[0].mlp.register_forward_hook(lambda m, a, out: calls.append(a[0].shape))
    got = steps(tiled, strata_adamw(tiled), data)
    assert_losses_close(got, expected)
    assert calls and all(shape[0] < data[0].numel() for shape in calls)  # ran in tiles


def test_an_expert_no_token_routes_to_updates_as_plain_pytorch(offload):
    """A mixture of experts' block is fetched whole (docs/architecture.md, "Known limits": at
    real batches every expert is routed), and an expert that a step routes no token to gets
    what torch's AdamW gives a zero grad: its moments decay and decoupled weight decay applies.
    16 experts, 2 active a token, batches of 1 x 4 tokens: at most 8 experts are routed a step,
    so at least 8 are not (counted from the router's choices, not assumed)."""
    base = moe_model("qwen3_moe", num_experts=16)
    data = batches(4, batch=1, seq=4)
    routed_per_step = []

    def count_routed(layer):
        def hook(module, args, out):
            # The router returns (logits, scores, chosen experts).
            routed_per_step[-1].setdefault(layer, set()).update(out[-1].flatten().tolist())
        return hook

    plain = deepcopy(base)
    expected = []
    opt = plain_adamw(plain.parameters())
    handles = [b.mlp.gate.register_forward_hook(count_routed(i))
               for i, b in enumerate(plain.model.layers)]
    for ids in data:
        routed_per_step.append({})
        loss = plain(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    for h in handles:
        h.remove()
    assert all(len(step) == len(plain.model.layers) for step in routed_per_step)
    assert all(0 < len(routed) <= 8 for step in routed_per_step for routed in step.values()), \
        routed_per_step
    model = offload(deepcopy(base))
    opt = strata_adamw(model)
    got = steps(model, opt, data)
    synchronize(opt)
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), snapshot(plain))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_step_plan_gets_each_blocks_active_flops(name):
    """strata.torch's measurement of a block for the step plan (strata_step_block_t
    .active_flops): a routed-experts block counts top_k of its experts (2 of 4 here) and the
    rest whole, a dense block (DeepSeek-V3's first) and a model whose config names no routing
    all their parameters; from them and the rates the plan judges which streamed blocks load
    slower than they compute (here: the MoE ones, with the rates set between the two)."""
    from strata import step_plan
    from strata.torch import _planning
    model = moe_model(name)
    blocks = list(model.model.layers)
    flops, totals = [], []
    for block in blocks:
        total = sum(p.numel() for p in block.parameters())
        routed = sum(p.numel() for n, p in block.named_parameters()
                     if "experts" in n.split(".")[:-1])
        flops.append(_planning.active_flops(block, model.config))
        totals.append(total)
        assert flops[-1] == 2 * (total - routed) + routed  # 2 * routed * 2 / 4
        assert _planning.active_flops(block, None) == 2 * total
    moe = [f < 2 * t for f, t in zip(flops, totals)]
    assert moe == ([False, True] if name == "deepseek_v3" else [True, True])
    assert _planning.routing(model.config) == (2, 4)
    # A device on which a block computes as long as it loads (4 passes of its FLOPs a token
    # against 2 loads of 2 bytes a parameter) at FLOPs a parameter halfway between the last
    # block's routed share and a dense block's 2: the MoE blocks are transfer-bound, a dense
    # one not.
    threshold = (flops[-1] + 2 * totals[-1]) / 2
    tokens, h2d = 1024, 1e9
    plan = step_plan.plan_step(
        [step_plan.Block(t, residency="streamed", active_flops=f)
         for t, f in zip(totals, flops)], tokens=tokens, h2d_bytes_per_second=h2d,
        device_flops_per_second=threshold * tokens * h2d / totals[-1],
        weight_bytes_per_param=2)
    assert [b["transfer_bound"] for b in plan.blocks] == moe
    assert plan.transfer_bound_blocks == sum(moe)
    assert "streamed blocks load their weights" in plan.text
