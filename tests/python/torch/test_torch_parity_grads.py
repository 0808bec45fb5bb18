"""strata.torch against plain PyTorch (issue 12): gradients: accumulation, zero_grad,
clipping, element-wise ops on grads, GradScaler, autograd.grad and grad hooks.

The oracle is plain PyTorch on the CPU in fp32 with the same seed and data; strata.torch runs
on the CPU through Strata's host backend (st.offload(model, device="cpu")). Each test runs one
idiom through the same code on both sides (torch_parity_models.train) and compares:
step-by-step losses within 1e-6 relative, final parameters (model.state_dict()) within 1e-6,
resumes bit-identical. Models: tiny Hugging Face Llama, Qwen2, Mistral and GPT-2 configs
(hidden 64, 2 layers), parametrized over the architectures where the idiom depends on them.
STRATA_PARITY_DEVICE=cuda runs both sides on the GPU instead (fp32, TF32 off). The suite is
split by topic (test_torch_parity*.py); what they share is support/torch_parity_run.py."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import strata.core  # noqa: E402
import strata.torch as st  # noqa: E402

from torch_parity_models import (  # noqa: E402
    DEVICE, assert_grad_close, assert_losses_close, assert_state_close, batches, blocks_of, build,
    deepcopy, plain_adamw, plain_run, snapshot, synchronize, train)
# one_torch_thread: autouse, one intra-op thread for the module's tests.
from torch_parity_run import (  # noqa: E402,F401
    STEPS, assert_trains_on_as_plain, strata_adamw, strata_run, one_torch_thread)

transformers.logging.set_verbosity_error()


# ---------------------------------------------------------------------------------------------
# Gradients: accumulation, zero_grad, clipping.

@pytest.mark.parametrize("micro_batches", [2, 3])
def test_gradient_accumulation(micro_batches, offload):
    """Idiom: (loss / N).backward() per micro-batch, opt.step(); opt.zero_grad() every N
    micro-batches, N never declared to the optimizer."""
    base = build("llama")
    data = batches(2 * micro_batches, seed=1)
    expected, _, expected_state = plain_run(deepcopy(base), data, accumulate=micro_batches)
    got, _, got_state = strata_run(offload, deepcopy(base), data, accumulate=micro_batches)
    assert_losses_close(got, expected)
    assert_state_close(got_state, expected_state)


def test_grads_accumulate_across_steps_without_zero_grad(offload):
    """Idiom: opt.zero_grad() never called: every step's grads add to the previous ones."""
    base = build("llama")
    data = batches(STEPS)
    expected, _, expected_state = plain_run(deepcopy(base), data, zero_grad=False)
    got, _, got_state = strata_run(offload, deepcopy(base), data, zero_grad=False)
    assert_losses_close(got, expected)
    assert_state_close(got_state, expected_state)


def test_zero_grad_set_to_none_false_and_true(offload):
    """Idiom: opt.zero_grad(set_to_none=False) leaves zero-filled grads of every parameter's
    shape; opt.zero_grad() (set_to_none=True) leaves None."""
    base = build("llama")
    data = batches(3)
    expected, _, expected_state = plain_run(deepcopy(base), data, set_to_none=False)
    model = offload(deepcopy(base))
    opt = strata_adamw(model.parameters())
    got, _ = train(model, opt, data, set_to_none=False)
    synchronize(opt)
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), expected_state)
    for name, p in model.named_parameters():
        assert p.grad is not None, "%s: zero_grad(set_to_none=False) left None" % name
        assert p.grad.shape == p.shape, name
        assert not p.grad.any(), "%s: grad not zeroed" % name
    opt.zero_grad()
    assert [n for n, p in model.named_parameters() if p.grad is not None] == []


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_clip_grad_norm_over_model_parameters(arch, offload):
    """Idiom: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) between backward and
    step: the same total norm (streamed and resident grads) and every parameter clipped."""
    base = build(arch)
    data = batches(STEPS)
    expected, expected_norms, expected_state = plain_run(deepcopy(base), data, clip=0.5)
    assert all(n > 0.5 for n in expected_norms)  # the clip bites at every step
    got, got_norms, got_state = strata_run(offload, deepcopy(base), data, clip=0.5)
    assert_losses_close(got_norms, expected_norms)  # the total norms, 1e-6 relative
    assert_losses_close(got, expected)
    assert_state_close(got_state, expected_state)


