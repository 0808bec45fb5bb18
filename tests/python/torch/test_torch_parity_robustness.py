"""strata.torch against plain PyTorch (issue 12): robustness: a step that fails midway, hooks,
models whose blocks keep buffers, branch, skip or repeat, misuse refused clearly.

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
import strata.torch as st  # noqa: E402

from torch_parity_models import (  # noqa: E402
    DEVICE, StatefulBlock, assert_losses_close, assert_state_close, batches, blocks_of, build,
    deepcopy, plain_adamw, plain_run, snapshot, synchronize, train)
# one_torch_thread: autouse, one intra-op thread for the module's tests.
from torch_parity_run import (  # noqa: E402,F401
    assert_trains_on_as_plain, mse_steps, open_runtimes, regression_data, strata_adamw, strata_run,
    one_torch_thread)

transformers.logging.set_verbosity_error()


# ---------------------------------------------------------------------------------------------
# Robustness.

def arm_failure(model, failure):
    """Makes the next forward pass of `model` (a plain model, before any offload) raise inside
    the step; returns the labels to use and a switch to disarm it."""
    armed = [False]

    def hook(module, args, output):
        if armed[0]:
            raise RuntimeError("injected failure")

    def raise_in_backward(module, args, output):
        # A grad hook on block 0's output: it raises in the backward pass after every later
        # block's backward finished and before block 0's.
        if armed[0]:
            out = output[0] if isinstance(output, tuple) else output
            out.register_hook(lambda grad: hook(None, None, None))

    if failure == "block_forward_hook":
        blocks_of(model)[1].register_forward_hook(hook)
    elif failure == "hook_inside_block":
        blocks_of(model)[1].mlp.register_forward_hook(hook)
    elif failure.startswith("backward"):
        blocks_of(model)[0].register_forward_hook(raise_in_backward)
    return armed


def run_with_failing_step(model, opt, data, failure, armed):
    """data[0] trains; data[1]'s forward raises (int32 labels raise in the loss, after every
    block ran; a hook raises after or inside block 1); data[2:] train."""
    losses = train(model, opt, data[:1])[0]
    ids = data[1]
    labels = ids.to(torch.int32) if failure == "int32_labels" else ids
    armed[0] = True
    with pytest.raises(RuntimeError):
        model(ids, labels=labels).loss.backward()
    armed[0] = False
    opt.zero_grad(set_to_none=failure != "backward_zero_grad_keeping_zeros")
    return losses + train(model, opt, data[2:])[0]


@pytest.mark.parametrize("failure", ["int32_labels", "block_forward_hook", "hook_inside_block",
                                     "backward", "backward_zero_grad_keeping_zeros"])
def test_exception_mid_step_leaves_a_usable_session(failure, offload):
    """Idiom: a step raises mid-forward (int32 labels raising in the loss; an exception from a
    forward hook on or inside a block) or mid-backward (a grad hook between blocks), the loop
    zeroes the grads and goes on. The next steps train as in plain PyTorch, where the failed
    step left nothing behind once the grads were zeroed: the grads of the blocks whose
    backward had finished are .grad as soon as they land, so zero_grad drops them (before,
    they appeared only at the next forward pass, after zero_grad, and added to its grads)."""
    base = build("llama")
    data = batches(4)
    plain = deepcopy(base)
    armed = arm_failure(plain, failure)
    expected = run_with_failing_step(plain, plain_adamw(plain.parameters()), data, failure, armed)
    model = deepcopy(base)
    armed = arm_failure(model, failure)
    model = offload(model)
    model.strata.allow_inner_hooks = failure == "hook_inside_block"  # it only raises
    opt = strata_adamw(model.parameters())
    got = run_with_failing_step(model, opt, data, failure, armed)
    synchronize(opt)
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), snapshot(plain))


def aux_loss_run(model, opt, data, hooked):
    """An auxiliary loss from what forward hooks on each block's MLP capture (activation
    regularization; a mixture-of-experts router's balancing loss is collected this way)."""
    captured, losses = [], []
    handles = [b.mlp.register_forward_hook(lambda module, args, out: captured.append(out))
               for b in blocks_of(model)] if hooked else []
    try:
        for ids in data:
            captured.clear()
            loss = model(ids, labels=ids).loss
            (loss + 10.0 * sum(o.pow(2).mean() for o in captured)).backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        for h in handles:
            h.remove()
    return losses


