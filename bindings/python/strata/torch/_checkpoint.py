"""Whole-state checkpoints of an offloaded model: st.save_checkpoint / st.load_checkpoint.

A checkpoint is a directory:
    streamed/model.safetensors      the streamed blocks' weights under the model's own names
    streamed/optimizer.safetensors  their fp32 masters, AdamW moments and update counts
    resident.pt                     resident parameters and buffers, their optimizer state,
                                    every param group's hyperparameters, torch's RNG states
The streamed part is Strata's checkpoint (CRC-32C per tensor, checked on load). The whole
directory is the runtime's atomic directory (strata.atomic_dir: written in its staging
directory, then swapped in), so a crash leaves either the previous checkpoint or the new one,
whole, and a load finds it. Schedulers keep their own state_dict(), as in plain PyTorch.

Under data parallelism (strata.torch._distributed) every rank calls both functions with the same
path, on a file system all ranks see: the ranks of the first replica write their shards,
streamed/shard<k>of<n>/ (each its own Strata checkpoint), every rank its RNG states,
rng/rank<r>.pt, and rank 0 the rest and the final swap; a checkpoint loads under the same
number of ranks and shards."""

import os

import torch

from .. import atomic_dir

FORMAT = "strata.torch/1"


def _resident(model, session):
    """(name, tensor) of the model's parameters and buffers that are not streamed, buffers
    named "buffer:<name>" (before the blocks move into Strata some may be on meta)."""
    streamed = {id(p) for b in session.blocks for p in b.parameters()}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in streamed:
            yield name, p
    for name, b in model.named_buffers():
        yield "buffer:" + name, b


def _resident_tensors(model, session):
    """The resident parameters and buffers, copied to the CPU, by name."""
    return {name: t.detach().cpu().clone() for name, t in _resident(model, session)}


def _session(model, build=True):
    session = getattr(model, "strata", None)
    if session is None:
        raise ValueError("strata.torch: the model is not offloaded (strata.torch.offload)")
    session.check_open()
    if build:
        session.ensure_built()
    if session.in_step:
        raise RuntimeError("strata.torch: checkpoints are taken between steps (a forward pass "
                           "is waiting for its backward)")
    return session


def _check_optimizer(optimizer, session):
    if optimizer is not None and getattr(optimizer, "_session", None) is not session:
        raise ValueError("strata.torch: the optimizer is not this model's strata.torch.AdamW")


def _rng_state():
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def save_checkpoint(path, model, optimizer=None):
    """Save everything a resumed run needs: streamed and resident weights, all optimizer state
    (masters, moments, per-parameter step counts, hyperparameters), and torch's RNG states.
    Atomic: `path` holds either the previous checkpoint or this one. Under data parallelism,
    every rank calls it with the same path."""
    if getattr(model, "strata", None) is not None and model.strata.executor is None and \
            model.strata.blocks_train():
        # The save would move the blocks into Strata without the optimizer's state, which the
        # optimizer could then never lay out (their values narrowed to the compute dtype).
        raise RuntimeError("strata.torch.save_checkpoint: the model's trainable blocks move "
                           "into Strata when their optimizer is created: create the optimizer "
                           "(strata.torch.AdamW) first, or save the weights with "
                           "model.state_dict(); nothing was saved")
    session = _session(model)
    _check_optimizer(optimizer, session)
    layout = session.layout  # under data parallelism, which rank writes what
    path = os.fspath(path).rstrip("/")
    staging = atomic_dir.staging(path)
    streamed, rng = layout.streamed_dir(staging), layout.rng_file(staging)
    if layout.lead:
        atomic_dir.begin(path)
        # The staging folder is begin's; under data parallelism its streamed/ holds every
        # shard's folder (the runtime's save makes the folder it writes).
        os.makedirs(os.path.dirname(streamed), exist_ok=True)
        if rng is not None:
            os.makedirs(os.path.dirname(rng))
    layout.barrier("starting checkpoint %s" % path)
    if layout.writes_streamed:  # replicas hold the same shards
        session.runtime.save_checkpoint(streamed,
                                        session.optimizer if optimizer is not None else None)
    if rng is not None:
        torch.save(_rng_state(), rng)
    if layout.lead:
        torch.save({"format": FORMAT, "model": _resident_tensors(model, session),
                    "optimizer": optimizer.resident_state() if optimizer is not None else None,
                    "rng": _rng_state(), "data_parallel": layout.checkpoint_layout()},
                   os.path.join(staging, "resident.pt"))
    layout.barrier("writing checkpoint %s" % path)
    if layout.lead:
        atomic_dir.commit(path)
    layout.barrier("committing checkpoint %s" % path)