def test_max_grad_norm_clips_by_the_global_norm(offload):
    """Idiom: st.AdamW(..., max_grad_norm=c) equals clip_grad_norm_(model.parameters(), c)
    then torch's AdamW: one global norm over every parameter, streamed and resident.
    The two sides form the norm's sum in a different order (one rounding of the clip factor,
    ~1e-7); AdamW's update is nearly invariant to a grad's scale, so 1e-6 holds."""
    base = build("llama")
    data = batches(STEPS)
    expected, norms, expected_state = plain_run(deepcopy(base), data, clip=0.5)
    assert all(n > 0.5 for n in norms)
    got, _, got_state = strata_run(offload, deepcopy(base), data,
                                   opt_kwargs={"max_grad_norm": 0.5})
    assert_losses_close(got, expected)
    assert_state_close(got_state, expected_state)


# ---------------------------------------------------------------------------------------------
# Element-wise ops on grads: writes refused, the ops trained as plain PyTorch.

def test_elementwise_writes_into_streamed_grads_are_refused(offload):
    """Mistake: an in-place change of a streamed grad that is not elementwise (cumsum_, a
    transpose in place) or writes it through out= is refused with the documented message,
    before any grad changes; a _foreach_ call holding one refuses before it changes any grad;
    training goes on as plain PyTorch."""
    base = build("llama")
    data = batches(3)
    model = offload(deepcopy(base))
    opt = strata_adamw(model.parameters())
    model(data[0], labels=data[0]).loss.backward()
    weight = blocks_of(model)[0].mlp.down_proj.weight
    embedding = model.get_input_embeddings().weight
    before = weight.grad.clone()
    with pytest.raises(RuntimeError, match="cumsum_.* not elementwise.*elementwise in-place"):
        weight.grad.cumsum_(0)
    with pytest.raises(RuntimeError, match="t_.* not elementwise"):
        weight.grad.t_()
    with pytest.raises(RuntimeError, match="out=.*in place"):
        torch.mul(before, 2.0, out=weight.grad)
    assert torch.equal(weight.grad, before)
    before = embedding.grad.clone()
    with pytest.raises(RuntimeError, match="_foreach_mul_.*shape"):
        torch._foreach_mul_([embedding.grad, weight.grad],
                            [torch.ones_like(embedding), torch.ones(3)])
    assert torch.equal(embedding.grad, before)
    opt.zero_grad()
    assert_trains_on_as_plain(base, model, opt, data)


def ops_loop(model, opt, data, op, accumulate=1, every_micro_batch=False):
    """The ordinary loop with `op(model)` changing the grads in place before each step (and,
    with every_micro_batch, after each backward pass, so the next one adds to the changed
    grads). Returns the per-micro-batch losses."""
    losses = []
    for i, ids in enumerate(data):
        loss = model(ids, labels=ids).loss
        (loss / accumulate).backward()
        losses.append(loss.item())
        if every_micro_batch or (i + 1) % accumulate == 0:
            op(model)
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
    return losses


def grads_of(model):
    return [p.grad for p in model.parameters() if p.grad is not None]