def test_forward_hooks_inside_streamed_blocks_are_refused(offload):
    """Idiom: forward hooks inside a block capture activations for an auxiliary loss. A
    streamed block's forward runs without grad (and again in the backward pass), so what they
    capture has no gradient: the auxiliary loss silently did not train (found by a new-user
    trial; Mixtral's router loss is collected through such hooks). Refused with a message that
    names the module; the session trains on as plain PyTorch once the hooks are gone; under
    no_grad, or with allow_inner_hooks for hooks that only observe, they run."""
    base = build("llama")
    data = batches(3)
    model = offload(deepcopy(base))
    opt = strata_adamw(model.parameters())
    with pytest.raises(NotImplementedError, match=r"model\.layers\.0\.mlp.*no gradient"):
        aux_loss_run(model, opt, data[:1], hooked=True)
    with torch.no_grad():
        handle = blocks_of(model)[1].mlp.register_forward_hook(lambda *a: None)
        model(data[0])
        handle.remove()
    assert_trains_on_as_plain(base, model, opt,
                              loop=lambda m, o: aux_loss_run(m, o, data, hooked=False))
    seen = []
    handle = blocks_of(model)[1].mlp.register_forward_hook(lambda *a: seen.append(1))
    model.strata.allow_inner_hooks = True
    model(data[0], labels=data[0]).loss.backward()
    opt.zero_grad()
    handle.remove()
    assert seen  # allowed: it ran


# ---------------------------------------------------------------------------------------------
# Models whose blocks keep buffers, branch, skip or repeat; misuse refused clearly.

class StatefulNet(torch.nn.Module):
    def __init__(self, width=16, blocks=3):
        super().__init__()
        self.inp = torch.nn.Linear(8, width)
        self.blocks = torch.nn.ModuleList(StatefulBlock(width) for _ in range(blocks))
        self.out = torch.nn.Linear(width, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


@pytest.mark.parametrize("resident", [0, 1])
def test_buffers_a_block_changes_change_once_a_step(resident, offload):
    """Idiom: a block's forward updates buffers in place (BatchNorm's running statistics, a
    counter). The recompute in the backward pass repeats the forward: it ran on buffers the
    forward had already changed (the counter computed other values, so other grads) and
    changed them again (BatchNorm's statistics moved twice a step); found by a new-user trial.
    Now each step changes them once, as in plain PyTorch, for streamed and resident blocks,
    and the evaluation after training agrees."""
    torch.manual_seed(0)
    base = StatefulNet().to(DEVICE)
    xs, ys = regression_data(4, 32)

    def run(model, opt):
        losses = mse_steps(model, opt, xs, ys)
        model.eval()
        with torch.no_grad():
            losses.append(torch.nn.functional.mse_loss(model(xs[0]), ys[0]).item())
        model.train()
        return losses

    plain = deepcopy(base)
    expected = run(plain, plain_adamw(plain.parameters()))
    model = offload(deepcopy(base), resident_blocks=resident)
    opt = strata_adamw(model.parameters())
    got = run(model, opt)
    synchronize(opt)
    assert_losses_close(got, expected)
    state = snapshot(model)
    assert all(state["blocks.%d.calls" % i].item() == len(xs) + 1 for i in range(3))
    assert all(state["blocks.%d.bn.num_batches_tracked" % i].item() == len(xs) for i in range(3))
    assert_state_close(state, snapshot(plain))


class BranchingBlock(torch.nn.Module):
    """A block with a branch a step may not take (a mixture-of-experts expert that got no
    tokens): `extra` gets no grad then."""

    def __init__(self, width):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.extra = torch.nn.Linear(width, width)
        self.use_extra = True

    def forward(self, x):
        y = x + torch.tanh(self.lin(x))
        return y + 0.1 * self.extra(x) if self.use_extra else y


class BranchingNet(torch.nn.Module):
    def __init__(self, width=16, blocks=2):
        super().__init__()
        self.inp = torch.nn.Linear(8, width)
        self.blocks = torch.nn.ModuleList(BranchingBlock(width) for _ in range(blocks))
        self.out = torch.nn.Linear(width, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_parameter_without_grad_is_not_updated(set_to_none, offload):
    """Idiom: a block's branch not taken in a step leaves its parameters' grads None, and
    torch's AdamW skips them (no moment decay, no weight decay); they were updated with a zero
    grad (found by a new-user trial). Steps: the branch taken; not taken; taken in one of two
    accumulated micro-batches; taken. With zero_grad(set_to_none=False) the grads are zeros
    instead, and torch updates with them: so does Strata."""
    torch.manual_seed(0)
    base = BranchingNet().to(DEVICE)
    xs, ys = regression_data(5, 16)
    plan = [[True], [False], [False, True], [True]]  # per step: each micro-batch's branch

    def run(model, opt):
        losses, seen, i = [], [], 0
        for micro in plan:
            for use in micro:
                for b in model.blocks:
                    b.use_extra = use
                loss = torch.nn.functional.mse_loss(model(xs[i]), ys[i])
                loss.backward()
                losses.append(loss.item())
                i += 1
            seen.append(model.blocks[0].extra.weight.grad is None)
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        return losses, seen

    plain = deepcopy(base)
    expected, expected_seen = run(plain, plain_adamw(plain.parameters()))
    model = offload(deepcopy(base))
    opt = strata_adamw(model.parameters())
    got, got_seen = run(model, opt)
    synchronize(opt)
    assert got_seen == expected_seen
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), snapshot(plain))


