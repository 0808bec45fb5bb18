"""ActivationKeeper: which blocks keep their activations, planned by the library's step plan
from what BlockMeasures and StepMemory measured, executed block by block (mode,
streamed_mode), and backed off when the allocator retries or runs out of memory.
strata.torch.activations' docstring says how and why."""

import torch

from ... import step_plan
from .. import _step
from .._measure import selective_context
from .measures import BlockMeasures
from .memory import StepMemory


class ActivationKeeper:
    """One per offloaded model with resident blocks."""

    # The plan is made after this many steps (AdamW's moments exist from the first). The
    # margins, the block factor and how a peak is judged are the library's (runtime/step/).
    DECIDE_AFTER_STEPS = 2

    def __init__(self, device, blocks, streamed_blocks=()):
        self.device = device
        self.blocks = blocks  # the resident blocks, in order
        self.streamed_blocks = streamed_blocks  # the streamed blocks, in order (after them)
        self.enabled = device.type == "cuda"  # measured and planned (only on CUDA)
        self.plan = []  # the modes of the last resident blocks, the last block's first
        # Of the same plan (decide), how many of the last streamed blocks keep selectively.
        self.streamed = 0
        self.forced = None  # a fixed count (tests, tools); None: measured
        self.forced_whole = 0  # of a forced count, how many keep everything
        self.forced_streamed = None  # a fixed count of the last streamed blocks; None: measured
        self.steps = 0
        # What each block saves (measured at the most tokens seen), and the measured step's
        # memory by interval between block starts (at_point).
        self.measures = BlockMeasures(device, blocks, streamed_blocks)
        self.memory = StepMemory(device)
        self.decided = False
        self.emptied = False  # on_step emptied the allocator's cache (paged state)
        self.ooms = 0  # the allocator's out-of-memory count when the plan was made
        self.retries = 0  # the allocator's retry count after the last step
        self.retries_at_forward = None  # and when the next forward pass began (forward_begins)
        self.backed_off = 0  # blocks dropped from the plan for allocation retries
        # The last decide()'s step plan, for benchmarks and diagnostics: its numbers
        # (strata_step_plan_info_t's) and its text (None: not decided).
        self.decision = None

    @property
    def count(self):
        """How many of the last resident blocks skip recompute."""
        return len(self.plan)

    @property
    def whole(self):
        """How many of those keep everything (the rest: selectively)."""
        return self.plan.count("whole")

    def stop(self):
        """Every block recomputes from now on (an out-of-memory error said the plan was
        wrong)."""
        self.plan = []
        self.streamed = 0

    @property
    def kept_streamed(self):
        """How many of the last streamed blocks keep selectively (forced or planned)."""
        return self.forced_streamed if self.forced_streamed is not None else self.streamed

    block_bytes = property(lambda self: self.measures.last(0),
                           doc="The last block's whole bytes.")
    selective_bytes = property(lambda self: self.measures.last(1),
                               doc="The last block's selective bytes (None: it cannot be).")

    def mode(self, index, args):
        """How resident block `index` runs now (args: its inputs): None (checkpointed: its
        forward recomputed in the backward pass), "selective" or "whole"."""
        from_last = len(self.blocks) - 1 - index
        if self.forced is not None:
            return _mode_of(from_last, self.forced, self.forced_whole)
        if from_last >= len(self.plan):
            return None
        if from_last == len(self.plan) - 1 and self.oom_since_plan():
            self.stop()
            return None
        if not self.measures.within(args):
            return None
        return self.plan[from_last]

    def streamed_mode(self, index, args):
        """How streamed block `index` runs now: None (its forward recomputed whole in the
        backward pass) or "selective" (its costly ops' outputs kept)."""
        from_last = len(self.streamed_blocks) - 1 - index
        if self.forced_streamed is not None:
            return "selective" if from_last < self.forced_streamed else None
        if from_last >= self.streamed:
            return None
        if from_last == self.streamed - 1 and not self.plan and self.oom_since_plan():
            self.stop()
            return None
        return "selective" if self.measures.within(args) else None

    def streamed_contexts(self):
        """The (forward, recompute) context pair of a streamed block kept selectively: every
        costly op's output cached (its recompute runs the whole block, no early stop)."""
        forward, recompute = selective_context(None)
        # torch >= 2.12 may route cached outputs through the saved-tensor hooks in scope (the
        # ones dropping what the kept forward saves, the spill's): they stay as they are.
        forward.respect_saved_tensors_hooks = False
        return forward, recompute

    def at_point(self, kind, index, streamed):
        """Block `index` (of the streamed blocks when `streamed`, else of the resident ones)
        begins its forward ("f") or backward ("b") pass with grad: while a plan is to be made,
        the allocator's peaks since the last point are noted for the interval that ends here,
        and reset (torch.cuda.max_memory_allocated and _reserved count from each point in the
        steps before the decision)."""
        if not self.enabled or self.decided:
            return
        self.memory.end_interval((kind, len(self.blocks) + index if streamed else index))

    def max_allocated(self):
        """torch.cuda.max_memory_allocated as if the keeper had not reset the peaks
        (StepMemory.max_allocated)."""
        return self.memory.max_allocated()

    def oom_since_plan(self):
        return self.device.type == "cuda" and \
            torch.cuda.memory_stats(self.device).get("num_ooms", 0) > self.ooms

    def observe(self, index, run, args, kwargs):
        """A forward pass with grad of resident block `index`, before the decision: note its
        tokens and, for the most tokens seen, what it would keep (measured once per block at
        that many tokens: one forward on fake tensors each)."""
        if self.forced is None and not self.decided and self.enabled:
            self.measures.observe(False, index, run, args, kwargs)

    def observe_streamed(self, index, run, args, kwargs):
        """A forward pass with grad of streamed block `index`, before the decision: as
        observe(), its bytes kept selectively measured with every costly op (its recompute
        runs the whole block)."""
        if self.forced_streamed is None and not self.decided and self.enabled:
            self.measures.observe(True, index, run, args, kwargs)

    def context(self, index):
        """checkpoint(context_fn=...) for resident block `index` kept selectively."""
        return self.measures.context(index)

    def on_step(self, settled=True, paged=False):
        """After an optimizer step: the decision, once enough steps were measured and the
        memory a step uses has `settled` (strata.torch.paging sizes what it pages first).
        `paged`: optimizer state leaves the device between steps; the steps before it settled
        used memory in another pattern, and what the allocator reserved for them (it keeps
        what it reserved) is not what a step needs now: the cache is emptied and the peak
        statistics reset once it settles, and the next step is measured instead of the peaks
        since the start (torch.cuda.max_memory_allocated and _reserved then count from
        there).
        Once decided, each step in which the allocator retried an allocation (it synchronized
        the device to free its cache and map its pages again, in the middle of the step: an
        8B at 32x1024 with 14 blocks kept retried in most steps, its forward pass 0.35 s
        slower) drops the first kept block from the plan: the plan was too close to full for
        this pattern."""
        self.steps += 1
        if not self.enabled:
            return
        if self.memory.timeline and not self.decided:
            self.memory.end_interval(("end", 0))  # the last block's backward pass and the step
        timeline, peaks = self.memory.take_step()  # the next step is measured afresh
        if self.decided:
            self._watch_retries()
            return
        if self.steps < self.DECIDE_AFTER_STEPS or not settled:
            return
        stats = torch.cuda.memory_stats(self.device)
        if paged and not self.emptied:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.emptied = True
            return
        self.decided = True
        self.ooms = stats.get("num_ooms", 0)
        self.retries = stats.get("num_alloc_retries", 0)
        # With intervals noted, torch's peaks count from the last point only: the step's are
        # the keeper's own.
        self.decide(_step.device_figures(self.device), peaks if timeline else None, timeline)

    def forward_begins(self):
        """A forward pass with grad reaches the first block (resident, or streamed when none
        is): the retries counted against the plan are those from the first such point after a
        step to the next step (a checkpoint's copies between steps, say, are not the plan's
        doing)."""
        if self.decided and (self.plan or self.streamed) and self.retries_at_forward is None:
            self.retries_at_forward = \
                torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)

    def _watch_retries(self):
        retries = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)
        since = self.retries if self.retries_at_forward is None else self.retries_at_forward
        if retries > since and (self.plan or self.streamed):
            # The first kept block: a streamed one while any keeps (the plan lists the
            # resident blocks' from the last back, then the streamed blocks').
            if self.streamed:
                self.streamed -= 1
            else:
                self.plan.pop()
            self.backed_off += 1
        self.retries = retries
        self.retries_at_forward = None

    def profile_blocks(self, tokens=None, keeping=True):
        """The step plan's blocks (strata.step_plan.Block), the resident ones then the streamed
        ones, with their measured bytes and, at a batch of `tokens` (None: whatever the batch),
        how each keeps now: a plan applies to batches of no more tokens than were measured
        (activations grow with them), a forced count (tests, tools) to any. `keeping` False:
        every block recomputing (a measured step's, which a kept plan is made from)."""
        if not keeping:
            return [step_plan.Block(1, keep_whole_bytes=b.keep_whole_bytes,
                                    keep_selective_bytes=b.keep_selective_bytes,
                                    residency=b.residency) for b in self.profile_blocks()]
        blocks = []
        for i in range(len(self.blocks)):
            whole, selective = self.measures.resident_bytes(i)
            keep = None
            if self.forced is not None:
                keep = self.mode(i, ())
            elif self.plan and (tokens is None or tokens <= self.measures.tokens):
                keep = _mode_of(len(self.blocks) - 1 - i, self.count, self.whole)
            blocks.append(step_plan.Block(1, keep_whole_bytes=whole,
                                          keep_selective_bytes=selective,
                                          residency="resident", keep=keep or "recompute"))
        streamed = len(self.streamed_blocks)
        kept = self.kept_streamed
        if self.forced_streamed is None and tokens is not None and \
                tokens > self.measures.tokens:
            kept = 0  # more tokens than measured: they recompute
        for j in range(streamed):
            keep = "selective" if j >= streamed - kept else "recompute"
            selective = self.measures.streamed_bytes(j) or 0
            blocks.append(step_plan.Block(1, keep_selective_bytes=selective,
                                          residency="streamed", keep=keep))
        return blocks

    def decide(self, figures, peaks=None, timeline=None):
        """The plan from the measured blocks (the library's step plan: strata.step_plan), with
        `figures` the device as torch sees it (strata.torch._step.device_figures), `peaks`
        the measured step's (allocated, reserved) peaks (None: torch's since its last reset)
        and `timeline` its peaks in each interval between block starts (at_point), by the point
        that ends it. The plan keeps from the last resident block back, as long as each was
        measured, then from the last streamed block back, as long as each can keep selectively;
        with every block's two points in the timeline each kept block counts in the intervals
        where it is alive, else at the step's peak."""
        if peaks is None:
            peaks = (torch.cuda.max_memory_allocated(self.device),
                     torch.cuda.max_memory_reserved(self.device))
        blocks = self.profile_blocks(keeping=False)
        intervals = [(kind, g, allocated, reserved)
                     for (kind, g), (allocated, reserved) in (timeline or {}).items()]
        plan = step_plan.plan_step(blocks, intervals, plan_kept=True,
                                   step_allocated_peak_bytes=peaks[0],
                                   step_reserved_peak_bytes=peaks[1], **figures)
        keeps = plan.keeps()
        resident = len(self.blocks)
        self.plan = []
        for i in reversed(range(resident)):
            if keeps[i] is None:
                break
            self.plan.append(keeps[i])
        self.streamed = 0
        for j in reversed(range(resident, len(keeps))):
            if keeps[j] is None:
                break
            self.streamed += 1
        self.decision = dict(plan.info, text=plan.text)

    def describe(self):
        """'N keep their activations (S selectively)', and how many streamed blocks keep
        selectively, or '' when none do."""
        count = self.forced if self.forced is not None else self.count
        whole = self.forced_whole if self.forced is not None else self.whole
        said = []
        if count > 0:
            whole = min(whole, count)
            if whole == count:
                said.append("%d keep their activations" % count)
            else:
                said.append("%d keep their activations (%d of them only their matrix "
                            "products' and attention's outputs)" % (count, count - whole))
        streamed = self.kept_streamed
        if streamed > 0:
            said.append("%d streamed block%s only %s matrix products' and attention's "
                        "outputs" % (streamed, " keeps" if streamed == 1 else "s keep",
                                     "its" if streamed == 1 else "their"))
        return "; ".join(said)


def _mode_of(from_last, count, whole):
    """The mode of the block `from_last` blocks before the last, the last `count` kept, the
    last `whole` of them wholly."""
    if from_last >= count:
        return None
    return "whole" if from_last < whole else "selective"
