"""strata.torch against plain PyTorch where a block's forward does more than return its outputs
(a third new-user trial): it appends to a list it was given, stores a tensor on a module, uses
a trainable tensor it does not own, or shares a parameter with a module outside it; and
parameters read outside their block's forward. Each trains as plain PyTorch does or is
refused with a message that says what to do; the oracle is plain PyTorch on a copy of the same
model and data (test_torch_parity's conventions)."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import strata.torch as st  # noqa: E402

from torch_parity_models import (  # noqa: E402
    DEVICE, LR, WD, assert_losses_close, assert_state_close, batches, build, deepcopy,
    plain_adamw, snapshot, synchronize, train)

transformers.logging.set_verbosity_error()
nn = torch.nn


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py, as `offload` is


WIDTH = 16


class Block(nn.Module):
    """A residual MLP block with a router-like gate; `mode` says what else its forward does:
    "list" appends a statistic (no grad needed) to a list it is given, "aux_list" appends a
    loss term that needs grad, "aux_attr" stores that term on itself."""

    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.gate = nn.Linear(WIDTH, 2)

    def forward(self, h, sink=None):
        p = self.gate(h).softmax(-1)
        aux = (p.mean(0) ** 2).sum()
        if self.mode == "list":
            sink.append(p.detach().mean())
        elif self.mode == "aux_list":
            sink.append(aux)
        elif self.mode == "aux_attr":
            self.aux = aux
        return h + torch.tanh(self.fc(h)) * p[:, :1]


class Net(nn.Module):
    def __init__(self, mode="list", blocks=3):
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(Block(mode) for _ in range(blocks))
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x):
        sink = []
        h = self.inp(x)
        for b in self.blocks:
            h = b(h, sink=sink)
        extra = sum(sink) if self.blocks[0].mode.startswith("aux_list") else 0.0
        if self.blocks[0].mode == "aux_attr":
            extra = sum(b.aux for b in self.blocks)
        return self.out(h), sink, extra


def data(steps=3, rows=4):
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(rows, 8, generator=gen).to(DEVICE),
             torch.randn(rows, 1, generator=gen).to(DEVICE)) for _ in range(steps)]


def steps(model, opt, batches_):
    """MSE plus the model's extra term, one step per batch: (losses, sink lengths)."""
    losses, sinks = [], []
    for x, y in batches_:
        out, sink, extra = model(x)
        loss = nn.functional.mse_loss(out, y) + 0.1 * extra
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        sinks.append(len(sink))
    return losses, sinks


def assert_trains_like_plain(plain, model, sinks=None):
    """`plain` trained by torch's AdamW and `model` (offloaded) by st.AdamW on data(): the same
    losses and state, and each step's sink holding `sinks` entries on both sides (None: not
    compared)."""
    expected, expected_sinks = steps(plain, plain_adamw(plain.parameters()), data())
    got, got_sinks = steps(model, st.AdamW(model.parameters(), lr=LR, weight_decay=WD), data())
    if sinks is not None:
        assert got_sinks == expected_sinks == sinks
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), snapshot(plain))


def test_a_list_a_block_appends_to_reaches_the_caller(offload):
    """Idiom: a block appends a statistic (router load, no grad needed) to a list it was
    given. The block saw a copy and the caller's list stayed empty (found by the trial); it
    gets every entry now, as in plain PyTorch, and training is the same."""
    torch.manual_seed(0)
    base = Net("list").to(DEVICE)
    assert_trains_like_plain(deepcopy(base), offload(deepcopy(base)), sinks=[3, 3, 3])


@pytest.mark.parametrize("mode,where", [("aux_list", "a list or dict it was given"),
                                        ("aux_attr", r"blocks\.\d\.aux")])
