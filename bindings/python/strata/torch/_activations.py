"""Which resident blocks keep their activations for the backward pass instead of recomputing
them (issue 13, item 2: spare HBM spent on skipping recompute), decided from measured memory.

A resident block runs as plain PyTorch with activation checkpointing, so its activation memory
is what a streamed block's is. When the device has memory to spare once the model, its
optimizer state and a step's peak are in, some of them can run without checkpointing: the
same values (checkpointing recomputes exactly what the forward computed, dropout's RNG
included), one forward pass less per block. How many cannot be known at offload time (the
batch's activations and logits are unknown then), so it is measured:

- the bytes each resident block saves for its backward when not checkpointed, for the actual
  inputs of the first forward pass with grad: its forward run once on fake tensors (shapes
  only, no memory, no compute; the RNG state restored), summing what autograd saves beside the
  parameters, and what it would keep selectively (below). Every block is measured, not one
  for all: a model's blocks can differ (dense and mixture-of-experts layers), in their bytes
  and in whether keeping one selectively is safe; a block that cannot be measured (an op
  without a fake kernel, a data-dependent shape) is never kept, nor any before it;
- the memory torch's caching allocator held at its peak through the second optimizer step
  (AdamW's moments exist from the first): reserved, not allocated, since with the default
  allocator what fragmentation strands is as unusable as what is allocated (an H200 run
  planned from the allocated peak ran out of memory asking for 15.6 GiB of logits with 11 GiB
  reserved and unused); with expandable segments (strata.torch._allocator) the allocated peak
  plus 2% of the device when that is less, since that allocator gives back what it caches
  where an allocation needs it (the library judges the peak: runtime/step/kept.cpp);
- what torch could hold at most: the device's free memory plus what torch holds now (the CUDA
  context and Strata's own HBM arena are outside it).

A block can keep what it saves in two ways (issue 13: more blocks skip recompute in the same
memory). Selectively: only the outputs of its matrix products and attention (what costs the
FLOPs) that its recompute reaches (torch stops recomputing past the last tensor autograd
saves, so a Llama block's last product is not cached), its norms, activation functions and
rotary embeddings recomputed in the backward pass from them (torch's selective activation
checkpointing); an 8B Llama block at 32k tokens holds ~3 GB that way instead of ~7 GB, and its
recompute shrinks to elementwise kernels.
Wholly: everything, no recompute at all. Spare memory buys selective blocks first (two to
three times as many blocks per byte for ~90% of the recompute each saves), then upgrades some
of them to whole with what is left. A random op is never served from the cache (a recompute
that skipped one would shift the RNG offsets of every random op after it), nor an attention
with dropout; a block that writes in place into one of those outputs keeps wholly or not at
all (found when measuring, through any alias: torch's own check at the backward pass misses
a write through _unsafe_view's tensor, and the grads would be silently wrong).

From the third step on, the last resident blocks skip recompute, as the library's step plan
decides from these measurements (strata.step_plan; runtime/step/kept.cpp has the rule and its
constants): from the last block back, each kept selectively (wholly when it cannot be) while
its bytes x 1.25 fit in usable - peak - margin, then upgraded to whole, from the last back,
with what that leaves; the margin is 4% of the device with expandable segments
(strata.torch._allocator), 10% without. A forward pass with more tokens, or longer sequences, than the measured steps had
runs checkpointed (activations and logits grow with the tokens, attention's with the
sequence). An out-of-memory error anywhere (the allocator counts them: a forward, a backward,
a step) turns keeping off for good; a step that made the allocator retry an allocation (free
its cache, a device synchronization) drops the first kept block. Only on CUDA.

Streamed blocks (issue 36: an 8B at 32x1024 on an H200 recomputed 17 streamed blocks' forward,
~0.44 s of a 3.9 s step, with ~50 GB of the device unused) keep selectively too, with what the
resident blocks leave: the same plan, the streamed blocks after the resident ones (from the
last streamed block back: their backward comes first, so what they hold is freed soonest), each
only selectively (wholly would save its weights). A streamed block's recompute runs its whole
forward (strata.torch._block: no early stop), so every costly op's output is kept
(measure(everything=True)), measured per streamed block as the resident blocks are (blocks can
differ; each at the batch, on fake tensors: a resident block's measurement stops at the early
stop, so it is not reused). Its forward then runs with grad as its recompute will (the same
ops, the same arguments: under no_grad an attention can skip its logsumexp and a matmul fold
differently), under the forward context of selective_context, its saved tensors dropped as
they are made (only the cached outputs stay); its recompute runs under the paired recompute
context, served those outputs."""