class OrderedNet(BranchingNet):
    """BranchingNet running its blocks in `order` (LayerDrop skips some, a looped model
    repeats one)."""

    def __init__(self, blocks=3):
        super().__init__(blocks=blocks)
        self.order = list(range(blocks))

    def forward(self, x):
        h = self.inp(x)
        for i in self.order:
            h = self.blocks[i](h)
        return self.out(h)


@pytest.mark.parametrize("order,match", [
    ([0, 2], "block 2 ran its forward pass where block 1 was next"),
    ([0, 1], r"ran streamed blocks 0\.\.1 of 3"),
    ([0, 1, 1, 2], "block 1 ran its forward pass where block 2 was next"),
    ([2, 1, 0], "block 2 ran its forward pass where block 0 was next"),
])
def test_blocks_skipped_repeated_or_reordered_are_refused(order, match, offload):
    """Mistake: LayerDrop, an early exit, a repeated or reordered block, with grad. Refused
    with a message that says what is supported (the executor's "acquire of layer 2 out of
    order", "acquire outside a step" or the retain_graph message came before; found by a
    new-user trial), and the session trains on as plain PyTorch."""
    torch.manual_seed(0)
    base = OrderedNet().to(DEVICE)
    xs, ys = regression_data(3, 16)
    model = offload(deepcopy(base))
    opt = strata_adamw(model.parameters())
    model.order = order
    with pytest.raises(RuntimeError, match=match):
        torch.nn.functional.mse_loss(model(xs[0]), ys[0]).backward()
    opt.zero_grad()
    model.order = [0, 1, 2]
    assert_trains_on_as_plain(base, model, opt, loop=lambda m, o: mse_steps(m, o, xs, ys))


def test_shared_blocks_are_refused_before_anything_changes(offload):
    """Mistake: one block applied N times (ALBERT), or blocks with tied parameters: refused at
    offload, naming the blocks (the optimizer raised ALREADY_EXISTS at every retry before;
    found by a new-user trial), and the model is left as it was."""
    model = OrderedNet()
    model.blocks = torch.nn.ModuleList([model.blocks[0]] * 3)
    before = snapshot(model)
    with pytest.raises(ValueError, match="blocks 0 and 1 share parameter 'lin.weight'"):
        offload(model)
    assert getattr(model, "strata", None) is None
    assert_state_close(snapshot(model), before, exact=True)
    tied = OrderedNet()
    tied.blocks[2].extra.weight = tied.blocks[1].lin.weight
    with pytest.raises(ValueError, match="blocks 1 and 2 share parameter"):
        offload(tied)


