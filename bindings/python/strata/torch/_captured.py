"""What Hugging Face records from modules inside a streamed block (output_router_logits=True:
each mixture-of-experts router's logits, which the model's forward turns into its auxiliary
load-balancing loss; output_attentions: an attention's weights), with their gradient.

Transformers records them with forward hooks on the inner modules, appending each output to
the running forward's collector (transformers.utils.output_capturing._active_collector, a
dict of lists per recorded name). A streamed block's forward runs inside an autograd
function, without grad: what those hooks append carries none, and a loss built from it would
not train the routers. So the block's autograd function returns what was appended during its
forward as outputs of its own (Captures.taken), and the collector's entries are replaced by
those outputs, which carry the function's gradient (Captures.put_back). In the backward pass
the recompute runs with a collector of its own that receives the same entries, now with
grad (Captures.again), and the grads of those outputs flow into the block's backward beside
its output's. Without transformers' output capturing there is nothing to do."""

import contextlib

import torch


def _collector_variable():
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector


def is_recording_hook(hook):
    """Whether a forward hook is transformers' output-capturing hook (handled here: what it
    records carries the block's gradient), not a user's."""
    return getattr(hook, "__name__", "") == "output_capturing_hook" and \
        getattr(hook, "__module__", "").startswith("transformers.") and \
        _collector_variable() is not None


class Captures:
    """One streamed block's forward: marks where each recorded list of the running collector
    ends (begin), then names what the block appended (taken: (name, start, count) per list,
    and the tensors)."""

    def __init__(self):
        variable = _collector_variable()
        self.collected = variable.get() if variable is not None else None
        self.marks = {}
        self.spans = []  # (name, start, count) of what the block appended, per list

    def begin(self):
        if self.collected is not None:
            self.marks = {k: len(v) for k, v in self.collected.items() if isinstance(v, list)}

    def taken(self):
        """The tensors the block's inner modules appended during its forward, in order (a
        recorded None, for a layer the selection leaves out, stays in place)."""
        tensors = []
        for name, start in self.marks.items():
            entries = self.collected[name][start:]
            if entries:
                self.spans.append((name, start, len(entries)))
                tensors.extend(t for t in entries if isinstance(t, torch.Tensor))
        return tensors

    def put_back(self, outputs):
        """The collector's entries replaced by the function's outputs (in taken()'s order)."""
        outputs = iter(outputs)
        for name, start, count in self.spans:
            entries = self.collected[name]
            for i in range(start, start + count):
                if isinstance(entries[i], torch.Tensor):
                    entries[i] = next(outputs)

    @contextlib.contextmanager
    def again(self, received):
        """The recompute of the block: a collector of its own for the recorded names, each
        list as long as the forward's was at the block's start (what a hook does depends on
        it: the first hidden state), and what the block appends to them appended to
        `received` afterwards, in taken()'s order."""
        variable = _collector_variable()
        if not self.spans or variable is None:
            yield
            return
        fresh = {k: v for k, v in self.collected.items() if not isinstance(v, list)}
        fresh.update({name: [None] * start for name, start in self.marks.items()})
        token = variable.set(fresh)
        try:
            yield
        finally:
            variable.reset(token)
        for name, start, count in self.spans:
            received.extend(t for t in fresh[name][start:start + count]
                            if isinstance(t, torch.Tensor))