import time

import torch

from .. import step_plan
from . import _step
from ._measure import measure, selective_context, shape_of
from ._replay import ForwardState, without_forward_hooks


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
        self.tokens = 0  # the most tokens a measured step had
        self.seq = 0  # and the longest sequence
        # Per resident block, at self.tokens: measure()'s (whole bytes, (selective bytes,
        # limit) or None), or None when it cannot be measured. Each block is measured, not one
        # for all: blocks can differ (dense and mixture-of-experts layers in one model), in
        # their bytes and in whether keeping them selectively is safe at all.
        self.measured = {}
        # Per streamed block, at self.tokens: measure(everything=True)'s result, or None.
        self.streamed_measured = {}
        self.measure_seconds = 0.0  # host time spent measuring (what the first steps pay)
        self.decided = False
        self.emptied = False  # on_step emptied the allocator's cache (paged state)
        self.ooms = 0  # the allocator's out-of-memory count when the plan was made
        self.retries = 0  # the allocator's retry count after the last step
        self.retries_at_forward = None  # and when the next forward pass began (forward_begins)
        self.backed_off = 0  # blocks dropped from the plan for allocation retries
        # The last decide()'s step plan, for benchmarks and diagnostics: its numbers
        # (strata_step_plan_info_t's) and its text (None: not decided).
        self.decision = None
        # The step being measured, cut at each block's forward ("f") and backward ("b")
        # start with grad: the allocator's peaks (allocated, reserved) in the interval that
        # ends at (kind, block), blocks numbered in the model's order (resident, then
        # streamed), the last interval ("end", 0) ending at the step; the largest over the
        # step's passes. A kept block's activations live from its forward pass to its
        # backward pass: the plan adds each only to the intervals where it is alive
        # (at_point; the step plan), not to the step's peak whatever held it (an 8B at
        # 32 x 1024 peaked with the paged optimizer state back in HBM, late in the backward
        # pass, where the streamed blocks' kept outputs are long freed). And the step's peaks
        # over every interval (torch's statistics are reset at each point meanwhile).
        self.timeline = {}
        self.step_peaks = (0, 0)
        # The largest allocated over every interval noted so far (run-long): torch's own
        # max_memory_allocated counts only from the last point while the keeper measures.
        self.allocated_seen = 0

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

    def _last(self, item):
        """The last resident block's measure()d value: 0 whole bytes, 1 selective bytes, 2 its
        limit (what the benchmarks report); None when not measured."""
        measured = self.measured.get(len(self.blocks) - 1)
        if not measured:
            return None
        if item == 0:
            return measured[0]
        return None if measured[1] is None else measured[1][item - 1]

    block_bytes = property(lambda self: self._last(0), doc="The last block's whole bytes.")
    selective_bytes = property(lambda self: self._last(1),
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
        if not self._within_measured(args):
            return None
        return self.plan[from_last]

    def _within_measured(self, args):
        """Whether a block's inputs are no larger than the measured steps' (tokens, sequence)."""
        tokens, seq = shape_of(args)
        return tokens <= self.tokens and seq <= self.seq

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
        return "selective" if self._within_measured(args) else None

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
        self._end_interval((kind, len(self.blocks) + index if streamed else index))

    def _end_interval(self, key):
        allocated = torch.cuda.max_memory_allocated(self.device)
        reserved = torch.cuda.max_memory_reserved(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.step_peaks = (max(self.step_peaks[0], allocated), max(self.step_peaks[1], reserved))
        self.allocated_seen = max(self.allocated_seen, allocated)
        prior = self.timeline.get(key, (0, 0))
        self.timeline[key] = (max(prior[0], allocated), max(prior[1], reserved))

    def max_allocated(self):
        """torch.cuda.max_memory_allocated as it would read had the keeper not reset the peaks
        at each block start while measuring (what a user's "peak memory" print expects); 0
        off CUDA."""
        if self.device.type != "cuda":
            return 0
        return max(torch.cuda.max_memory_allocated(self.device), self.allocated_seen)

    def oom_since_plan(self):
        return self.device.type == "cuda" and \
            torch.cuda.memory_stats(self.device).get("num_ooms", 0) > self.ooms

    def observe(self, index, run, args, kwargs):
        """A forward pass with grad of resident block `index`, before the decision: note its
        tokens and, for the most tokens seen, what it would keep (measured once per block at
        that many tokens: one forward on fake tensors each)."""
        if self.forced is not None:
            return
        self._observe(self.measured, self.blocks[index], index, run, args, kwargs, None)

    def observe_streamed(self, index, run, args, kwargs):
        """A forward pass with grad of streamed block `index`, before the decision: as
        observe(), its bytes kept selectively measured with every costly op (its recompute
        runs the whole block)."""
        if self.forced_streamed is not None:
            return
        self._observe(self.streamed_measured, self.streamed_blocks[index], index, run, args,
                      kwargs, True)

    def _observe(self, measured, block, index, run, args, kwargs, everything):
        if self.decided or not self.enabled:
            return
        tokens, seq = shape_of(args)
        self.seq = max(self.seq, seq)
        if tokens > self.tokens:
            self.tokens = tokens
            self.measured.clear()
            self.streamed_measured.clear()
        if tokens == self.tokens and index not in measured:
            started = time.perf_counter()
            # The fake forward runs ops on 0-dim CPU buffers for real (a call counter,
            # BatchNorm's num_batches_tracked): they are put back after it.
            # The user's forward hooks see only real forward passes (without_forward_hooks).
            state = ForwardState(block)
            try:
                with without_forward_hooks(block):
                    measured[index] = measure(run, args, kwargs, self.device,
                                              list(block.parameters()), everything=everything)
            finally:
                state.restore_buffers()
            self.measure_seconds += time.perf_counter() - started

    def context(self, index):
        """checkpoint(context_fn=...) for resident block `index` kept selectively."""
        measured = self.measured.get(index)
        return selective_context(measured[1][1] if measured and measured[1] else None)

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
        if self.timeline and not self.decided:
            self._end_interval(("end", 0))  # the last block's backward pass and the step
        # The step that ended (its intervals and peaks); the next is measured afresh.
        timeline, self.timeline = self.timeline, {}
        peaks, self.step_peaks = self.step_peaks, (0, 0)
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
            measured = self.measured.get(i)
            whole = measured[0] if measured else 0
            selective = measured[1][0] if measured and measured[1] else 0
            keep = None
            if self.forced is not None:
                keep = self.mode(i, ())
            elif self.plan and (tokens is None or tokens <= self.tokens):
                keep = _mode_of(len(self.blocks) - 1 - i, self.count, self.whole)
            blocks.append(step_plan.Block(1, keep_whole_bytes=whole or 0,
                                          keep_selective_bytes=selective or 0,
                                          residency="resident", keep=keep or "recompute"))
        streamed = len(self.streamed_blocks)
        kept = self.kept_streamed
        if self.forced_streamed is None and tokens is not None and tokens > self.tokens:
            kept = 0  # more tokens than measured: they recompute
        for j in range(streamed):
            keep = "selective" if j >= streamed - kept else "recompute"
            blocks.append(step_plan.Block(1, keep_selective_bytes=self.streamed_bytes(j) or 0,
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

    def streamed_bytes(self, index):
        """Streamed block `index`'s measured bytes kept selectively (None: not measured, or
        it cannot be kept selectively)."""
        measured = self.streamed_measured.get(index)
        if not measured or measured[1] is None or measured[1][0] <= 0:
            return None
        return measured[1][0]

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
