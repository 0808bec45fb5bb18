"""strata.torch's SGD, Adam, Lion and Adagrad against their plain PyTorch counterparts (issue 40).

As test_torch_parity.py: plain PyTorch on the CPU in fp32 with the same seed and data is the
oracle, strata.torch runs the same loop through Strata's host backend, and losses and final
parameters agree within 1e-6 relative; resumes (state_dict, checkpoints) are bit-identical.
The streamed blocks are updated by Strata's CPU kernels, the embedding, final norm and head
by torch's optimizer (Lion: strata.torch's TorchLion), so both paths are checked. torch has no
Lion: its oracle is the reference below, written from the paper's formula (Chen et al. 2023,
as lion-pytorch implements it) independently of strata.torch's."""
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import strata.torch as st  # noqa: E402

from torch_parity_models import (  # noqa: E402
    assert_losses_close, assert_state_close, batches, build, deepcopy, snapshot, synchronize,
    train)

transformers.logging.set_verbosity_error()

STEPS = 4


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models: intra-op threads only cost (as test_torch_parity.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class ReferenceLion(torch.optim.Optimizer):
    """Lion as lion-pytorch's update_fn, one parameter at a time."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                beta1, beta2 = group["betas"]
                p.data.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.clone().mul_(beta1).add(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)


# name -> (strata.torch class, plain counterpart, constructor settings)
CASES = {
    "SGD": (st.SGD, torch.optim.SGD, dict(lr=0.05)),
    "SGD-momentum": (st.SGD, torch.optim.SGD,
                     dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    "SGD-nesterov": (st.SGD, torch.optim.SGD,
                     dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "Adam": (st.Adam, torch.optim.Adam, dict(lr=3e-3, weight_decay=0.1)),
    "Adam-betas": (st.Adam, torch.optim.Adam,
                   dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0)),
    "Lion": (st.Lion, ReferenceLion, dict(lr=3e-4, weight_decay=0.1)),
    "Lion-betas": (st.Lion, ReferenceLion, dict(lr=3e-4, betas=(0.95, 0.98))),
    # Adagrad's first step is lr * g / (|g| + eps): near-sign descent, where grads that differ
    # in their last bits (the streamed blocks' backward) move tiny elements by up to lr
    # apart; a small lr keeps that inside the tolerance (init and eps smooth it in "all").
    "Adagrad": (st.Adagrad, torch.optim.Adagrad, dict(lr=2e-3)),
    "Adagrad-all": (st.Adagrad, torch.optim.Adagrad,
                    dict(lr=0.05, lr_decay=0.1, weight_decay=0.01, initial_accumulator_value=0.1,
                         eps=1e-8)),
}


def groups(model, decay):
    """Two param groups (torch's usual decay / no-decay split), the second with half the lr."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if p.ndim >= 2], **decay},
            {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0}]


def run_both(case, offload, scheduler=None, param_groups=False, steps=STEPS, arch="llama"):
    ours, theirs, kwargs = CASES[case]
    base = build(arch)
    data = batches(steps)

    def params(model):
        if not param_groups:
            return model.parameters()
        return groups(model, {"lr": kwargs["lr"] / 2})

    plain = deepcopy(base)
    plain_opt = theirs(params(plain), **kwargs)
    plain_sched = None if scheduler is None else scheduler(plain_opt)
    expected, _ = train(plain, plain_opt, data, scheduler=plain_sched)
    model = offload(deepcopy(base))
    opt = ours(params(model), **kwargs)
    assert isinstance(opt, torch.optim.Optimizer)
    sched = None if scheduler is None else scheduler(opt)
    got, _ = train(model, opt, data, scheduler=sched)
    synchronize(opt)
    return got, expected, model, plain, opt, plain_opt


@pytest.mark.parametrize("case", sorted(CASES))
def test_plain_loop_matches(case, offload):
    """Idiom: opt = st.<Optimizer>(model.parameters(), ...); backward; step; zero_grad."""
    got, expected, model, plain, _, _ = run_both(case, offload)
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), snapshot(plain))


# Not Lion on GPT-2: its key bias's grad is zero but for rounding noise (softmax ignores a
# shift shared by every key), and Lion moves each element by lr * sign(noise), whatever the
# noise's size, so plain PyTorch's own run is no oracle for it beyond the noise.
@pytest.mark.parametrize("case,arch", [
    (case, arch) for case in ("SGD-momentum", "Adam", "Lion", "Adagrad-all")
    for arch in ("gpt2", "qwen2") if (case, arch) != ("Lion", "gpt2")])
def test_other_architectures(case, arch, offload):
    if (case, arch) == ("Adam", "gpt2") and os.environ.get("STRATA_PARITY_DEVICE") == "cuda":
        # Adam (L2) divides the key bias's noise-only grad (plus wd * p) by its RMS as AdamW
        # does, but from another weight decay path: on an H200 the CUDA run drifted 1.7e-3
        # from the CPU oracle there (KEY_BIAS_ATOL 1e-4), every other parameter within
        # tolerance; on the CPU both sides round alike and it is compared.
        pytest.skip("GPT-2's key bias under Adam: CUDA's rounding noise is no CPU oracle's")
    got, expected, model, plain, _, _ = run_both(case, offload, arch=arch)
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), snapshot(plain))


def one_cycle(momentum):
    return lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=[3 * g["lr"] for g in opt.param_groups], total_steps=STEPS + 1,
        pct_start=0.4, cycle_momentum=momentum)


