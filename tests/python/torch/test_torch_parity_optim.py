"""strata.torch against plain PyTorch (issue 12): the optimizer as a torch.optim.Optimizer
(param groups, LR schedulers), dropout, frozen parameters, LoRA.

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

from torch_parity_models import (  # noqa: E402
    LR, WD, assert_losses_close, assert_state_close, batches, build, deepcopy, plain_adamw,
    plain_run, snapshot, synchronize, train)
# one_torch_thread: autouse, one intra-op thread for the module's tests.
from torch_parity_run import (  # noqa: E402,F401
    STEPS, strata_adamw, strata_run, one_torch_thread)

transformers.logging.set_verbosity_error()


# ---------------------------------------------------------------------------------------------
# The optimizer as a torch.optim.Optimizer.

def decay_groups(model):
    """The usual LLM recipe: no weight decay for norms and biases (1-d parameters), and here a
    different learning rate for them too."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0, "lr": 3 * LR}]


def test_param_groups_with_per_group_lr_and_weight_decay(offload):
    """Idiom: AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay,
    "weight_decay": 0.0, "lr": ...}]) (Qwen2: biases and norms in the second group)."""
    base = build("qwen2")
    data = batches(STEPS)
    expected, _, expected_state = plain_run(deepcopy(base), data, params=decay_groups)
    model = offload(deepcopy(base))
    opt = strata_adamw(decay_groups(model))
    assert [(len(g["params"]), g["lr"], g["weight_decay"]) for g in opt.param_groups] == \
        [(len(g["params"]), g.get("lr", LR), g["weight_decay"]) for g in decay_groups(base)]
    got, _ = train(model, opt, data)
    synchronize(opt)
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), expected_state)


def test_optimizer_is_a_torch_optimizer(offload):
    """Idiom: code that takes a torch.optim.Optimizer (HF Trainer, schedulers): isinstance,
    param_groups holding the model's parameters, state_dict() in torch's layout."""
    model = offload(build("llama"))
    opt = strata_adamw(model.parameters())
    assert isinstance(opt, torch.optim.Optimizer)
    assert len(opt.param_groups) == 1
    group = opt.param_groups[0]
    assert {id(p) for p in group["params"]} == {id(p) for p in model.parameters()}
    for key, value in (("lr", LR), ("weight_decay", WD), ("betas", (0.9, 0.999)), ("eps", 1e-8)):
        assert group[key] == value, key
    ids = batches(1)[0]
    model(ids, labels=ids).loss.backward()
    opt.step()
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups"}
    assert len(sd["param_groups"]) == 1 and sd["param_groups"][0]["lr"] == LR


SCHEDULERS = {
    "LambdaLR-warmup": lambda opt: torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 3)),
    "CosineAnnealingLR": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4),
    # cycle_momentum=True (its default): beta1 changes at every step, the bias corrections
    # with it (issue 40: this was refused at the second step).
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=3 * LR, total_steps=STEPS + 1, pct_start=0.4),
}


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_lr_scheduler(scheduler, offload):
    """Idiom: scheduler = LambdaLR(opt, ...) / CosineAnnealingLR(opt, ...) / OneCycleLR(opt, ...);
    scheduler.step()
    after every opt.step()."""
    base = build("llama")
    data = batches(STEPS)
    plain = deepcopy(base)
    plain_opt = plain_adamw(plain.parameters())
    plain_sched = SCHEDULERS[scheduler](plain_opt)
    expected, _ = train(plain, plain_opt, data, scheduler=plain_sched)
    model = offload(deepcopy(base))
    opt = strata_adamw(model.parameters())
    sched = SCHEDULERS[scheduler](opt)
    got, _ = train(model, opt, data, scheduler=sched)
    synchronize(opt)
    assert sched.get_last_lr() == plain_sched.get_last_lr()
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), snapshot(plain))


# ---------------------------------------------------------------------------------------------
# Dropout, frozen parameters, LoRA.

def test_dropout_recompute_is_rng_exact(offload):
    """Idiom: model.train() with dropout (GPT-2, p=0.1 on embeddings, attention and residuals):
    the recomputed forward uses the forward's masks (torch.utils.checkpoint's
    preserve_rng_state=True), so with torch.manual_seed set identically the losses are plain
    PyTorch's."""
    base = build("gpt2", dropout=0.1)
    data = batches(STEPS)
    torch.manual_seed(1234)
    expected, _, expected_state = plain_run(deepcopy(base), data)
    with torch.no_grad():
        no_dropout = deepcopy(base).eval()(data[0], labels=data[0]).loss.item()
    assert expected[0] != no_dropout  # the dropout is active
    model = offload(deepcopy(base))
    opt = strata_adamw(model.parameters())
    torch.manual_seed(1234)
    got, _ = train(model, opt, data)
    synchronize(opt)
    assert_losses_close(got, expected)
    assert_state_close(snapshot(model), expected_state)


FROZEN = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
          "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight",
          "model.layers.1.mlp.down_proj.weight", "model.layers.1.input_layernorm.weight")


def test_frozen_parameters(offload):
    """Idiom: p.requires_grad_(False) on some block parameters and a resident one (the
    embedding), the optimizer still given model.parameters(): frozen ones keep their values
    and no grad, the rest trains as in plain PyTorch."""
    base = build("llama")
    for name, p in base.named_parameters():
        if name in FROZEN:
            p.requires_grad_(False)
    initial = snapshot(base)
    data = batches(STEPS)
    expected, _, expected_state = plain_run(deepcopy(base), data)
    model = offload(deepcopy(base))
    assert sorted(n for n, p in model.named_parameters() if not p.requires_grad) == sorted(FROZEN)
    opt = strata_adamw(model.parameters())
    got, _ = train(model, opt, data)
    synchronize(opt)
    assert_losses_close(got, expected)
    got_state = snapshot(model)
    assert_state_close(got_state, expected_state)
    for name in FROZEN:
        assert torch.equal(got_state[name], initial[name]), name
    ids = data[0]
    model(ids, labels=ids).loss.backward()
    assert sorted(n for n, p in model.named_parameters() if p.grad is None) == sorted(FROZEN)


def test_peft_lora(offload):
    """Idiom: PEFT LoRA (r=4 on q_proj, v_proj) on an offloaded model: the base frozen and
    streamed, the adapters trained, the optimizer over the trainable parameters."""
    peft = pytest.importorskip("peft")
    base = build("llama")

    def lora(model):
        torch.manual_seed(7)  # the adapters' initialization
        return peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))

    def trainable(model):
        return [p for p in model.parameters() if p.requires_grad]

    data = batches(STEPS)
    plain = lora(deepcopy(base))
    initial = snapshot(plain)
    expected, _, expected_state = plain_run(plain, data, params=trainable)
    model = offload(lora(deepcopy(base)))
    got, _, got_state = strata_run(lambda m: m, model, data, params=trainable)
    assert_losses_close(got, expected)
    assert_state_close(got_state, expected_state)
    changed = sorted(k for k in initial if not torch.equal(got_state[k], initial[k]))
    assert changed and all("lora_" in k for k in changed), changed