@torch.no_grad()
def load_checkpoint(path, model, optimizer=None):
    """Restore a checkpoint written by save_checkpoint into an offloaded model (and optimizer):
    the next steps are bit for bit those the saved run would have taken."""
    # Built (the blocks moved into Strata) only once the checkpoint passed every check: a
    # refused load changes nothing (built, a bf16 offload of an fp32 model would have its
    # blocks rounded with no master to keep them, and its optimizer refused).
    session = _session(model, build=False)
    _check_optimizer(optimizer, session)
    try:  # the checkpoint, or the previous one where a save was interrupted mid-commit
        path = atomic_dir.resolve(path)
    except LookupError as e:
        raise FileNotFoundError("strata.torch.load_checkpoint: no checkpoint at %s (%s)"
                                % (os.fspath(path), e)) from None
    data = torch.load(os.path.join(path, "resident.pt"), map_location="cpu", weights_only=True)
    if data.get("format") != FORMAT:
        raise ValueError("strata.torch.load_checkpoint: %s is not a %s checkpoint"
                         % (path, FORMAT))
    if optimizer is not None and data["optimizer"] is None:
        raise ValueError("strata.torch.load_checkpoint: %s holds no optimizer state" % path)
    saved_layout, layout = data.get("data_parallel"), session.layout.checkpoint_layout()
    if saved_layout != layout:
        raise ValueError("strata.torch.load_checkpoint: %s was saved %s; this model trains %s "
                         "(load it under the same layout)" % (
                             path, _describe(saved_layout), _describe(layout)))
    saved = data["model"]

    def targets():  # by the checkpoint's names (a build gives meta buffers new tensors)
        params = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers())
        return {name: buffers.get(name[len("buffer:"):]) if name.startswith("buffer:")
                else params.get(name) for name in saved}
    expected = {name for name, _ in _resident(model, session)}
    if set(saved) != expected:
        raise ValueError("strata.torch.load_checkpoint: the checkpoint's resident tensors differ "
                         "from the model's (missing: %s; unexpected: %s)"
                         % (sorted(expected - set(saved)), sorted(set(saved) - expected)))
    wrong = ["%s %s (the model's %s)" % (name, tuple(value.shape), tuple(target.shape))
             for (name, value), target in zip(saved.items(), targets().values())
             if value.shape != target.shape]
    if wrong:
        raise ValueError("strata.torch.load_checkpoint: the checkpoint's resident tensors have "
                         "other shapes than the model's: %s; nothing was loaded"
                         % "; ".join(wrong))
    session.ensure_built()
    targets = targets()
    # The runtime's load (as its save) first waits for the updates still running, whether or
    # not the optimizer's state is part of it (strata_checkpoint_load).
    session.runtime.load_checkpoint(session.layout.streamed_dir(path),
                                    session.optimizer if optimizer is not None else None)
    if optimizer is None:  # the weights only
        session.weights_loaded()
    for name, value in saved.items():
        targets[name].copy_(value)
    if optimizer is not None:
        optimizer.load_resident_state(data["optimizer"])
    rng = data["rng"]
    own = session.layout.rng_file(path)  # under data parallelism, each rank's own
    if own is not None:
        rng = torch.load(own, map_location="cpu", weights_only=True)
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def _describe(layout):
    if layout is None:
        return "by one process (no data parallelism)"
    text = "by %d data-parallel ranks in shards of %d" % (layout["ranks"], layout["shard_size"])
    if layout.get("state_across_hosts"):
        text += ", the optimizer state across %d hosts" % layout["state_across_hosts"]
    return text