def test_a_loss_term_left_behind_by_a_block_is_refused(mode, where, offload):
    """Idiom: a mixture-of-experts block leaves its auxiliary loss in a list it was given or
    on itself (self.aux = ...) instead of returning it. A streamed block's forward runs
    without grad, so the term carried no gradient and the router silently did not train from
    it (the trial: weights 0.015 off in 4 steps): refused at the backward pass, naming where
    it was left; with the blocks returning nothing extra the session trains on as plain
    PyTorch."""
    torch.manual_seed(0)
    base = Net(mode).to(DEVICE)
    model = offload(deepcopy(base))
    opt = st.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    with pytest.raises(NotImplementedError, match=where + ".*instead of returning it"):
        steps(model, opt, data(1))
    opt.zero_grad()
    plain = deepcopy(base)
    for m in (model, plain):
        for block in m.blocks:
            block.mode = "list"
    expected, _ = steps(plain, plain_adamw(plain.parameters()), data())
    got, _ = steps(model, opt, data())
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), snapshot(plain))


class LoraLinear(nn.Module):
    """A linear layer whose low-rank update's factors live elsewhere (on the top model)."""

    def __init__(self, base, a, b):
        super().__init__()
        self.base = base
        self.factors = lambda: (a, b)  # a closure, not submodules: the block does not own them

    def forward(self, x):
        a, b = self.factors()
        return self.base(x) + x @ a @ b


@pytest.mark.parametrize("frozen", [False, True])
def test_a_trainable_tensor_a_block_uses_but_does_not_own_trains(frozen, offload):
    """Idiom: hand-written LoRA whose factors are the top model's parameters, reached from
    inside the blocks through a closure. Their grads came from no block (only their own
    parameters' and inputs' were computed), so they never trained (found by the trial): the
    recompute now adds the grads of every tensor requiring grad that the block's graph
    reaches, as torch's backward does; `frozen`: the blocks' own weights frozen, as LoRA has
    them (their grads were skipped along with the block's: a review found it)."""
    torch.manual_seed(0)
    base = Net("list").to(DEVICE)
    if frozen:
        base.blocks.requires_grad_(False)
    base.lora_a = nn.Parameter((torch.randn(WIDTH, 2) * 0.1).to(DEVICE))
    base.lora_b = nn.Parameter((torch.randn(2, WIDTH) * 0.1).to(DEVICE))
    for block in base.blocks:
        block.fc = LoraLinear(block.fc, base.lora_a, base.lora_b)
    plain = deepcopy(base)
    for block in plain.blocks:  # deepcopy copied the closures' tensors: rebind them
        block.fc.factors = (lambda a, b: lambda: (a, b))(plain.lora_a, plain.lora_b)
    model = deepcopy(base)
    for block in model.blocks:
        block.fc.factors = (lambda a, b: lambda: (a, b))(model.lora_a, model.lora_b)
    model = offload(model)
    assert_trains_like_plain(plain, model)
    assert not torch.equal(model.lora_a.detach(), base.lora_a.detach())


def test_another_blocks_parameter_inside_a_block_is_refused(offload):
    """A block that computes with a parameter of another streamed block (reached through a
    closure): its grad would bypass Strata, where that parameter's grads live. Refused at the
    backward pass, naming it."""
    torch.manual_seed(0)
    model = offload(Net("list").to(DEVICE))
    opt = st.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    borrowed = model.blocks[0].gate.weight
    run = model.blocks[1].gate.forward
    model.blocks[1].gate.forward = lambda h: run(h) + (h @ borrowed.t()) * 0.0
    with pytest.raises(NotImplementedError, match=r"uses parameter 'blocks\.0\.gate\.weight'"):
        steps(model, opt, data(1))


def test_a_parameter_shared_with_a_module_outside_its_block_is_refused(offload):
    """A parameter held by a streamed block and by a resident module (weights tied across
    them): outside its block's forward a streamed parameter is a placeholder, so the resident
    module computed with it, and the trial got torch's in-place-grad message at the backward
    pass. Refused by offload, naming both, with nothing changed."""
    torch.manual_seed(0)
    base = Net("list")
    base.proj = nn.Linear(WIDTH, WIDTH)
    base.proj.weight = base.blocks[0].fc.weight
    with pytest.raises(ValueError, match=r"blocks\.0\.fc\.weight is shared .*\(proj\.weight\)"):
        offload(base)
    assert not hasattr(base, "strata")
    assert all(p.data_ptr() != 0 and torch.isfinite(p).all() for p in base.parameters())


