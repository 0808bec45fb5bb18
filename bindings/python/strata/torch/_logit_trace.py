"""The logits followed from a causal LM's head to its cross-entropy (issue 52 item 3).

strata.torch._chunked_loss hands the head an empty slice of its hidden states (0 tokens) in a
forward pass with labels. What the model's forward then does with that empty output is followed
here, op by op, by a torch function mode pushed when the head returns and popped when the
model's forward does (this thread only): whatever Hugging Face's forward of any *ForCausalLM
does between its head and its loss, read from what it runs, not from its class.

- Ops that act on each token's row alone, with Python numbers or 0-d constants besides (the
  final logit soft-capping of Gemma 2/3: / cap, tanh, * cap; Cohere's * logit_scale;
  Granite's / logits_scaling; the loss's .float()), run on the empty tensor and are recorded.
- Reshapes that keep the vocabulary as the last dimension (the loss's view(-1, vocab_size))
  keep the rows in their order: recorded with the shape they give the whole tensor.
- F.cross_entropy (nn.CrossEntropyLoss calls it) of a followed tensor of shape (tokens, vocab)
  with integer targets, reduction "mean" or "sum", no class weights, no label smoothing: the
  chunked loss (the head and the recorded row ops over chunks of tokens, then the
  cross-entropy), returned to the model, which goes on as it would: the Trainer's division by
  num_items_in_batch, the router's auxiliary loss (Mixtral, Qwen3-MoE, OLMoE, GPT-OSS:
  `loss += router_aux_loss_coef * aux_loss`) are the model's own code on that loss.
- Reads of metadata (dtype, device, dim, shape, size()): the empty tensor's, 0 tokens (what
  the head computed; its other hooks see the same).
- Anything else on a followed tensor (a z-loss's logsumexp, a slice of tokens, an in-place
  write, a learned scale): the whole logits are computed there (the head over every token, the
  recorded ops after it) and the op runs on them, the model's own arithmetic at the model's own
  memory, with a warning once per model class and op. The result is right either way; only the
  memory differs.

Imports torch only."""

import warnings

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_WARNED = set()


def _functions(*names):
    found = set()
    for name in names:
        for owner in (torch, torch.Tensor):
            f = getattr(owner, name, None)
            if callable(f):
                found.add(f)
    return frozenset(found)


# Ops that compute each row (token) of their first argument from that row alone.
_ROWWISE = _functions(
    "mul", "multiply", "div", "divide", "true_divide", "add", "sub", "subtract", "rsub", "neg",
    "negative", "tanh", "sigmoid", "clamp", "clip", "float", "double", "half", "bfloat16", "to",
    "type_as", "__mul__", "__rmul__", "__truediv__", "__rtruediv__", "__div__", "__rdiv__",
    "__add__", "__radd__", "__sub__", "__rsub__", "__neg__", "__pos__")
# Ops that only give their input another shape (checked: the vocabulary stays last).
_RESHAPE = _functions("view", "reshape", "flatten", "view_as", "reshape_as", "contiguous",
                      "squeeze", "unsqueeze")
# Metadata, the empty tensor's.
_METADATA = _functions("size", "numel", "nelement", "__len__", "dim", "ndimension",
                       "get_device", "is_floating_point", "is_complex", "is_contiguous",
                       "element_size", "__hash__")


def _leaves(value):
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    else:
        yield value


def _replace(value, swap):
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_replace(v, swap) for v in value)
    if isinstance(value, dict):
        return {k: _replace(v, swap) for k, v in value.items()}
    return swap(value)


class Step:
    """One recorded op: func(x, *rest, **kwargs) for a row op, x.reshape(shape) for a
    reshape (shape: what it gives the whole tensor)."""
    __slots__ = ("func", "rest", "kwargs", "shape")

    def __init__(self, func, rest, kwargs, shape=None):
        self.func, self.rest, self.kwargs, self.shape = func, rest, kwargs, shape

    def apply(self, x):
        if self.shape is not None:
            return x.reshape(self.shape)
        return self.func(x, *self.rest, **self.kwargs)

    def is_fp32_cast(self):
        if self.shape is not None:
            return False
        if self.func is torch.Tensor.float:
            return not self.rest and not self.kwargs
        if self.func is torch.Tensor.to:
            return (self.rest == (torch.float32,) and not self.kwargs) or \
                (not self.rest and self.kwargs == {"dtype": torch.float32})
        return False


class Node:
    """A followed tensor: the recorded steps from the head's output, the shape the whole tensor
    would have, and (once computed) the whole tensor."""
    __slots__ = ("steps", "shape", "real")

    def __init__(self, steps, shape):
        self.steps, self.shape, self.real = steps, tuple(shape), None

    def row_steps(self):
        """The steps a chunk of rows goes through (reshapes and contiguous() change nothing
        there)."""
        return [s for s in self.steps
                if s.shape is None and s.func is not torch.Tensor.contiguous]