def test_hidden_states_train_and_output_capturing_hooks_are_told_apart(offload):
    """Idiom: output_hidden_states=True in a training forward and a loss on a hidden state.
    transformers installs its output-capturing hooks on every recordable module (attention
    layers inside the blocks too) the first time any output is recorded; they capture only what
    the running forward asks for. The inner-hook refusal counted them all and refused this
    idiom and every training forward after it (found by a second new-user trial); hidden
    states come from the blocks' outputs and carry gradients, so this trains as plain PyTorch;
    so does a loss on output_attentions (captured inside the blocks: their records carry the
    block's gradient, strata.torch._captured)."""
    base = build("llama")
    data = batches(3)

    def run(model, opt, what="hidden_states"):
        losses = []
        for ids in data:
            out = model(ids, labels=ids, **{"output_" + what: True})
            (out.loss + 0.1 * getattr(out, what)[1].pow(2).mean()).backward()
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.item())
        losses.append(model(data[0], labels=data[0]).loss.item())  # the hooks stay installed
        return losses

    plain = deepcopy(base)
    plain_opt = plain_adamw(plain.parameters())
    expected = run(plain, plain_opt)
    model = offload(deepcopy(base))
    opt = strata_adamw(model.parameters())
    got = run(model, opt)
    synchronize(opt)
    assert_losses_close(got, expected)
    # AdamW near eps rounds a few elements apart (issue 12's tolerance, as elsewhere here).
    assert_state_close(snapshot(model), snapshot(plain), outliers=2, outlier_atol=1e-4)
    expected = run(plain, plain_opt, "attentions")
    got = run(model, opt, "attentions")
    synchronize(opt)
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), snapshot(plain), outliers=2, outlier_atol=1e-4)


@pytest.mark.parametrize("resident", [0, 1])
def test_eval_between_forward_and_backward_keeps_the_forwards_dropout(resident, offload):
    """Idiom: model.eval() between the forward and the backward pass (a callback's evaluation),
    dropout on. The recompute ran in eval mode, so the grads were those of a forward without
    dropout (found by a second new-user trial); it now runs with the forward's train/eval
    flags, and the flags the user set stay."""
    base = build("gpt2", dropout=0.1)
    data = batches(3)

    def run(model, opt):
        losses = []
        for ids in data:
            loss = model(ids, labels=ids).loss
            model.eval()
            with torch.no_grad():
                model(ids)
            loss.backward()
            assert not model.training and not blocks_of(model)[0].training
            model.train()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    plain = deepcopy(base)
    torch.manual_seed(1)
    expected = run(plain, plain_adamw(plain.parameters()))
    model = offload(deepcopy(base), resident_blocks=resident)
    opt = strata_adamw(model.parameters())
    torch.manual_seed(1)
    got = run(model, opt)
    synchronize(opt)
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), snapshot(plain), outliers=2, outlier_atol=1e-4)


def test_double_backward_is_refused_clearly(offload):
    """Idiom: a gradient penalty, torch.autograd.grad(loss, inputs_embeds, create_graph=True),
    then (loss + penalty).backward(). Not supported through streamed blocks; it said "a forward
    pass that is no longer the current one ... retain_graph" (second new-user trial). Now it
    says create_graph, and the session trains on as plain PyTorch."""
    base = build("llama")
    data = batches(3)
    model = offload(deepcopy(base))
    opt = strata_adamw(model.parameters())
    ids = data[0]
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    loss = model(inputs_embeds=embeds, labels=ids).loss
    with pytest.raises(NotImplementedError, match="create_graph=True"):
        torch.autograd.grad(loss, embeds, create_graph=True)
    opt.zero_grad()
    assert_trains_on_as_plain(base, model, opt, data)


