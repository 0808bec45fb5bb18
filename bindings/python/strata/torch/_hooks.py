"""What an offloaded model's modules do on torch's own calls: state_dict() and load_state_dict()
of the streamed blocks read and write Strata (StateHooks), loads in every order around the build
(before it, between steps, into residents that keep offload's fp32 values; assign=True refused),
.to()/.half() refused on streamed blocks, the model's forward pre-hook, and its out-of-memory
notes. Hooks are objects, not closures: pickling or copying the model then reaches the session,
which says why it cannot be."""

import torch

from . import _foreign, _params
from ._block import note_memory, note_spill
from ._surgery import swap_data


class StateHooks:
    """model.state_dict() returns the streamed values (read from Strata, on the CPU) under the
    model's own names; model.load_state_dict() writes them into Strata. (Methods of an object,
    not closures: pickling the model then reaches the session, which says why it cannot be.)"""

    def __init__(self, session, index):
        self.session, self.index, self.handled = session, index, []

    def entries(self):
        return self.session.layers[self.index] if self.session.layers else []

    def state(self, module, state_dict, prefix, local_metadata):
        self.session.check_open()
        for sp in self.entries():
            sp.check_untouched()
        for sp in self.entries():  # none before the blocks move into Strata: the params hold them
            key = prefix + sp.local
            if key in state_dict:
                state_dict[key] = self.session.read_weight(sp)

    def load_pre(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected,
                 error_msgs):
        self.session.check_open()
        refuse_assign(local_metadata)  # before anything is written into Strata
        for sp in self.entries():
            key = prefix + sp.local
            if key in state_dict:
                try:
                    self.session.write_weight(sp, state_dict.pop(key))
                except ValueError as e:
                    error_msgs.append(str(e))
                # Written, or its error reported: not "missing" either way.
                self.handled.append(key)

    def load_post(self, module, incompatible):
        for key in self.handled:
            if key in incompatible.missing_keys:
                incompatible.missing_keys.remove(key)
        self.handled.clear()


class LoadsBeforeBuild:
    """The load_state_dict pre-hook of every module inside a streamed block (the block too:
    a load of the model, of the block or of a module within it reaches the first of them).
    assign=True is refused. Before the blocks move into Strata their parameters hold the
    values and torch copies the loaded ones in; those of a model built on the meta device get
    storage first (torch's copy into a meta tensor does nothing, and the build would then
    initialize them), where the loaded value fits (a mismatch fails the load and leaves the
    tensor to the init), and every loaded parameter is marked so that the build takes it
    rather than offload(weights=)'s file."""

    def __init__(self, session):
        self.session = session

    def __call__(self, module, state_dict, prefix, local_metadata, *args):
        refuse_assign(local_metadata)
        if self.session.layers:
            return  # built: the blocks' own hooks write into Strata
        for local, p in module.named_parameters(recurse=False):
            value = state_dict.get(prefix + local)
            if torch.is_tensor(value) and value.shape == p.shape:
                if p.is_meta:  # uninitialized host memory, the loaded values copied in next
                    swap_data(p, torch.empty(p.shape, dtype=p.dtype))
                _params.mark_loaded(p)
        for name, b in list(module.named_buffers(recurse=False)):
            value = state_dict.get(prefix + name)
            if b.is_meta and name not in module._non_persistent_buffers_set and \
                    torch.is_tensor(value) and value.shape == b.shape:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype,
                                                    device=self.session.device)


class ResidentFp32Loads:
    """Pre- and post-hook of load_state_dict on every module holding a resident parameter
    with offload's fp32 values (the model, its head, the embedding's module...): a resident
    parameter cast to a narrower compute dtype keeps the fp32
    values its master will start from (strata.torch._params, until the optimizer exists); a load
    into it brings values the cast rounds, so they become the kept ones too (dropped, the
    master would start from the rounded parameter: 2e-4 off a plain fp32 model loaded with
    the same values)."""

    def __init__(self):
        self.pending = {}  # id(module) -> [(parameter, loaded value)] of its load under way

    def pre(self, module, state_dict, prefix, *args):
        self.pending[id(module)] = [
            (p, state_dict[prefix + name]) for name, p in module.named_parameters()
            if _params.fp32(p) is not None and torch.is_tensor(state_dict.get(prefix + name))
            and state_dict[prefix + name].shape == p.shape]

    @torch.no_grad()
    def post(self, module, incompatible):
        for p, value in self.pending.pop(id(module), []):
            kept = _params.fp32(p)
            if kept is not None and torch.equal(value.to(p.device, p.dtype), p.detach()):
                kept.copy_(value)  # what the load wrote, before its rounding
                _params.note_fp32_version(p)


def refuse_assign(local_metadata):
    """load_state_dict(..., assign=True) replaces the model's Parameter objects (the optimizer
    keeps the old ones); the streamed ones cannot be replaced, so half the model would go on
    training and half would not. Checked on every module holding streamed blocks (a load of
    the model or of a submodule) and on the blocks, before anything is loaded."""
    if local_metadata.get("assign_to_params_buffers"):
        raise RuntimeError("strata.torch: load_state_dict(..., assign=True) would replace the "
                           "parameters of an offloaded model, whose streamed ones live in "
                           "Strata; load without assign (the values are copied in); nothing "
                           "was loaded")


