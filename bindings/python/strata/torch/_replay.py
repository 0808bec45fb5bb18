"""What a block's forward pass ran with, for its recompute in the backward pass: its buffers and
train/eval flags put back (ForwardState), and the KV caches a training forward must not get.
Shared by the streamed blocks (strata.torch._block), the resident ones (checkpointed through
torch) and the activation keeper's measurement."""

import contextlib

import torch


def _cache_types():
    try:
        from transformers.cache_utils import Cache
        return (Cache,)
    except Exception:  # transformers absent or without Cache
        return ()


_CACHES = _cache_types()


def without_caches(leaves):
    """A KV cache in a training forward: the recomputed forward would append to it again, so
    neither run gets it. That is exact when it holds nothing yet (training starts from no
    past); a cache already holding keys is refused."""
    out = []
    for x in leaves:
        if _CACHES and isinstance(x, _CACHES):
            if x.get_seq_length() != 0:
                raise RuntimeError(
                    "strata.torch: a forward pass with grad enabled was given a KV cache that "
                    "already holds keys; training through a cache is not supported (pass "
                    "use_cache=False, or run generation under torch.no_grad())")
            x = None
        out.append(x)
    return out


class ForwardState:
    """What a block's forward pass ran with that its recompute must run with again: its
    buffers before the forward (put back before the recompute, so it computes what the forward
    computed and leaves them as the forward did: the ones it changes in place, BatchNorm's
    running statistics or a call counter, change once a step, as in plain PyTorch, where
    torch's own checkpointing changes them twice), and its modules' train/eval flags (a
    model.eval() between the forward and the backward pass, a callback's evaluation, must not
    turn the recompute's dropout off). Every buffer is kept and put back, not only those whose
    version changed: some kernels write buffers without bumping their version (BatchNorm's
    statistics on the CPU), and comparing values would wait for the device in every forward. A
    decoder block usually has none; their copies are held from the forward to the recompute."""

    def __init__(self, module):
        self.before = [(b, b.clone()) for b in module.buffers()]
        self.modes = [(m, m.training) for m in module.modules()]

    def restore_buffers(self):
        """The buffers as they were before the forward."""
        with torch.no_grad():
            for b, value in self.before:
                b.copy_(value)

    @contextlib.contextmanager
    def replay(self):
        """For the recompute: the buffers as before the forward, the train/eval flags as in it
        (the flags the modules have now come back after)."""
        self.restore_buffers()
        now = [(m, m.training) for m, _ in self.modes]
        for m, training in self.modes:
            m.training = training
        try:
            yield
        finally:
            for m, training in now:
                m.training = training


def replaying_forward_state(module, run):
    """`run` for torch's checkpoint: its first call notes `module`'s ForwardState, its second
    (the recompute) runs under its replay."""
    state = []

    def call(*args, **kwargs):
        if state:
            with state[0].replay():
                return run(*args, **kwargs)
        state.append(ForwardState(module))
        return run(*args, **kwargs)

    return call


@contextlib.contextmanager
def without_forward_hooks(module):
    """No forward hook or forward pre-hook runs inside: those of `module` and every module in
    it, and the global ones (torch.nn.modules.module.register_module_forward_hook). Each hook
    dictionary is swapped for an empty one and the same object put back after, so a hook
    handle's remove() still finds its own (the handles hold the dictionaries)."""
    import torch.nn.modules.module as nn_module

    dicts = ("_forward_hooks", "_forward_pre_hooks")
    globals_ = ("_global_forward_hooks", "_global_forward_pre_hooks")
    saved = [(m, name, m.__dict__[name]) for m in module.modules() for name in dicts
             if m.__dict__.get(name)]
    saved_globals = [(name, getattr(nn_module, name)) for name in globals_
                     if getattr(nn_module, name, None)]
    try:
        for m, name, hooks in saved:
            m.__dict__[name] = type(hooks)()
        for name, hooks in saved_globals:
            setattr(nn_module, name, type(hooks)())
        yield
    finally:
        for m, name, hooks in saved:
            m.__dict__[name] = hooks
        for name, hooks in saved_globals:
            setattr(nn_module, name, hooks)