def test_functional_call_with_grad_is_refused(offload):
    """Idiom: torch.func.functional_call with swapped-in parameters. Under no_grad it computes
    with them as in torch; with grad the streamed blocks delivered grads to the model's own
    parameters and none to the swapped-in ones (found by a second new-user trial): refused,
    naming the parameter."""
    base = build("llama")
    ids = batches(1)[0]
    other = {k: v + 0.01 for k, v in build("llama", seed=1).state_dict().items()}
    plain = deepcopy(base)
    with torch.no_grad():
        expected = torch.func.functional_call(plain, other, (ids,)).logits
    model = offload(deepcopy(base))
    strata_adamw(model.parameters())
    with torch.no_grad():
        got = torch.func.functional_call(model, other, (ids,)).logits
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(NotImplementedError, match="is not the model's own"):
        torch.func.functional_call(model, other, (ids,), {"labels": ids}).loss.backward()


def test_offload_twice_raises_a_clear_error(offload):
    """Idiom (mistake): st.offload on a model already offloaded: a clear error saying so, and
    the first session still trains as plain PyTorch."""
    base = build("llama")
    data = batches(3)
    expected, _, expected_state = plain_run(deepcopy(base), data)
    model = offload(deepcopy(base))
    with pytest.raises((ValueError, RuntimeError), match=r"(?i)already"):
        st.offload(model, device=DEVICE)
    got, _, got_state = strata_run(lambda m: m, model, data)
    assert_losses_close(got, expected)
    assert_state_close(got_state, expected_state)


def test_failed_offload_releases_its_memory_and_a_retry_works(offload):
    """Idiom: st.offload fails (a 1-byte host budget); the model is left as it was, the failed
    call's runtime is closed (its pinned memory released), and a retry with a sane budget
    trains as plain PyTorch."""
    base = build("llama")
    data = batches(3)
    expected, _, expected_state = plain_run(deepcopy(base), data)
    model = deepcopy(base)
    before = open_runtimes()
    with pytest.raises((RuntimeError, ValueError, MemoryError)):
        offload(model, host_budget=1)
    assert open_runtimes() == before, "the failed offload left its runtime open"
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in base.named_parameters()]
    assert_state_close(snapshot(model), snapshot(base), exact=True)
    got, _, got_state = strata_run(offload, model, data)
    assert_losses_close(got, expected)
    assert_state_close(got_state, expected_state)


def test_use_after_close_raises_a_clear_error(offload):
    """Idiom (mistake): the model used after model.strata.close(): a clear error naming it."""
    model = offload(build("llama"))
    opt = strata_adamw(model.parameters())
    ids = batches(1)[0]
    train(model, opt, [ids])
    synchronize(opt)
    model.strata.close()
    with pytest.raises((RuntimeError, ValueError), match=r"(?i)closed"):
        model(ids, labels=ids).loss.backward()
    with pytest.raises((RuntimeError, ValueError), match=r"(?i)closed"):
        with torch.no_grad():
            model(ids, labels=ids)
    for call in (opt.state_dict, opt.synchronize):
        with pytest.raises(RuntimeError, match="closed"):
            call()


def test_writes_into_streamed_parameters_are_refused(offload):
    """Mistake: writing a streamed parameter in place outside its forward (p.fill_, nn.init)
    or assigning p.data: refused when next seen, naming the way; another parameter (or model)
    is never affected."""
    model = offload(build("llama"))
    strata_adamw(model.parameters())
    first, other = list(blocks_of(model)[0].parameters())[:2]
    before = snapshot(model)
    with torch.no_grad():
        first.fill_(1.0)
    ids = batches(1)[0]
    with pytest.raises(RuntimeError, match="written in place"):
        model(ids, labels=ids)
    assert_state_close(snapshot(model), before, exact=True)
    other.data = torch.ones_like(other)
    with pytest.raises(RuntimeError, match="assigned"):
        model.state_dict()


def test_copying_an_offloaded_model_says_why_not(offload, tmp_path):
    """Mistake: deepcopy(model) / torch.save(model) of an offloaded model: a clear error
    naming the ways to save or copy it (a live runtime cannot be copied)."""
    import copy
    model = offload(build("llama"))
    strata_adamw(model.parameters())
    with pytest.raises(TypeError, match="cannot be pickled or deep-copied"):
        copy.deepcopy(model)
    with pytest.raises(TypeError, match="cannot be pickled or deep-copied"):
        torch.save(model, tmp_path / "model.pt")
