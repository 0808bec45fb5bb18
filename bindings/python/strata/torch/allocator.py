"""torch's CUDA caching allocator, as strata.torch sets it up: expandable segments unless the
process configured the allocator itself.

Why: a streamed step's device memory is a few large, long-lived tensors (resident blocks'
weights and optimizer state, the embedding and head) beside large transient ones whose sizes
change within a step (a 128k-vocabulary loss at 32k tokens makes several 16.8 GB tensors at
the start of the backward pass). With the default allocator's fixed segments those transients
strand memory: an 8B Llama at 32x1024 on an H200 reserved 146.4 GB for 128.7 GB allocated
(docs/benchmarks.md, twelfth session), 17.7 GB that kept activations could have used, and
the margin the activation keeper leaves must cover the stranding a new allocation pattern
brings. With expandable segments (one segment per stream that grows and shrinks by mapping
pages) the same step reserved 133.3 GB for 131.6 allocated. The values computed are the
same either way: only where tensors sit in device memory differs.

A process that set PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF, or changed the allocator's
settings or backend itself, is left as it is (`expandable_segments:False` there keeps the
default allocator). torch's public switch is the environment variable, read once when CUDA
starts; the setting is changed here through torch._C._accelerator_setAllocatorSettings, the
function torch's own tests use for that (torch.cuda.memory._set_allocator_settings before
it), and it applies to segments allocated from then on."""

import os

import torch

_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")

# Set when strata.torch turned expandable segments on in this process.
_turned_on = False


def _get_settings():
    """The allocator settings string torch holds now ('' when it cannot say)."""
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    try:
        return get() if get is not None else ""
    except RuntimeError:
        return ""


def _set_settings(text):
    """Applies allocator settings; False when this torch has no way to."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = getattr(torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None)
    if setter is None:
        return False
    setter(text)
    return True


def user_configured():
    """The allocator settings the process chose itself (an environment variable, or settings
    applied before strata.torch touched them), or None."""
    for name in _ENV:
        if os.environ.get(name):
            return os.environ[name]
    settings = _get_settings()
    return settings if settings and not _turned_on else None


def _settings_say_expandable(text):
    for item in text.replace(";", ",").split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() == "true"
    return False


def expandable_segments():
    """Whether the caching allocator now grows expandable segments (strata.torch turned them
    on, or the process's settings ask for them)."""
    if _turned_on:
        return True
    configured = user_configured()
    return configured is not None and _settings_say_expandable(configured)


def prefer_expandable_segments(device):
    """On CUDA, turns expandable segments on unless the process configured the allocator or
    runs another backend; returns a function that undoes it (for a failed offload), or None
    when nothing changed."""
    global _turned_on
    if device.type != "cuda" or _turned_on or user_configured() is not None:
        return None
    try:
        if torch.cuda.get_allocator_backend() != "native":
            return None
    except (AttributeError, RuntimeError):
        return None
    if not _set_settings("expandable_segments:True"):
        return None
    _turned_on = True

    def undo():
        global _turned_on
        _set_settings("expandable_segments:False")
        _turned_on = False

    return undo