def masks(model, seed):
    """Per parameter, a mask of its shape (halves, ones and zeros), the same on both sides."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 3, p.shape, generator=gen).float() / 2).to(DEVICE)
            for p in model.parameters()]


def mul_by_mask(model):
    for p, m in zip(model.parameters(), masks(model, 7)):
        if p.grad is not None:
            p.grad.mul_(m)


def overflow_then_nan_to_num(model):
    # inf * grad: +-inf, and NaN where the grad is 0; nan_to_num_ maps them to finite values.
    for g in grads_of(model):
        g.mul_(float("inf"))
        g.nan_to_num_(nan=0.0, posinf=1e-3, neginf=-2e-3)


GRAD_OPS = {
    "clip_grad_value": lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 0.02),
    "clamp": lambda m: [g.clamp_(-0.01, 0.03) for g in grads_of(m)],
    "clamp_min_max": lambda m: [g.clamp_min_(-0.02).clamp_max_(0.01) for g in grads_of(m)],
    "nan_to_num": overflow_then_nan_to_num,
    "add_scalar": lambda m: [g.add_(1e-3) for g in grads_of(m)],
    "mul_by_tensor": mul_by_mask,
    "div_by_tensor": lambda m: [g.div_(torch.full_like(g, 4.0)) for g in grads_of(m)],
    "copy_fill": lambda m: [g.copy_(g * 0.5) if i % 2 else g.fill_(1e-3)
                            for i, g in enumerate(grads_of(m))],
    "foreach": lambda m: (torch._foreach_clamp_max_(grads_of(m), 0.01),
                          torch._foreach_add_(grads_of(m), 1e-4)),
}


@pytest.mark.parametrize("loop", [{}, {"accumulate": 2}, {"accumulate": 2,
                                                        "every_micro_batch": True}],
                         ids=["plain", "accumulate", "every_micro_batch"])
@pytest.mark.parametrize("op", sorted(GRAD_OPS))
def test_elementwise_ops_on_grads_train_as_plain_pytorch(op, loop, offload):
    """Idiom: elementwise in-place changes of p.grad between backward and step
    (torch.nn.utils.clip_grad_value_, clamp_, nan_to_num_, add_ of a number, mul_/div_ by a
    tensor of the grad's shape, copy_, fill_, their _foreach_ forms), also on accumulated grads
    and between micro-batches: the same losses and weights as plain PyTorch."""
    base = build("llama")
    data = batches(4 if loop else STEPS, seed=2)
    plain = deepcopy(base)
    plain_opt = plain_adamw(plain.parameters())
    expected = ops_loop(plain, plain_opt, data, GRAD_OPS[op], **loop)
    model = offload(deepcopy(base))
    opt = strata_adamw(model.parameters())
    got = ops_loop(model, opt, data, GRAD_OPS[op], **loop)
    synchronize(opt)
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), snapshot(plain))


@pytest.mark.parametrize("grads", ["host", "device"])
@pytest.mark.parametrize("op", ["clip_grad_value", "mul_by_tensor"])
def test_elementwise_ops_on_grads_then_clip_grad_norm(op, grads, offload):
    """clip_grad_norm_ after an elementwise change sees the changed grads' norm, with the grads
    in DRAM and with offload(grads="device"), where the written grads go back into the
    device's memory."""
    base = build("llama")
    data = batches(STEPS, seed=3)

    def op_then_clip(m):
        GRAD_OPS[op](m)
        norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05).item())

    norms = []
    plain = deepcopy(base)
    expected = ops_loop(plain, plain_adamw(plain.parameters()), data, op_then_clip)
    expected_norms, norms = norms, []
    model = offload(deepcopy(base), grads=grads)
    opt = strata_adamw(model.parameters())
    got = ops_loop(model, opt, data, op_then_clip)
    synchronize(opt)
    assert_losses_close(norms, expected_norms)
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), snapshot(plain))


def test_written_grads_read_back(offload):
    """After an in-place change, p.grad reads the changed values and its norm is theirs (a
    lazy factor before the change is applied first)."""
    base = build("llama")
    data = batches(1)
    plain = deepcopy(base)
    model = offload(deepcopy(base))
    strata_adamw(model.parameters())
    for m in (plain, model):
        m(data[0], labels=data[0]).loss.backward()
        for g in grads_of(m):
            g.mul_(3.0)
            g.clamp_(-0.01, 0.01)
    got = dict(model.named_parameters())
    for name, p in plain.named_parameters():
        assert_grad_close(name, got[name].grad, p.grad)
        # Strata's norm of the written values (its sum of squares), against torch's: the grads
        # agree within 1e-6 of their scale (a recomputed block sums in another order), so the
        # norms within 1e-5.
        assert_losses_close([got[name].grad.norm().item()], [p.grad.norm().item()], rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Idioms found by review after the first version of the fix.

def zero_grad_by_model_loop(model, opt, data):
    """The Hugging Face Trainer's order: step, then model.zero_grad() (not the optimizer's)."""
    losses = []
    for ids in data:
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
        model.zero_grad()
    return losses


def test_model_zero_grad(offload):
    """Idiom: model.zero_grad() instead of opt.zero_grad() (the HF Trainer does this)."""
    base = build("llama")
    data = batches(STEPS)
    plain = deepcopy(base)
    expected = zero_grad_by_model_loop(plain, plain_adamw(plain.parameters()), data)
    model = offload(deepcopy(base))
    opt = strata_adamw(model.parameters())
    got = zero_grad_by_model_loop(model, opt, data)
    synchronize(opt)
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), snapshot(plain))


def grad_scaler_loop(model, opt, data, init_scale=2.0 ** 10):
    """torch.amp.GradScaler: scaled backward, unscale_, clip, scaler.step, update."""
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=init_scale)
    losses = []
    for ids in data:
        loss = model(ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, scaler.get_scale()


@pytest.mark.parametrize("init_scale", [2.0 ** 10, 2.0 ** 70])
def test_grad_scaler_unscale_and_clip(init_scale, offload):
    """Idiom: torch.amp.GradScaler's unscale_ before clipping, scaler.step(opt) (powers of two:
    scaling and unscaling are exact, so the oracle is exact too). At 2^70 the scaled grads are
    finite but their fp32 squares are not: torch finds no inf and steps (the grads' sums of
    squares overflowed and every step was skipped, the scale halved; a long run's scale grows
    there)."""
    base = build("llama")
    data = batches(STEPS)
    plain = deepcopy(base)
    expected, expected_scale = grad_scaler_loop(plain, plain_adamw(plain.parameters()), data,
                                                init_scale)
    model = offload(deepcopy(base))
    opt = strata_adamw(model.parameters())
    got, got_scale = grad_scaler_loop(model, opt, data, init_scale)
    synchronize(opt)
    assert got_scale == expected_scale
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), snapshot(plain))


