"""A second distribution layer over an offloaded model, refused: torch's DistributedDataParallel,
FSDP2's fully_shard (and torch's composable replicate), FSDP1's FullyShardedDataParallel and
DeepSpeed's engine each take over the parameters' memory (broadcast into them, flatten or shard
them) and their gradient reduction, which Strata already owns: the streamed parameters are
placeholders over Strata's memory, their grads live in Strata, and offload() is data parallel by
itself under torchrun. Unrefused, they failed far from the cause (a broadcast into a
placeholder, "parameters added after offload" at the optimizer, a layer that "declares no
weights"), or ran with one rank in a way neither was made for (a DDP built before the
optimizer).

Refused as early as each can be seen without patching torch or DeepSpeed, with a message that
names the wrapper, says why and names offload's own data parallelism:
- DistributedDataParallel(model): when it is built, through the attribute DDP reads first from
  the module it wraps (_ddp_params_and_buffers_to_ignore), before it touches anything.
- fully_shard / replicate on the model or any of its modules: when applied, through the
  per-module state of torch's composable-API contract, before the API records or changes
  anything (an empty registry the contract created the instant before is removed).
- DeepSpeed's engine: when its constructor moves the model to its device (model.to, which
  reaches strata.torch._hooks.guard_apply), before it broadcasts into the parameters or
  partitions them; DeepSpeed reads nothing from the model before that could say so.
- Otherwise at the model's training forward (its forward pre-hook): a DDP around a module that
  holds the model (DDP's own record of the DDP whose forward runs), a module that fully_shard
  changed (the contract's state unguarded in another torch), FSDP1 or a DeepSpeed engine that
  did not move the model calling it (found in the calling frames). FSDP1 flattens the
  parameters when it is built: the message then says to offload the model again."""

import importlib
import sys
import weakref

import torch

DOCS = 'docs/python-guide.md, "Several GPUs (torchrun)"'

DDP = "torch.nn.parallel.DistributedDataParallel"
# Who builds that DDP most often: transformers.Trainer under torchrun (accelerate's prepare).
TRAINER = (" The Hugging Face Trainer builds it under torchrun (accelerate's prepare): use "
           "strata.torch.StrataTrainer in place of transformers.Trainer, the same arguments, "
           "which trains through offload's own data parallelism (docs/python-guide.md, \"The "
           "Hugging Face Trainer\").")
FSDP1 = "torch.distributed.fsdp.FullyShardedDataParallel (FSDP1)"
DEEPSPEED = "DeepSpeed (deepspeed.initialize's engine)"
# torch's composable APIs (torch.distributed._composable.contract) that distribute a module,
# by the name the contract registers them under.
COMPOSABLE = {"fully_shard": "torch.distributed.fsdp.fully_shard (FSDP2)",
              "replicate": "torch.distributed's composable replicate"}


def message(wrapper, outcome):
    """The refusal: which wrapper, why it cannot work, what to write instead, and `outcome`
    (what the refusal left)."""
    return ("strata.torch: %s cannot wrap an offloaded model: Strata already owns the memory of "
            "its parameters (the streamed blocks' weights, grads and optimizer state live in "
            "Strata and stream through the device block by block) and their data-parallel "
            "reduction (under torchrun, strata.torch.offload is data parallel by itself: each "
            "block's grads are averaged over the ranks as its backward pass ends). Use no second "
            "distribution layer: strata.torch.offload(model, ...) under torchrun, and "
            "offload(..., data_parallel=strata.torch.DataParallel(group=..., shard_size=...)) "
            "to choose the process group and the sharding (%s).%s %s" % (
                wrapper, DOCS, TRAINER if wrapper == DDP else "", outcome))


UNCHANGED = "Nothing was changed: the model trains as it is, without the wrapper."


class _RefuseDDP:
    """Set as the model's _ddp_params_and_buffers_to_ignore, the names DDP's constructor reads
    (set(...)) before it looks at a parameter or calls a collective: iterating it refuses. (A
    user's DistributedDataParallel._set_params_and_buffers_to_ignore_for_model replaces it; the
    forward pre-hook then still refuses.)"""

    def __iter__(self):
        raise RuntimeError(message(DDP, UNCHANGED))

    def __repr__(self):
        return "<strata.torch: DistributedDataParallel refused over an offloaded model>"


