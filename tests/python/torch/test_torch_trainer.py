"""The Hugging Face Trainer over an offloaded model (issue 37, item 4), as docs/python-guide.md
writes it: `Trainer(model=st.offload(model), optimizers=(st.AdamW(model.parameters(), ...),
None))`, against the same Trainer on plain PyTorch (torch.optim.AdamW), on the CPU: every
micro-batch's loss and the final weights within torch_parity_models' tolerances, with what a
Trainer user turns on (gradient accumulation, max_grad_norm clipping, a warm-up cosine schedule
the Trainer builds over the given optimizer, shuffled data, and with and without gradient
checkpointing). strata.torch.StrataTrainer (the Trainer data parallel under torchrun) trains the
same in one process and refuses a model that was not offloaded."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

import strata.torch as st  # noqa: E402
from torch_parity_models import (DEVICE, LR, WD, Tokens, assert_losses_close,  # noqa: E402
                                 assert_state_close, build, plain_adamw, recording, snapshot,
                                 synchronize)

if DEVICE.type != "cpu":
    pytest.skip("the Trainer parity runs on the CPU (STRATA_PARITY_DEVICE is %s)" % DEVICE,
                allow_module_level=True)

STEPS, BATCH, ACCUMULATE, SEQ = 4, 2, 2, 16


def arguments(tmp_path, **options):
    return transformers.TrainingArguments(
        str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE, max_grad_norm=1.0, lr_scheduler_type="cosine",
        warmup_steps=1, learning_rate=LR, weight_decay=WD, seed=0, use_cpu=True,
        report_to=[], save_strategy="no", logging_steps=1, dataloader_num_workers=0,
        disable_tqdm=True, **options)


def run(model, opt, tmp_path, trainer_class=transformers.Trainer, **options):
    trainer = recording(trainer_class)(
        model=model, args=arguments(tmp_path, **options),
        train_dataset=Tokens(STEPS * BATCH * ACCUMULATE, SEQ), optimizers=(opt, None))
    trainer.train()
    synchronize(opt)
    return trainer


# Gradient checkpointing: what a Trainer user with a model too large for the GPU turns on next
# (the Trainer calls model.gradient_checkpointing_enable(); the blocks' forward runs again in
# the backward pass, the weights streamed in again).
@pytest.mark.parametrize("gradient_checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_trainer_trains_an_offloaded_model_as_it_trains_the_plain_one(
        tmp_path, offload, one_torch_thread, gradient_checkpointing):
    # transformers 5 renamed the argument (the old name still works, with a FutureWarning).
    fields = transformers.TrainingArguments.__dataclass_fields__
    name = ("activation_checkpointing" if "activation_checkpointing" in fields
            else "gradient_checkpointing")
    options = {name: gradient_checkpointing}
    plain = build("llama")
    expected = run(plain, plain_adamw(plain.parameters()), tmp_path / "plain", **options)
    # The option took effect (the property renamed alongside the argument).
    assert getattr(plain, "is_" + name) == gradient_checkpointing

    model = offload(build("llama"))
    opt = st.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    got = run(model, opt, tmp_path / "strata", **options)

    assert len(expected.losses) == STEPS * ACCUMULATE
    # Each loss after the first follows the previous steps' clipped, scheduled updates.
    assert_losses_close(got.losses, expected.losses)
    assert_state_close(snapshot(model), snapshot(plain))


def test_strata_trainer_in_one_process_trains_as_the_trainer_does(tmp_path, offload,
                                                                   one_torch_thread):
    # strata.torch.StrataTrainer (the Trainer without DDP under torchrun; the data-parallel
    # runs are test_torch_trainer_distributed.py) in one process: the plain Trainer's losses
    # and weights over the plain model.
    plain = build("llama")
    expected = run(plain, plain_adamw(plain.parameters()), tmp_path / "plain")
    model = offload(build("llama"))
    opt = st.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    got = run(model, opt, tmp_path / "strata", trainer_class=st.StrataTrainer)
    assert_losses_close(got.losses, expected.losses)
    assert_state_close(snapshot(model), snapshot(plain))


def test_strata_trainer_with_the_trainers_parameter_groups_trains_as_its_default(
        tmp_path, offload, one_torch_thread):
    # optimizer_cls_and_kwargs=(st.AdamW, ...): the Trainer builds strata.torch's AdamW over
    # its own parameter groups (no weight decay on biases and norms), as it builds
    # torch.optim.AdamW by default for the plain model.
    plain = build("llama")
    expected = run(plain, None, tmp_path / "plain")
    model = offload(build("llama"))
    trainer = recording(st.StrataTrainer)(
        model=model, args=arguments(tmp_path / "strata"),
        train_dataset=Tokens(STEPS * BATCH * ACCUMULATE, SEQ),
        optimizer_cls_and_kwargs=(st.AdamW, {"lr": LR}))
    trainer.train()
    synchronize(trainer.optimizer)
    assert sorted({g["weight_decay"] for g in trainer.optimizer.param_groups}) == [0.0, WD]
    assert_losses_close(trainer.losses, expected.losses)
    assert_state_close(snapshot(model), snapshot(plain))


def test_strata_trainer_refuses_torch_optimizers_naming_its_own(tmp_path, offload):
    # The Trainer's default optimizer (torch.optim.AdamW) cannot update streamed parameters:
    # refused when the Trainer builds it, before any forward pass.
    model = offload(build("llama"))
    trainer = st.StrataTrainer(model=model, args=arguments(tmp_path),
                               train_dataset=Tokens(STEPS * BATCH * ACCUMULATE, SEQ))
    with pytest.raises(TypeError, match=r"the optimizer is torch.optim.adamw.AdamW, which cannot "
                                        r"update the streamed parameters; give the Trainer "
                                        r"strata.torch's: optimizers=\(strata.torch.AdamW"):
        trainer.train()


def test_strata_trainer_refuses_a_model_that_was_not_offloaded(tmp_path):
    plain = build("llama")
    with pytest.raises(TypeError, match=r"strata.torch.StrataTrainer trains a model offloaded "
                                        r"by strata.torch.offload \(got LlamaForCausalLM\); for "
                                        r"any other model use transformers.Trainer"):
        st.StrataTrainer(model=plain, args=arguments(tmp_path),
                         optimizers=(plain_adamw(plain.parameters()), None))