def test_reading_a_streamed_parameter_outside_its_forward_shows(offload):
    """Reading a streamed parameter outside its block's forward (an EMA of the weights, a
    weight-norm log, an L2 penalty over model.parameters()) read zeros and trained silently
    wrong (the trial: an L2 penalty made the loss 35% lower). The placeholder's element is
    NaN now, which shows; model.state_dict() has the values."""
    base = build("llama")
    model = offload(deepcopy(base))
    opt = st.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    weight = model.model.layers[0].mlp.down_proj.weight
    assert torch.isnan(weight.detach().sum())
    assert torch.isnan(torch.nn.utils.parameters_to_vector(model.parameters()).norm())
    assert torch.equal(model.state_dict()["model.layers.0.mlp.down_proj.weight"].cpu(),
                       base.state_dict()["model.layers.0.mlp.down_proj.weight"].cpu())
    ids = batches(1)[0]
    model(ids, labels=ids).loss.backward()  # training is unaffected
    opt.step()
    synchronize(opt)
    assert torch.isfinite(model.state_dict()["model.layers.0.mlp.down_proj.weight"]).all()


def test_reentrant_gradient_checkpointing_is_refused(offload):
    """Hugging Face gradient checkpointing with use_reentrant=True around streamed blocks
    failed in the backward pass with torch's own '.grad()' message: refused at the forward
    pass, naming the fix; use_reentrant=False trains (test_torch_parity)."""
    base = build("llama")
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model = offload(base)
    st.AdamW(model.parameters(), lr=LR)
    ids = batches(1)[0]
    with pytest.raises(NotImplementedError, match="use_reentrant=True.*use_reentrant': False"):
        model(ids, labels=ids)
    with torch.no_grad():
        model(ids, labels=ids)  # evaluation is not refused


def checkpoint_calls(layers):
    """Each layer's __call__ run in torch.utils.checkpoint(use_reentrant=False) in training, as
    Hugging Face gradient checkpointing does up to transformers 5.17 (later releases wrap the
    class's forward, which offload replaces, so no checkpoint surrounds a streamed block)."""
    import functools

    from torch.utils.checkpoint import checkpoint

    class Checkpointed:
        def __call__(self, *args, **kwargs):
            if self.training and torch.is_grad_enabled():
                # No KV cache under checkpointing (the recompute would append to it again).
                kwargs.update({k: None for k in ("past_key_values", "cache") if k in kwargs})
                kwargs.update({"use_cache": False} if "use_cache" in kwargs else {})
                return checkpoint(functools.partial(nn.Module.__call__, self, **kwargs), *args,
                                  use_reentrant=False)
            return nn.Module.__call__(self, *args, **kwargs)

    for layer in layers:
        layer.__class__ = type("Checkpointed" + type(layer).__name__,
                               (Checkpointed, type(layer)), {})


def test_non_reentrant_checkpointing_around_streamed_blocks_trains(offload):
    """Non-reentrant checkpointing around each streamed block's call: the block's backward
    read its saved inputs through the checkpoint's hooks, which recomputed the whole call, and
    so ran the block's forward again mid-backward (the block order error, torch 2.11 +
    transformers 5.17 on the GPU machines; any torch with the checkpoint around the call). It
    trains as plain PyTorch under the same checkpointing."""
    base = build("llama")
    plain, model = deepcopy(base), deepcopy(base)
    checkpoint_calls(plain.model.layers)
    checkpoint_calls(model.model.layers)
    model = offload(model)
    data = batches(3)
    expected, _ = train(plain, plain_adamw(plain.parameters()), data)
    opt = st.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    got, _ = train(model, opt, data)
    synchronize(opt)
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), snapshot(plain))


def test_reentrant_checkpointing_on_the_blocks_loop_is_refused(offload):
    """Older transformers set gradient checkpointing on the module whose forward loops over
    the blocks (LlamaModel), not on the blocks: refused too, naming it (the model's forward
    hook looks at the blocks and the modules around them); on a module that wraps no streamed
    block (the head) it is left alone."""
    import functools

    from torch.utils.checkpoint import checkpoint
    base = build("llama")
    reentrant = functools.partial(checkpoint, use_reentrant=True)
    base.lm_head.gradient_checkpointing = True
    base.lm_head._gradient_checkpointing_func = reentrant
    model = offload(base)
    st.AdamW(model.parameters(), lr=LR)
    ids = batches(1)[0]
    model(ids, labels=ids).loss.backward()
    model.model.gradient_checkpointing = True
    model.model._gradient_checkpointing_func = reentrant
    with pytest.raises(NotImplementedError, match="use_reentrant=True is on for model,"):
        model(ids, labels=ids)


