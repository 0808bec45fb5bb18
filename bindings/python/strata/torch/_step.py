"""What strata.torch measures for the step-memory plan (strata.step_plan, libstrata's
runtime/step/): torch's view of the device, in the profile's terms. The decisions are the
library's; this module only reads torch's allocator."""

import torch

from .. import step_plan
from . import _allocator


def device_figures(device):
    """The profile's device fields as torch's caching allocator sees the CUDA `device` now:
    its memory, what it has free, what torch holds (free + held: what torch could hold), and
    whether the allocator gives its cache back where an allocation needs it (expandable
    segments). Callers ask only where they plan on a GPU (off CUDA a profile has no device)."""
    free, total = torch.cuda.mem_get_info(device)
    return dict(device_total_bytes=total, device_free_bytes=free,
                framework_held_bytes=torch.cuda.memory_reserved(device),
                allocator_returns_cache=int(_allocator.expandable_segments()))


def margin_bytes(total):
    """The device memory the plan leaves free on a device of `total` bytes with torch's
    allocator as it is configured now (the library's margin for it)."""
    return step_plan.plan_step([], device_total_bytes=int(total),
                               allocator_returns_cache=int(_allocator.expandable_segments())
                               ).margin_bytes
