"""How much of the state pages, measured, not guessed: under "auto" the first groups whose
host copies fit in what the host budget leaves at the first step's end; on CUDA then, from the
timed page-out (the copies out against the forward pass that ran beside them), the groups
whose copies fit in WINDOW_SHARE of that window. The activation keeper waits for the decision
(StatePager.settled)."""

import torch

from ... import step_plan
from .. import _planning
from .groups import nbytes


class PageSizing:
    """A StatePager's decision of how many of its groups (a prefix) page. `live`: the ids of
    the masters that are the model's own parameters (their state pages, they do not)."""

    # The share of the measured window (copies out during the forward pass) the paged bytes
    # may take: the copies' rate varies with what the host does meanwhile.
    WINDOW_SHARE = 0.85

    def __init__(self, live, sizing, auto, device):
        cuda = device.type == "cuda"
        self.live = live
        self.device = device
        self.sized = not (sizing and cuda)
        # Whether the page-out under way is the timed one, its copies' (start, end) events,
        # and its forward pass's window: where it begins, where it reaches its last block.
        self.timed, self.busy, self.began, self.reached = False, [], None, None
        self.timing = None  # ([(copies start, end)], forward begins, reaches its last block)
        self.full_bytes = 0  # what every group's tensors take (once the moments exist)
        self.full_steps = 0  # steps' page-outs that took everything, before the sizing
        # auto: the first step's end decides how much pages from the host's available memory
        # ("first"; None: decided, or not auto).
        self.probe = "first" if auto and cuda else None
        self.decision = None  # auto's: the host memory it saw, what fits (diagnostics)

    def page_out_timed(self, step, paged_bytes):
        """A page-out of `paged_bytes` (`step`: a step's, not a forward pass's again): whether
        the next forward pass times its copies. The second step's page-out that takes
        everything is timed, not the first: its window ran long with the allocator growing
        into the new pattern and sized too much in (a 3.6B at 32x1024: 22-23 of 28 groups, its
        forward pass 0.07-0.1 s longer, the host waiting for the copies at the last block;
        15-16 timed later)."""
        full = step and not self.sized and paged_bytes >= self.full_bytes > 0
        if full:
            self.full_steps += 1
        self.timed = full and self.full_steps >= 2
        self.busy, self.began, self.reached = [], None, None

    def event(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def window_begins(self):
        """A fresh forward pass begins with the copies out under way."""
        if self.timed:
            self.began = self.event()

    def copies_issued(self, before, after):
        """A batch of copies out between events `before` and `after` on the copy stream: timed
        from when the stream got to them, their own time, not the forward pass's pace of
        issuing them."""
        if self.timed:
            self.busy.append((before, after))

    def window_ends(self):
        """The forward pass reached its last block: the timed window, if one began, ends."""
        if self.timed and self.began is not None and self.reached is None:
            self.reached = self.event()
            self.timing = (self.busy, self.began, self.reached)

    def host_fit(self, groups, budget):
        """auto, at the first step's end (the moments exist): how many of the first groups'
        host copies fit in what the budget leaves then (without one, a pager made outside
        strata.torch.AdamW: what the library's step plan leaves a default host budget's pools
        of the host memory available, half of it: strata.step_plan). None fit: nothing ever
        pages, and the sizing is done."""
        self.probe = None
        if budget is not None:
            available = None
            room = budget.room()
        else:
            available = _available_host_bytes()
            room = step_plan.plan_step([], host_available_bytes=available).host_total_bytes
        fits = self.fitting(groups, room)
        self.decision = dict(host_available_bytes=available, host_room_bytes=int(room),
                             groups_fitting_host=fits)
        if fits == 0:
            self.sized = True
        return fits

    def budget_fit(self, groups, room):
        """Not auto (a count of blocks or every resident parameter's): how many of the first
        groups fit in the budget's `room` now; none: nothing to time, the sizing is done (the
        activation keeper may plan)."""
        fits = self.fitting(groups, room)
        if fits == 0:
            self.sized = True
        return fits

    def fitting(self, groups, room):
        """How many of the first `groups`' host copies fit in `room` bytes."""
        fits, total = 0, 0
        for group in groups:
            total += sum(self.paged_size(m) for m in group)
            if total > room:
                break
            fits += 1
        return fits

    def paged_size(self, master):
        """The bytes a master pages once AdamW's state exists: the master itself (unless it
        is the model's own fp32 parameter) and its two fp32 moments (counted from the master:
        a first step without grads makes none, and a fit counted from what exists then was 3x
        too small). The host buffer aligns each tensor to 512 bytes (HostCopies.pairs): at
        most that much more per tensor, inside host_budget's documented constant."""
        moments = 2 * master.numel() * 4
        return moments + (0 if id(master) in self.live else nbytes(master))

    def window_fit(self, group_bytes, paged_bytes):
        """From the timed page-out: how many of the first groups (`group_bytes`, each one's
        paged bytes) have copies that fit in WINDOW_SHARE of the window, the sizing then done;
        None where nothing was timed (or the times are unusable)."""
        self.full_bytes = sum(group_bytes)
        if self.timing is None:
            return None
        busy, began, reached = self.timing
        self.timing = None
        copies = sum(b.elapsed_time(a) for b, a in busy)  # ms
        window = began.elapsed_time(reached)
        if copies <= 0 or window <= 0:
            return None
        budget = paged_bytes * min(1.0, self.WINDOW_SHARE * window / copies)
        total, active = 0, 0
        for size in group_bytes:
            total += size
            if total > budget:
                break
            active += 1
        self.sized = True
        return active


def _available_host_bytes():
    """The host memory available now (a pager without a budget decides from it)."""
    return _planning.available_host_bytes()