def test_adapters_added_after_offload_are_named(offload):
    """PEFT's get_peft_model (or a hand-written LoRA wrapper) applied after offload: the
    message said to create the optimizer, which the user had done; it says now that adapters
    go on before offload."""
    base = build("llama")
    model = offload(base)
    for layer in model.model.layers:
        layer.self_attn.q_proj.lora = nn.Parameter(torch.zeros(4, device=DEVICE))
    st.AdamW([p for p in model.parameters() if p.requires_grad and p.dim() == 1
              and p.numel() == 4], lr=LR)
    ids = batches(1)[0]
    with pytest.raises(RuntimeError, match="added after strata.torch.offload.*before offload"):
        model(ids, labels=ids)


class Keeping(nn.Module):
    """A block that keeps what it returns (`self.last = out`), appends it to a list it is
    given and keeps its input: tensors the caller holds too, which carry grad in plain torch
    and through the streamed block's autograd function."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, h, hiddens):
        self.seen = h
        out = h + torch.tanh(self.fc(h))
        self.last = out
        hiddens.append(out)
        return out


class KeepingNet(nn.Module):
    def __init__(self, blocks=3):
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(Keeping() for _ in range(blocks))
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x):
        hiddens = []
        h = self.inp(x)
        for b in self.blocks:
            h = b(h, hiddens)
        # The kept tensors feed the loss: their grads must flow as in plain torch.
        extra = sum(t.pow(2).mean() for t in hiddens) + self.blocks[0].last.mean()
        return self.out(h), hiddens, extra


def test_a_block_keeping_its_own_outputs_and_inputs_trains(offload):
    """Tensors a block keeps that are its own outputs (self.last = out, appended to a list it
    is given) or inputs (self.seen = h) carry grad through the block's function, as in plain
    torch: not refused (the first version of the check refused them), and training equals
    plain PyTorch's."""
    torch.manual_seed(0)
    base = KeepingNet().to(DEVICE)
    assert_trains_like_plain(deepcopy(base), offload(deepcopy(base)), sinks=[3, 3, 3])


class Resetting(Block):
    """Block "aux_attr" that clears its attribute first: the freed tensor's id can come back
    for the new one, which an id-based check missed (a review found it)."""

    def forward(self, h, sink=None):
        self.aux = None
        return super().forward(h, sink)


def test_an_attribute_reassigned_is_seen_even_when_its_id_comes_back(offload):
    torch.manual_seed(0)
    model = Net("aux_attr").to(DEVICE)
    for i, block in enumerate(model.blocks):
        fresh = Resetting("aux_attr").to(DEVICE)
        fresh.load_state_dict(block.state_dict())
        model.blocks[i] = fresh
    model = offload(model)
    opt = st.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for x, y in data(5):
        with pytest.raises(NotImplementedError, match="instead of returning it"):
            out, _, extra = model(x)
            (nn.functional.mse_loss(out, y) + extra).backward()
        opt.zero_grad()


class Scaled(nn.Module):
    """A block computing with a scale its model derives from a parameter in its own forward
    (a tensor from outside the block that is not a leaf), reached through a closure."""

    def __init__(self, scale):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.scale = scale

    def forward(self, h):
        return h + torch.tanh(self.fc(h)) * self.scale()


class ScaledNet(nn.Module):
    def __init__(self, blocks=3):
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.log_scale = nn.Parameter(torch.zeros(WIDTH))
        self.current = None
        self.blocks = nn.ModuleList(Scaled(lambda: self.current) for _ in range(blocks))
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x):
        self.current = self.log_scale.exp()
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h), [], 0.0