class _Hook:
    """One of StateHooks' methods as a hook object (torch marks hooks with attributes, which
    bound methods cannot take)."""

    def __init__(self, hooks, name):
        self.hooks, self.name = hooks, name

    def __call__(self, *args, **kwargs):
        return getattr(self.hooks, self.name)(*args, **kwargs)


def install_state_hooks(session, index, block):
    """Streamed block `index`'s state_dict and load_state_dict hooks; returns their handles."""
    hooks = StateHooks(session, index)
    register = getattr(block, "register_state_dict_post_hook", None) or \
        block._register_state_dict_hook
    return [register(_Hook(hooks, "state")),
            block._register_load_state_dict_pre_hook(_Hook(hooks, "load_pre"), with_module=True),
            block.register_load_state_dict_post_hook(_Hook(hooks, "load_post"))]


def install_load_hooks(model, session, blocks, around):
    """The load_state_dict hooks of the modules around the streamed blocks (`around`:
    _surgery.blocks_around's), of the modules holding resident parameters that keep offload's
    fp32 values, and of every module inside a streamed block."""
    # A load between a forward pass and its backward is refused by the streamed blocks'
    # hooks; checked here first, before the modules loaded ahead of them (the embedding) are
    # written.
    loads, fp32_loads = LoadsBetweenSteps(session), ResidentFp32Loads()
    for _, m in around:  # the model, the modules down to the blocks, the blocks
        m.register_load_state_dict_pre_hook(loads)
    kept_fp32 = {id(p) for p in session.kept_fp32}
    for m in model.modules() if kept_fp32 else ():  # where a load of a kept one can start
        if any(id(p) in kept_fp32 for p in m.parameters()):
            m.register_load_state_dict_pre_hook(fp32_loads.pre)
            m.register_load_state_dict_post_hook(fp32_loads.post)
    before_build = LoadsBeforeBuild(session)
    for block in blocks:
        for m in block.modules():
            m.register_load_state_dict_pre_hook(before_build)


class LoadsBetweenSteps:
    """The model's load_state_dict pre-hook (an object, not a closure: copying or pickling the
    model reaches the session's own refusal, which says why)."""

    def __init__(self, session):
        self.session = session

    def __call__(self, module, state_dict, prefix, local_metadata, *args):
        if self.session.in_step:
            raise RuntimeError("strata.torch: weights can be loaded between steps only (a "
                               "forward pass with grad waits for its backward); nothing was "
                               "loaded")
        refuse_assign(local_metadata)


class ModelForwardBegins:
    """The model's forward pre-hook, with grad in training mode: Hugging Face gradient
    checkpointing with use_reentrant=True around a streamed block fails in its backward pass
    with torch's own message (reentrant checkpointing is incompatible with .grad(), which a
    streamed block's backward uses): refused first, naming the fix. Then the session's
    on_forward_begin callbacks, with None (strata.torch.paging times the forward pass).
    `around`: _surgery.blocks_around's modules, the only ones looked at (the hook runs at every
    training forward pass; checkpointing elsewhere does not wrap a streamed block)."""

    def __init__(self, session, around):
        self.session = session
        self.around = around

    @torch.compiler.disable  # torch.compile: the callbacks run at every forward pass
    def __call__(self, module, *args):
        if not torch.is_grad_enabled() or not module.training:
            return
        for name, m in self.around:
            run = getattr(m, "_gradient_checkpointing_func", None)
            if getattr(m, "gradient_checkpointing", False) is True and \
                    getattr(run, "keywords", {}).get("use_reentrant") is True:
                raise NotImplementedError(
                    "strata.torch: gradient checkpointing with use_reentrant=True is on for "
                    "%s, around streamed blocks; streamed blocks recompute their forward in the "
                    "backward pass already and need none, and the reentrant variant cannot run "
                    "around them: call model.gradient_checkpointing_disable(), or enable it "
                    "with gradient_checkpointing_kwargs={'use_reentrant': False}"
                    % (name or "the model"))
        for call in self.session.on_forward_begin:
            call(None)


def guard_apply(session, module, streamed):
    """`module`'s _apply, guarded: changing dtype or device of streamed blocks (model.to(...),
    .half(), .cuda()) cannot work: their values live in Strata. Refused loudly before anything
    is converted, on every module holding streamed blocks (`streamed`: their parameters); a
    conversion that changes nothing (model.to(the same device), as accelerate's prepare() does)
    passes."""
    original = module._apply

    def _apply(fn, *args, **kwargs):
        _foreign.refuse_engine_moving(module)  # DeepSpeed's engine wrapping the model
        for p in streamed:
            t = fn(p.data)
            if t.dtype != p.dtype or t.device != p.device:
                raise RuntimeError(
                    "strata.torch: the model is offloaded; its streamed blocks' dtype and device "
                    "are fixed by strata.torch.offload(dtype=..., device=...) (model.to / .half "
                    "/ .cuda to another dtype or device after offload are not supported)")
        if module in session.blocks:
            return module  # unchanged: its parameters' data are Strata's placeholders
        return original(fn, *args, **kwargs)

    return _apply


def note_memory_errors(model, session):
    """Out-of-memory errors raised by the model's forward pass (logits, resident blocks) get
    the same note as the streamed blocks' (strata.torch._block.note_memory)."""
    run = model.forward

    def forward(*args, **kwargs):
        try:
            return run(*args, **kwargs)
        except BaseException as e:
            note_memory(session, e)
            note_spill(session, e)
            raise

    model.forward = forward