class Trace:
    """One forward pass's head output, followed until the model's forward returns.

    logits(): the head's whole output (the head over the hidden states it was not given).
    loss(transform, target, ignore_index, reduction): the chunked cross-entropy, transform
    None (the logits upcast to fp32, nothing else) or a function of a chunk of the logits."""

    def __init__(self, root, shape, logits, loss, name):
        self.logits_fn, self.loss_fn, self.name = logits, loss, name
        self.full = None
        self.mode = None
        # The followed tensors (empty, created here): id -> (tensor, Node), kept with the
        # trace rather than as attributes of torch's objects.
        self._nodes = {}
        self._tag(root, Node((), shape))

    def _tag(self, tensor, node):
        self._nodes[id(tensor)] = (tensor, node)

    def node_of(self, value):
        """The Node of a followed tensor, None for anything else."""
        if not isinstance(value, torch.Tensor):
            return None
        entry = self._nodes.get(id(value))
        return entry[1] if entry is not None and entry[0] is value else None

    def start(self):
        self.mode = _Follow(self)
        self.mode.__enter__()

    def stop(self):
        mode, self.mode = self.mode, None
        if mode is None:
            return
        mode.trace = None  # inert from now on, wherever it is on the stack
        size = torch._C._len_torch_function_stack()
        if size and torch._C._get_function_stack_at(size - 1) is mode:
            mode.__exit__(None, None, None)

    def real(self, tensor):
        """The whole tensor a followed one stands for (computed once)."""
        node = self.node_of(tensor)
        if node.real is None:
            if self.full is None:
                self.full = self.logits_fn()
            x = self.full
            for step in node.steps:
                x = step.apply(x)
            node.real = x
        return node.real

    # -- what the mode does with an op on a followed tensor.

    def handle(self, func, args, kwargs, nodes):
        first = args[0] if args else None
        node = self.node_of(first)
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property
            prop = getattr(getattr(func, "__self__", None), "__name__", "")
            value = func(*args, **kwargs)
            if not isinstance(value, torch.Tensor):
                return value
            return self._whole(func, args, kwargs, "." + prop)
        if node is not None and len(nodes) == 1:
            if func in _METADATA:
                return func(*args, **kwargs)
            if func in _ROWWISE and self._constants(args[1:], kwargs):
                out = func(*args, **kwargs)
                if isinstance(out, torch.Tensor) and out.shape == first.shape and \
                        out.device == first.device:
                    self._tag(out, Node(node.steps + (Step(func, args[1:], kwargs),), node.shape))
                    return out
            elif func in _RESHAPE:
                out = self._reshape(func, args, kwargs, node)
                if out is not None:
                    return out
            elif func is F.cross_entropy:
                out = self._cross_entropy(args, kwargs, node)
                if out is not None:
                    return out
        return self._whole(func, args, kwargs, name)

    @staticmethod
    def _constants(rest, kwargs):
        for leaf in _leaves((rest, kwargs)):
            if isinstance(leaf, torch.Tensor) and (leaf.dim() != 0 or leaf.requires_grad):
                return False
        return True

    def _reshape(self, func, args, kwargs, node):
        if any(isinstance(leaf, torch.dtype) for leaf in _leaves((args, kwargs))):
            return None  # view(dtype): another reading of the bits
        first = args[0]
        try:
            meta = torch.empty(node.shape, dtype=first.dtype, device="meta")
            shape = tuple(func(meta, *args[1:], **kwargs).shape)
        except (RuntimeError, TypeError, ValueError):
            return None  # the op's own error, on the whole tensor
        if len(shape) < 2 or shape[-1] != node.shape[-1]:
            return None
        out = first.reshape((0,) * (len(shape) - 1) + (shape[-1],))
        step = Step(None, (), {}, shape) if func is not torch.Tensor.contiguous else \
            Step(func, (), {})
        self._tag(out, Node(node.steps + (step,), shape))
        return out

    def _cross_entropy(self, args, kwargs, node):
        try:
            bound = _CE_SIGNATURE.bind(*args, **kwargs)
        except TypeError:
            return None
        a = bound.arguments
        target = a.get("target")
        if len(node.shape) != 2 or not isinstance(target, torch.Tensor) or \
                target.dtype.is_floating_point or target.dtype.is_complex or \
                self.node_of(target) is not None or a.get("weight") is not None or \
                a.get("size_average") is not None or a.get("reduce") is not None or \
                a.get("label_smoothing", 0.0) != 0.0 or \
                a.get("reduction", "mean") not in ("mean", "sum"):
            return None
        if target.numel() != node.shape[0]:
            raise ValueError("strata.torch: %s computes its loss over %d tokens' logits with %d "
                             "labels (after the shift): the head's tokens and the labels must "
                             "match (with logits_to_keep, pass labels for the kept positions "
                             "only)" % (self.name, node.shape[0], target.numel()))
        steps = node.row_steps()
        first = args[0] if args else a["input"]
        if first.dtype == torch.float32 and all(s.is_fp32_cast() for s in steps):
            transform = None
        else:
            def transform(x, steps=tuple(steps)):
                for step in steps:
                    x = step.apply(x)
                return x
        loss = self.loss_fn(transform, target, int(a.get("ignore_index", -100)),
                            a.get("reduction", "mean"))
        return loss if loss.dtype == first.dtype else loss.to(first.dtype)

    def _whole(self, func, args, kwargs, name):
        key = (self.name, name)
        if key not in _WARNED:
            _WARNED.add(key)
            warnings.warn("strata.torch: the forward pass of %s does %s with its logits, which "
                          "the chunked loss cannot compute a chunk of tokens at a time: the "
                          "whole logits are computed for it (the model's own result and "
                          "memory). strata.torch._chunked_loss.uninstall(model), or "
                          "offload(chunked_loss=False), says so" % (self.name, name or func),
                          stacklevel=4)

        def swap(value):
            return value if self.node_of(value) is None else self.real(value)
        return func(*_replace(tuple(args), swap), **_replace(dict(kwargs), swap))


def _ce_signature():
    import inspect
    return inspect.signature(F.cross_entropy)


_CE_SIGNATURE = _ce_signature()


class _Follow(TorchFunctionMode):
    def __init__(self, trace):
        super().__init__()
        self.trace = trace

    @torch.compiler.disable
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        trace = self.trace
        if trace is not None:
            nodes = [n for n in map(trace.node_of, _leaves((args, kwargs))) if n is not None]
            if nodes:
                return trace.handle(func, args, kwargs, nodes)
        return func(*args, **kwargs)
