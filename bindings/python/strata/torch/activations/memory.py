"""The measured step's memory: the allocator's peaks (allocated, reserved) in each interval
between block starts with grad, cut at each block's forward ("f") and backward ("b") start,
blocks numbered in the model's order (resident, then streamed), the last interval ("end", 0)
ending at the step; the largest over the step's passes. A kept block's activations live from
its forward pass to its backward pass: the plan adds each only to the intervals where it is
alive (the step plan), not to the step's peak whatever held it (an 8B at 32 x 1024 peaked with
the paged optimizer state back in HBM, late in the backward pass, where the streamed blocks'
kept outputs are long freed). torch's statistics are reset at each point meanwhile."""

import torch


class StepMemory:
    """The allocator's peaks on `device` by interval (timeline), over the step (step_peaks),
    and the largest allocated over every interval noted so far (run-long: torch's own
    max_memory_allocated counts only from the last point while the keeper measures)."""

    def __init__(self, device):
        self.device = device
        self.timeline = {}  # (kind, block) -> (allocated, reserved) peaks of the interval
        self.step_peaks = (0, 0)
        self.allocated_seen = 0

    def end_interval(self, key):
        """The interval that ends at `key` (kind, block): its peaks noted, torch's reset."""
        allocated = torch.cuda.max_memory_allocated(self.device)
        reserved = torch.cuda.max_memory_reserved(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.step_peaks = (max(self.step_peaks[0], allocated), max(self.step_peaks[1], reserved))
        self.allocated_seen = max(self.allocated_seen, allocated)
        prior = self.timeline.get(key, (0, 0))
        self.timeline[key] = (max(prior[0], allocated), max(prior[1], reserved))

    def take_step(self):
        """The step that ended, (timeline, peaks); the next is measured afresh."""
        timeline, self.timeline = self.timeline, {}
        peaks, self.step_peaks = self.step_peaks, (0, 0)
        return timeline, peaks

    def max_allocated(self):
        """torch.cuda.max_memory_allocated as it would read had the keeper not reset the peaks
        at each block start while measuring (what a user's "peak memory" print expects); 0
        off CUDA."""
        if self.device.type != "cuda":
            return 0
        return max(torch.cuda.max_memory_allocated(self.device), self.allocated_seen)
