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

A process that set PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF (non-empty), or runs another
allocator backend, is left as it is (`expandable_segments:False` there keeps the default
allocator); so is one that changed the settings itself through torch before offload, where
torch can say so (torch._C._accelerator_getAllocatorSettings: torch 2.11 cannot, so there an
earlier in-process change is overridden). Under data parallelism nothing is changed: torch
turns NCCL's buffer registration off with expandable segments, and the data-parallel steps
were measured on the default allocator. Expandable segments have caveats of their own: CUDA
tensors in them cannot be shared with another process (torch.multiprocessing, DataLoader
workers returning CUDA tensors) on torch versions without their IPC support. torch's public
switch is the environment variable, read once when CUDA starts; the setting is changed here
through torch._C._accelerator_setAllocatorSettings, the function torch's own tests use for that
(torch.cuda.memory._set_allocator_settings before it), and it applies to segments allocated
from then on."""

import os

import torch

_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")

# Set while strata.torch has expandable segments turned on in this process.
_turned_on = False
# The settings strings strata.torch applied (torch's getter returns the last one set: those
# are not the process's own choice).
_applied = set()


def _get_settings():
    """The allocator settings string torch holds now; None when this torch cannot say."""
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if get is None:
        return None
    try:
        return get()
    except RuntimeError:
        return None


def _set_settings(text):
    """Applies allocator settings; False when this torch has no way to."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = getattr(torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None)
    if setter is None:
        return False
    setter(text)
    _applied.add(text)
    return True


def user_configured():
    """The allocator settings the process chose itself (a non-empty environment variable, or
    settings applied through torch before strata.torch touched them, where torch can say),
    or None."""
    for name in _ENV:
        if os.environ.get(name):
            return os.environ[name]
    settings = _get_settings()
    return settings if settings and settings not in _applied else None


def _native_backend():
    try:
        return torch.cuda.get_allocator_backend() == "native"
    except (AttributeError, RuntimeError):
        return False


def _settings_say_expandable(text):
    """Whether allocator settings as torch parses them (comma-separated key:value, the value
    exactly True or False) turn expandable segments on."""
    for item in text.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip() == "True"
    return False


def expandable_segments():
    """Whether the caching allocator now grows expandable segments: what torch's settings say
    where it can say, else what strata.torch or the environment set."""
    if not _native_backend():
        return False
    settings = _get_settings()
    if settings:
        return _settings_say_expandable(settings)
    configured = user_configured()
    if configured is not None:
        return _settings_say_expandable(configured)
    return _turned_on


def prefer_expandable_segments(device):
    """On CUDA, turns expandable segments on unless the process configured the allocator or
    runs another backend; returns a function that undoes it (for a failed offload), or None
    when nothing changed."""
    global _turned_on
    if device.type != "cuda" or _turned_on or user_configured() is not None \
            or not _native_backend():
        return None
    if not _set_settings("expandable_segments:True"):
        return None
    _turned_on = True

    def undo():
        global _turned_on
        _set_settings("expandable_segments:False")
        _turned_on = False

    return undo
