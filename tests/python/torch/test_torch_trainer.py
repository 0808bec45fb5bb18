"""The Hugging Face Trainer over an offloaded model (issue 37, item 4), as docs/python-guide.md
writes it: `Trainer(model=st.offload(model), optimizers=(st.AdamW(model.parameters(), ...),
None))`, against the same Trainer on plain PyTorch (torch.optim.AdamW), on the CPU: every
micro-batch's loss and the final weights within torch_parity_models' tolerances, with what a
Trainer user turns on (gradient accumulation, max_grad_norm clipping, a warm-up cosine schedule
the Trainer builds over the given optimizer, shuffled data, and with and without gradient
checkpointing)."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

import strata.torch as st  # noqa: E402
from torch_parity_models import (DEVICE, LR, VOCAB, WD, assert_losses_close,  # noqa: E402
                                 assert_state_close, build, plain_adamw, snapshot, synchronize)

if DEVICE.type != "cpu":
    pytest.skip("the Trainer parity runs on the CPU (STRATA_PARITY_DEVICE is %s)" % DEVICE,
                allow_module_level=True)

STEPS, BATCH, ACCUMULATE, SEQ = 4, 2, 2, 16


class Tokens(torch.utils.data.Dataset):
    """Fixed token sequences from a private generator (labels = the inputs, as causal LM)."""

    def __init__(self, n=STEPS * BATCH * ACCUMULATE, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class RecordingTrainer(transformers.Trainer):
    """The Trainer unchanged, but for keeping each micro-batch's loss at full precision (the
    logged one is an average rounded to 4 digits)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses = []

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.losses.append(loss.item())
        return loss


def run(model, opt, tmp_path, **options):
    args = transformers.TrainingArguments(
        str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE, max_grad_norm=1.0, lr_scheduler_type="cosine",
        warmup_steps=1, learning_rate=LR, weight_decay=WD, seed=0, use_cpu=True,
        report_to=[], save_strategy="no", logging_steps=1, dataloader_num_workers=0,
        disable_tqdm=True, **options)
    trainer = RecordingTrainer(model=model, args=args, train_dataset=Tokens(),
                               optimizers=(opt, None))
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
