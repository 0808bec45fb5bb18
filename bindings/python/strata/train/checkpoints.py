"""strata-train's checkpoints: <output>/checkpoints/step-NNNNNNNN/ holds strata.torch's whole
training state (state/, st.save_checkpoint: weights, optimizer state, torch's RNG states) and
the run's own (trainer.pt: the step, the data's position, the schedule's state and the options
that decide which rows come next). <output>/checkpoints/latest names the newest, rewritten
(atomically) only once both are written, so `--resume latest` never finds half a checkpoint."""

import os

import torch

from .config import UsageError, flag

# Options a resumed run must share with the saved one to read the same rows in the same order.
SAME_ON_RESUME = ("data", "data_split", "format", "train_on_prompt", "seq_len", "packing",
                  "eval_split", "eval_data", "micro_batch", "accumulation", "seed")


def _write_atomically(path, write):
    partial = path + ".partial"
    write(partial)
    os.replace(partial, path)


def save(output, step, model, opt, trainer_state, write=True):
    """Every rank calls it (st.save_checkpoint is collective); `write`: this rank writes the
    run's own state and the `latest` pointer."""
    import strata.torch as st
    root = os.path.join(output, "checkpoints")
    name = "step-%08d" % step
    path = os.path.join(root, name)
    st.save_checkpoint(os.path.join(path, "state"), model, opt)
    if write:
        _write_atomically(os.path.join(path, "trainer.pt"),
                          lambda p: torch.save(trainer_state, p))
        _write_atomically(os.path.join(root, "latest"),
                          lambda p: open(p, "w").write(name + "\n"))
    return path


def find(resume, output):
    """The checkpoint directory --resume names (`latest`: the newest under --output)."""
    if resume == "latest":
        pointer = os.path.join(output, "checkpoints", "latest")
        if not os.path.exists(pointer):
            raise UsageError("--resume latest: no checkpoint under %s (no %s)"
                             % (output, pointer))
        with open(pointer) as f:
            resume = os.path.join(output, "checkpoints", f.read().strip())
    if not os.path.exists(os.path.join(resume, "trainer.pt")):
        raise UsageError("--resume %s: not a strata-train checkpoint (no trainer.pt)" % resume)
    return resume


def load(path, model, opt, options, world):
    """Restore a checkpoint into `model` and `opt`; returns the run's own state."""
    import strata.torch as st
    state = torch.load(os.path.join(path, "trainer.pt"), weights_only=False)
    saved = state["options"]
    for key in SAME_ON_RESUME:
        if saved.get(key) != getattr(options, key):
            raise UsageError("--resume %s: the checkpoint was trained with %s %s, this run has "
                             "%s (the data's order would differ; run with the same value)"
                             % (path, flag(key), saved.get(key), getattr(options, key)))
    if state["world"] != world:
        raise UsageError("--resume %s: the checkpoint was trained by %d processes, this run has "
                         "%d" % (path, state["world"], world))
    st.load_checkpoint(os.path.join(path, "state"), model, opt)
    return state