def test_a_tensor_derived_outside_the_block_trains_its_leaf(offload):
    """The recompute's graph reaches the model's graph through the scale (not a leaf): the
    grads of the parameter it comes from are added as torch's backward adds them (the first
    version backpropagated through that graph twice: 'backward through the graph a second
    time'); the model's own backward pass still runs that part of the graph afterwards."""
    torch.manual_seed(0)
    base = ScaledNet().to(DEVICE)
    plain = deepcopy(base)
    plain.blocks = nn.ModuleList(Scaled(lambda: plain.current) for _ in range(3)).to(DEVICE)
    plain.blocks.load_state_dict(base.blocks.state_dict())
    model = deepcopy(base)
    model.blocks = nn.ModuleList(Scaled(lambda: model.current) for _ in range(3)).to(DEVICE)
    model.blocks.load_state_dict(base.blocks.state_dict())
    assert_trains_like_plain(plain, offload(model))


def test_a_tensor_an_earlier_streamed_block_made_is_refused(offload):
    """A block computing with an earlier streamed block's output reached through a closure
    (not its inputs): the grad cannot flow back through the earlier block's function;
    refused at the backward pass, naming the fix."""
    torch.manual_seed(0)
    model = offload(Net("list").to(DEVICE))
    opt = st.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    kept = {}
    model.blocks[0].register_forward_hook(lambda m, a, out: kept.__setitem__("h", out))
    run = model.blocks[2].fc.forward
    model.blocks[2].fc.forward = lambda h: run(h) + kept["h"] * 0.5
    with pytest.raises(NotImplementedError, match="an earlier streamed block made"):
        steps(model, opt, data(1))


def test_foreign_grads_are_their_own_tensors(offload):
    """Two foreign tensors added to one output get grads of their own (torch's AccumulateGrad
    copies a grad it cannot keep): scaling one leaves the other alone."""
    torch.manual_seed(0)
    base = Net("list").to(DEVICE)
    base.a = nn.Parameter(torch.zeros(4, WIDTH, device=DEVICE))  # the output's shape: the
    base.b = nn.Parameter(torch.zeros(4, WIDTH, device=DEVICE))  # sum hands both one grad
    model = deepcopy(base)
    run = model.blocks[1].fc.forward
    model.blocks[1].fc.forward = (lambda m: lambda h: run(h) + m.a + m.b)(model)
    model = offload(model)
    st.AdamW(model.parameters(), lr=LR)
    out, _, _ = model(data(1)[0][0])
    out.sum().backward()
    assert model.a.grad is not None and torch.equal(model.a.grad, model.b.grad)
    before = model.b.grad.clone()
    model.a.grad.mul_(0.5)
    assert torch.equal(model.b.grad, before)


def test_a_block_registered_under_a_second_name_is_not_refused(offload):
    """model.last = model.blocks[-1] (the same module reached twice): its parameters are
    inside their block, not shared with a module outside it."""
    model = Net("list").to(DEVICE)
    model.last = model.blocks[-1]
    offload(model)


def test_a_list_reaches_the_caller_beside_an_empty_kv_cache(offload):
    """transformers passes an empty KV cache to every block in training (use_cache=True):
    dropped for the forward with grad, it made the block get copies of all its arguments,
    so what it appended to a list was lost again (a review found it); the cache is set to None
    where it is an argument itself, the list stays the caller's."""
    from transformers.cache_utils import DynamicCache

    class Cached(Block):
        def forward(self, h, sink=None, past_key_values=None):
            assert past_key_values is None  # dropped for the forward with grad
            return super().forward(h, sink)

    class CachedNet(Net):
        def forward(self, x):
            sink, cache = [], DynamicCache()
            h = self.inp(x)
            for b in self.blocks:
                h = b(h, sink=sink, past_key_values=cache)
            return self.out(h), sink, 0.0

    torch.manual_seed(0)
    base = CachedNet("list").to(DEVICE)
    for i in range(len(base.blocks)):
        fresh = Cached("list").to(DEVICE)
        fresh.load_state_dict(base.blocks[i].state_dict())
        base.blocks[i] = fresh
    plain = deepcopy(base)
    for block in plain.blocks:  # plain PyTorch gets the (empty) cache itself
        block.forward = (lambda b: lambda h, sink=None, past_key_values=None:
                         Block.forward(b, h, sink))(block)
    assert_trains_like_plain(plain, offload(deepcopy(base)), sinks=[3, 3, 3])