@pytest.mark.parametrize("case,scheduler", [
    # OneCycleLR cycles Adam's and Lion's beta1 (cycle_momentum's default): read per step.
    ("Adam", one_cycle(True)), ("Lion", one_cycle(True)),
    ("SGD-momentum", one_cycle(False)), ("Adagrad-all", one_cycle(False)),
    ("SGD", lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)),
    ("Adagrad", lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))),
])
def test_param_groups_and_schedulers(case, scheduler, offload):
    """Idiom: per-group lr and weight decay, a scheduler stepping after every opt.step()."""
    got, expected, model, plain, opt, plain_opt = run_both(case, offload, scheduler=scheduler,
                                                           param_groups=True)
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), snapshot(plain))
    for mine, theirs in zip(opt.param_groups, plain_opt.param_groups):
        assert {k: v for k, v in mine.items() if k != "params"}.items() >= \
            {k: v for k, v in theirs.items() if k in ("lr", "betas", "momentum")}.items()


def test_sgd_refuses_a_momentum_change_of_streamed_groups(offload):
    """Strata's SGD takes momentum from its config: OneCycleLR's cycle_momentum=True (which
    changes it) is refused by name, before anything is updated, and so are groups with another
    momentum, before the blocks are laid out."""
    model = offload(build("llama"))
    opt = st.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS)
    ids = batches(1)[0]
    model(ids, labels=ids).loss.backward()
    with pytest.raises(ValueError, match="cycle_momentum=False"):
        opt.step()
    other = offload(build("llama"))
    params = list(other.parameters())
    with pytest.raises(ValueError, match="the same in every group"):
        st.SGD([{"params": params[:3], "momentum": 0.5}, {"params": params[3:]}], lr=0.05,
               momentum=0.9)
    # Refused before the blocks were laid out: an optimizer can still be created.
    assert other.strata.optimizer is None
    st.SGD(other.parameters(), lr=0.05, momentum=0.9)


@pytest.mark.parametrize("case", ["SGD-momentum", "Adam", "Lion", "Adagrad-all"])
def test_state_dict_layout_and_resume(case, offload):
    """state_dict() in the torch optimizer's layout (the same state keys per parameter);
    load_state_dict into a fresh model's optimizer resumes bit for bit."""
    ours, theirs, kwargs = CASES[case]
    data = batches(5, seed=2)
    k = 2
    base = build("llama")
    plain = deepcopy(base)
    plain_opt = theirs(plain.parameters(), **kwargs)
    train(plain, plain_opt, data[:k])
    model = offload(base)
    opt = ours(model.parameters(), **kwargs)
    train(model, opt, data[:k])
    synchronize(opt)
    sd = deepcopy(opt.state_dict())
    plain_sd = plain_opt.state_dict()
    assert sorted(sd["state"]) == sorted(plain_sd["state"])
    for index, entry in sd["state"].items():
        assert set(entry) == set(plain_sd["state"][index]), index
        for key, value in entry.items():
            assert torch.allclose(value.float().cpu(), plain_sd["state"][index][key].float().cpu(),
                                  rtol=1e-5, atol=1e-6), (index, key)
    model_state = snapshot(model)
    a, _ = train(model, opt, data[k:])
    synchronize(opt)
    a_state = snapshot(model)

    fresh = build("llama", seed=99)
    fresh.load_state_dict(model_state)
    fresh = offload(fresh)
    opt2 = ours(fresh.parameters(), **kwargs)
    opt2.load_state_dict(sd)
    b, _ = train(fresh, opt2, data[k:])
    synchronize(opt2)
    assert a == b
    assert_state_close(snapshot(fresh), a_state, exact=True)


@pytest.mark.parametrize("case", ["SGD-momentum", "Adam", "Lion", "Adagrad-all"])
def test_checkpoint_resume_is_bit_identical(case, offload, tmp_path):
    """Idiom: st.save_checkpoint(path, model, opt); a fresh model and optimizer of the same
    kind, st.load_checkpoint(path, model, opt): the next steps are the first run's."""
    ours, _, kwargs = CASES[case]
    data = batches(5)
    k = 2
    model = offload(build("llama"))
    opt = ours(model.parameters(), **kwargs)
    train(model, opt, data[:k])
    path = str(tmp_path / "checkpoint")
    st.save_checkpoint(path, model, opt)
    a, _ = train(model, opt, data[k:])
    synchronize(opt)
    a_state = snapshot(model)
    model.strata.close()

    fresh = offload(build("llama", seed=99))
    opt2 = ours(fresh.parameters(), **kwargs)
    st.load_checkpoint(path, fresh, opt2)
    b, _ = train(fresh, opt2, data[k:])
    synchronize(opt2)
    assert a == b
    assert_state_close(snapshot(fresh), a_state, exact=True)


def test_checkpoint_of_another_kind_is_refused(offload, tmp_path):
    model = offload(build("llama"))
    opt = st.Lion(model.parameters())
    train(model, opt, batches(1))
    path = str(tmp_path / "checkpoint")
    st.save_checkpoint(path, model, opt)
    model.strata.close()
    fresh = offload(build("llama"))
    with pytest.raises(Exception, match="lion"):
        st.load_checkpoint(path, fresh, st.Adam(fresh.parameters()))


def test_zero_initial_state_is_not_built(offload):
    """Creating an optimizer whose state starts at zero (AdamW's moments) writes nothing and
    builds no initial tensor per streamed parameter: the library's state starts zeroed. It
    used to build a zero tensor per parameter and state to test it with any(): for a 30B's
    AdamW about 210 GB written and read, 49 s of an H200 host's 109 s setup (22nd session).
    Adagrad's nonzero initial_accumulator_value is written: "Adagrad-all" above checks it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    model = offload(build("llama"))
    with Ops() as ops:
        st.AdamW(model.parameters(), lr=1e-3)
    assert not ops.seen & {"zeros", "any"}, sorted(ops.seen)