def test_step_after_a_forward_without_backward(offload):
    """Idiom: an evaluation forward with grad enabled, its loss dropped, between backward and
    step (plain PyTorch allows it; nothing changes)."""
    base = build("llama")
    data = batches(2)

    def loop(model, opt):
        losses = []
        for ids in data:
            loss = model(ids, labels=ids).loss
            loss.backward()
            model(ids, labels=ids)  # dropped
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    plain = deepcopy(base)
    expected = loop(plain, plain_adamw(plain.parameters()))
    model = offload(deepcopy(base))
    opt = strata_adamw(model.parameters())
    got = loop(model, opt)
    synchronize(opt)
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), snapshot(plain))


def test_what_is_refused_is_refused_clearly(offload):
    """Mistakes that cannot train as plain PyTorch does raise, naming the supported way, and
    leave the session usable: a param group added after construction, requires_grad changed on
    a streamed parameter after the optimizer exists, a dtype change after offload. A no-op
    model.to() passes."""
    base = build("llama")
    data = batches(2)
    model = offload(deepcopy(base))
    opt = strata_adamw(model.parameters())
    with pytest.raises(NotImplementedError, match="constructor"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    with pytest.raises(ValueError, match="betas must be two numbers"):
        strata_adamw(model.parameters(), betas=(0.9,))
    # A streamed weight of the wrong shape in load_state_dict: Strata's message alone (not
    # also torch's "Missing key(s)" for a key that is there); the rest loads (its own values).
    sd = model.state_dict()
    key = next(n for n, p in model.named_parameters() if ".layers.0." in n and p.dim() == 2)
    sd[key] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match="has shape") as refused:
        model.load_state_dict(sd)
    assert "Missing key" not in str(refused.value), refused.value
    with pytest.raises(ValueError, match="backend 'gpu' is not"):
        st.offload(deepcopy(base), device=DEVICE, backend="gpu")
    # Betas outside [0, 1) set on a group between steps: refused at the step, naming them.
    opt.param_groups[0]["betas"] = (0.9, 1.0)
    with pytest.raises(strata.InvalidArgument, match="beta2"):
        opt.step()
    opt.param_groups[0]["betas"] = (0.9, 0.999)
    block_param = next(blocks_of(model)[0].parameters())
    block_param.requires_grad_(False)
    ids = data[0]
    with pytest.raises(RuntimeError, match="requires_grad"):
        model(ids, labels=ids)
    block_param.requires_grad_(True)
    with pytest.raises(RuntimeError, match="offloaded"):
        model.to(torch.float64)
    assert model.to(DEVICE) is model
    expected, _, expected_state = plain_run(deepcopy(base), data)
    got, _ = train(model, opt, data)
    synchronize(opt)
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), expected_state)


# ---------------------------------------------------------------------------------------------
# autograd.grad and grad hooks.

def test_autograd_grad_leaves_parameter_grads_alone(offload):
    """Idiom: torch.autograd.grad(loss, inputs_embeds) (saliency, gradient penalties): the
    input grads are plain PyTorch's, no parameter's .grad changes, and training afterwards is
    unaffected."""
    base = build("llama")
    data = batches(3)

    def run(model, opt):
        ids = data[0]
        emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        (g,) = torch.autograd.grad(model(inputs_embeds=emb, labels=ids).loss, emb)
        assert all(p.grad is None for p in model.parameters())
        losses, _ = train(model, opt, data)
        return g.detach().cpu(), losses

    plain = deepcopy(base)
    expected_g, expected = run(plain, plain_adamw(plain.parameters()))
    model = offload(deepcopy(base))
    opt = strata_adamw(model.parameters())
    got_g, got = run(model, opt)
    synchronize(opt)
    assert torch.allclose(got_g, expected_g, rtol=1e-6, atol=1e-9)
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), snapshot(plain))


def test_post_accumulate_grad_hooks_run_per_backward(offload):
    """Idiom: register_post_accumulate_grad_hook (optimizer-in-backward, grad logging): called
    once per backward pass for every parameter that received a grad."""
    model = offload(build("llama"))
    opt = strata_adamw(model.parameters())
    calls = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: calls.update(
            {name: calls.get(name, 0) + 1}))
    ids = batches(1)[0]
    for _ in range(2):
        model(ids, labels=ids).loss.backward()
    assert calls == {name: 2 for name, _ in model.named_parameters()}
    opt.zero_grad()