class _ComposableStates(dict):
    """A module's per-API state of torch's composable-API contract, placed before any API is
    applied: the contract asks it whether the API is applied already (`func in states`) and
    then sets it (`setdefault`) before the API runs; either refuses a distributing API, after
    removing the empty registry the contract created beside it an instant before. Other APIs
    (composable checkpoint) are kept as in a plain dict."""

    def __init__(self, module, registry_key):
        super().__init__()
        self._module = weakref.ref(module)
        self._registry_key = registry_key

    def _check(self, func):
        name = getattr(func, "__name__", None)
        if name in COMPOSABLE and getattr(func, "__module__", "").startswith("torch.distributed"):
            module = self._module()
            if module is not None and module.__dict__.get(self._registry_key) == {}:
                del module.__dict__[self._registry_key]
            raise RuntimeError(message(COMPOSABLE[name], UNCHANGED))

    def __contains__(self, func):
        self._check(func)
        return super().__contains__(func)

    def setdefault(self, func, default=None):
        self._check(func)
        return super().setdefault(func, default)

    def __reduce__(self):
        # Copied or pickled as the plain dict it holds (the module's weak reference cannot be
        # pickled): copying the model then reaches the session, which says why it cannot be.
        return dict, (dict(self),)


def _composable_keys():
    """(state key, registry key) of torch's composable-API contract, or None where this torch
    has none (then fully_shard is refused at the first forward pass)."""
    try:  # the module (the package exports the decorator under the same name)
        contract = importlib.import_module("torch.distributed._composable.contract")
    except ImportError:
        return None
    state, registry = getattr(contract, "STATE_KEY", None), getattr(contract, "REGISTRY_KEY", None)
    return (state, registry) if isinstance(state, str) and isinstance(registry, str) else None


class WrappersAtForward:
    """The model's forward pre-hook, with grad in training mode: a wrapper that could not be
    refused when it was built is refused before anything runs (see the module's docstring).
    `around`: the modules from the model down to the streamed blocks, and the blocks."""

    def __init__(self, around):
        self.modules = [m for _, m in around]

    @torch.compiler.disable
    def __call__(self, module, *args):
        if not torch.is_grad_enabled() or not module.training:
            return
        parallel = sys.modules.get("torch.nn.parallel.distributed")
        ddp = getattr(getattr(parallel, "DistributedDataParallel", None), "_active_ddp_module",
                      None)
        if ddp is not None and any(m is module for m in ddp.module.modules()):
            raise RuntimeError(message(DDP, "Nothing was run; the model trains as it is, "
                                       "without the wrapper."))
        fsdp2 = sys.modules.get("torch.distributed.fsdp._fully_shard._fully_shard")
        fsdp_module = getattr(fsdp2, "FSDPModule", None)
        if fsdp_module is not None and any(isinstance(m, fsdp_module) for m in self.modules):
            raise RuntimeError(message(COMPOSABLE["fully_shard"], "fully_shard has replaced "
                                       "the model's parameters: build and offload it again."))
        caller = _calling_wrapper(module)
        if caller is not None:
            raise RuntimeError(message(caller, "It changed the model's parameters when it was "
                                       "built: build and offload the model again."))


def _calling_wrapper(model):
    """FSDP1 or DeepSpeed's engine when one of them, a few frames up, is running a call on a
    module that holds the model (found by class: neither is imported here), else None."""
    frame = sys._getframe(1)
    for _ in range(16):  # the hook, torch's _call_impl and the wrapper's method are close by
        frame = frame.f_back
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if not isinstance(owner, torch.nn.Module) or owner is model:
            continue
        for cls in type(owner).__mro__:
            where = cls.__module__ or ""
            if cls.__name__ == "FullyShardedDataParallel" and \
                    where.startswith("torch.distributed.fsdp"):
                wrapper, wrapped = FSDP1, owner.__dict__.get("_modules", {}).get(
                    "_fsdp_wrapped_module")
            elif cls.__name__ == "DeepSpeedEngine" and where.startswith("deepspeed"):
                # The engine keeps the model in both (DeepSpeedEngine._set_client_model).
                wrapper, wrapped = DEEPSPEED, owner.__dict__.get("module") or \
                    owner.__dict__.get("_modules", {}).get("module")
            else:
                continue
            if isinstance(wrapped, torch.nn.Module) and \
                    any(m is model for m in wrapped.modules()):
                return wrapper
    return None


def refuse_engine_moving(model):
    """Called by the guard of the model's _apply (strata.torch._hooks.guard_apply) before it
    converts anything: DeepSpeed's engine moves the model it wraps to its device when it is
    built, before it broadcasts into the parameters or partitions them; refused there."""
    if _calling_wrapper(model) == DEEPSPEED:
        raise RuntimeError(message(DEEPSPEED, "Nothing was changed (unless a bf16 or fp16 "
                                   "setting of DeepSpeed cast the parameters first, which it "
                                   "does before it moves the model: then offload the model "
                                   "again); the model trains as it is, without the wrapper."))


def install(model, around):
    """The refusals, on an offloaded model (offload's last stage: nothing fails after)."""
    model._ddp_params_and_buffers_to_ignore = _RefuseDDP()
    keys = _composable_keys()
    if keys is not None:
        for m in model.modules():
            if keys[0] not in m.__dict__:  # an API applied before offload keeps its state
                m.__dict__[keys[0]] = _ComposableStates(m, keys[1])
    model.register_forward_pre_hook(WrappersAtForward(around))
