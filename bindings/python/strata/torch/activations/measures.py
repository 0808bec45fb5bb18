"""What each block saves for its backward pass, measured: its forward run once on fake tensors
(shapes only, no memory, no compute; the RNG state restored) for the most tokens a step had,
summing what autograd saves beside the parameters and what it would keep selectively
(strata.torch._measure). Each block is measured, not one for all: blocks can differ (dense and
mixture-of-experts layers in one model), in their bytes and in whether keeping them
selectively is safe at all."""

import time

from .._measure import measure, selective_context, shape_of
from .._replay import ForwardState, without_forward_hooks


class BlockMeasures:
    """The measured bytes of the resident `blocks` and the `streamed_blocks` on `device`."""

    def __init__(self, device, blocks, streamed_blocks):
        self.device = device
        self.blocks = blocks
        self.streamed_blocks = streamed_blocks
        self.tokens = 0  # the most tokens a measured step had
        self.seq = 0  # and the longest sequence
        # Per resident block, at self.tokens: measure()'s (whole bytes, (selective bytes,
        # limit) or None), or None when it cannot be measured.
        self.measured = {}
        # Per streamed block, at self.tokens: measure(everything=True)'s result, or None.
        self.streamed_measured = {}
        self.measure_seconds = 0.0  # host time spent measuring (what the first steps pay)

    def within(self, args):
        """Whether a block's inputs are no larger than the measured steps' (tokens, sequence)."""
        tokens, seq = shape_of(args)
        return tokens <= self.tokens and seq <= self.seq

    def observe(self, streamed, index, run, args, kwargs):
        """A forward pass with grad of block `index` (a streamed one's when `streamed`: every
        costly op counted, its recompute runs the whole block): note its tokens and, for the
        most tokens seen, what it would keep (measured once per block at that many tokens)."""
        measured = self.streamed_measured if streamed else self.measured
        block = (self.streamed_blocks if streamed else self.blocks)[index]
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
                                              list(block.parameters()),
                                              everything=True if streamed else None)
            finally:
                state.restore_buffers()
            self.measure_seconds += time.perf_counter() - started

    def resident_bytes(self, index):
        """Resident block `index`'s (whole, selective) bytes (0: not measured, or it cannot
        keep that way)."""
        measured = self.measured.get(index)
        whole = measured[0] if measured else 0
        selective = measured[1][0] if measured and measured[1] else 0
        return whole or 0, selective or 0

    def last(self, item):
        """The last resident block's measure()d value: 0 whole bytes, 1 selective bytes, 2 its
        limit (what the benchmarks report); None when not measured."""
        measured = self.measured.get(len(self.blocks) - 1)
        if not measured:
            return None
        if item == 0:
            return measured[0]
        return None if measured[1] is None else measured[1][item - 1]

    def streamed_bytes(self, index):
        """Streamed block `index`'s measured bytes kept selectively (None: not measured, or
        it cannot be kept selectively)."""
        measured = self.streamed_measured.get(index)
        if not measured or measured[1] is None or measured[1][0] <= 0:
            return None
        return measured[1][0]

    def context(self, index):
        """checkpoint(context_fn=...) for resident block `index` kept selectively."""
        measured = self.measured.get(index)
        return selective_context(measured[1][1] if measured and measured[1] else None)
