"""The causal-LM loss without the whole logits (issue 36 item 1).

A causal LM's forward with labels computes the head over every token, then the cross-entropy
on those logits upcast to fp32: at 148 x 1024 tokens and a 128256-token vocabulary that is a
39 GB bf16 tensor and a 78 GB fp32 one. Here the head and the cross-entropy run over chunks of
tokens instead, forward and backward per chunk, in the forward pass (the fused
linear-cross-entropy idea, as Liger-Kernel does it): each chunk's grads of the hidden states
and of the head are computed as soon as its logits are, and only those grads are kept (the
hidden states' grad in their dtype, the head's summed in fp32 and rounded once), so at most one
chunk's logits exist at a time. The backward pass only scales the kept grads by the loss's
incoming grad.

The arithmetic is Hugging Face's ForCausalLMLoss's: the logits of a chunk are F.linear(hidden,
weight, bias) in the compute dtype (autocast's where autocast is on), upcast to fp32, the
cross-entropy (log-sum-exp minus the target's logit) summed in fp32 over the tokens whose label
is not ignore_index, divided by their count (reduction "mean") or by num_items_in_batch (the
Trainer's: reduction "sum", then the division). The grad of the fp32 logits, (softmax - one-hot)
/ denominator, is cast to the compute dtype as autograd's upcast does, and multiplied out as
F.linear's backward does. What differs is only the order of the sums: the loss summed per chunk
then over the chunks, the head's weight grad summed per chunk in fp32 over the chunks and rounded
to the weight's dtype once (the whole-batch product rounds its own way). The tolerance
(tests/python/torch/test_torch_chunked_loss.py, against the model's own loss, same seed and data):
fp32, the loss within 1e-6 relative and every grad within 1e-5 of its tensor's largest
element; bf16, the loss within 1e-3 relative and every grad within 2e-2 of its scale (a few
bf16 roundings: 2^-8 = 3.9e-3 is one). Measured on the CPU with tiny Llama, Qwen2, Qwen3,
Mistral, GPT-2, Gemma 2 and 3, Phi-3, OLMo 2, GPT-NeoX, Cohere, Granite, DeepSeek-V3, Mixtral,
Qwen3-MoE, OLMoE, GPT-OSS (with and without the router's loss) and the package's Llama (39
tokens in chunks of 8): fp32 losses within 2e-7 and grads within 1.7e-6 of their scale; bf16
losses within 2e-7, grads within 1.5e-4 (the CPU's bf16 products sum in fp32 and round once,
as the chunked weight grad does; a GPU's round their own way). Where the model changes the
logits before its loss (soft-capping, a scale), each chunk's changes and the cross-entropy's
grad through them are autograd's, as in the model's own backward.

Two ways in:

- linear_cross_entropy(hidden, weight, bias, targets, ...): the loss of already shifted,
  flattened targets (a ChunkedLinearCrossEntropy autograd function).
- install(model, chunk_tokens=None): a model computes its loss this way whenever labels are
  passed, through hooks only (the model's forward and its head's stay what they are, so other
  hooks and wrapped forwards, strata.torch.offload's, compose). Any Hugging Face *ForCausalLM
  (or a model of one's own) whose output head, get_output_embeddings() or lm_head, is a plain
  nn.Linear with or without a bias: the head's forward pre-hook keeps the hidden states it is
  given and hands it an empty slice of them (0 tokens: the head computes nothing), and what the
  forward then does with that empty output is followed as it runs
  (strata.torch._logit_trace): the row-by-row changes it makes (Gemma 2/3's
  final_logit_softcapping, Cohere's logit_scale, Granite's logits_scaling, the loss's
  .float()) are recorded, and its F.cross_entropy over them returns the chunked loss, each
  chunk's logits changed as the model changes them; the model's own code goes on from there
  (the Trainer's num_items_in_batch, shift_labels and ignore_index as its loss function reads
  them, and the router's auxiliary loss of Mixtral, Qwen3-MoE, OLMoE, GPT-OSS: router_aux_loss_coef
  x the load-balancing loss of the router logits added to that loss, exactly its own). The
  package's own Llama (bench/llama_zoo/torch_llama.py), which shifts its logits rather than its
  labels, has its labels taken out of the call and its loss computed from the hidden states the
  head is given. out.logits is computed on first access (the head over the kept hidden states
  and the recorded changes, attached to the autograd graph, under the grad and autocast modes
  of the forward pass), in the dtype the model would have returned; the loss alone never
  computes it. The output keeps the final hidden states (B x T x H, which the model's own path
  keeps for its backward too) for that. uninstall(model), or handle.enabled = False, returns to
  the model's own path.

What the model's own path computes instead (documented fallbacks, the same result as without
install): calls without labels (generation), return_dict=False (a tuple holding the whole
logits is what was asked for), a loss function the user set on the model (model.loss_function
= ...: theirs to compute), the package's own model with config.loss_impl other than "torch" (its
own chunked loss). Per op, within a forward pass: whatever the forward does with the head's
output that is not a row-by-row change, a reshape keeping the vocabulary last, or a
cross-entropy of integer targets with reduction "mean" or "sum" (a z-loss over the logits,
a shift of the logits, label smoothing, a learned scale): the whole logits are computed for
that op, the model's own result at the model's own memory, with a warning once per model class
and op. Refused: install() on a model without an output head, whose head is not a plain
nn.Linear (LoRA-wrapped, quantized), whose forward takes no labels, or a Hugging Face model
whose loss function is not ForCausalLMLoss (a masked LM's); per call, labels that are not
integers, or whose count (after the shift) differs from the head's tokens (where the model's
own loss fails too, as with logits_to_keep and labels for every position).

Memory between the forward and the backward pass: the hidden states' grad (B x T x H in their
dtype) and the head's weight grad in its dtype (V x H, in fp32 while the chunks run); during the
forward pass one chunk's logits in the compute dtype and in fp32 and their grad in the compute
dtype: (2 + 4 + 2) x chunk_tokens x V bytes; where the model changes the logits before its loss
(soft-capping, a scale), about twice that (autograd's saved tensors of the changes and of the
cross-entropy, and the grad through them). Several forward passes before one backward each
keep their own. The chunk's size defaults to the library's step plan's: the tokens whose fp32
logits fit in 1 GiB (2088 tokens at V = 128256).

Imports torch only (transformers when a model has it); the default chunk asks libstrata."""

import collections
import functools
import inspect
import threading

import torch
import torch.nn.functional as F
from torch import nn

from . import _logit_trace

from ._chunked_ce import (IGNORE_INDEX, _autocast_state, _check_integer,  # noqa: F401
                          ChunkedLinearCrossEntropy, check_chunk_tokens,
                          default_chunk_tokens, linear_cross_entropy)


# ---------------------------------------------------------------------------------------------
# The model integration.

# What install() takes: any model whose forward takes labels and has an output head that is a
# plain nn.Linear (get_output_embeddings(), or lm_head). What its forward does with the head's
# output is followed as it runs (strata.torch._logit_trace), not assumed from its class. The
# package's own Llama (bench/llama_zoo) shifts its logits, not its labels: its labels are taken
# out of the call and its loss computed from the head's input (the "zoo" flavour).


def _forward_owner(model):
    for klass in type(model).__mro__:
        if "forward" in vars(klass):
            return klass
    return None


def _flavour(model):
    """'zoo' (the package's own Llama, from the class defining forward) or 'traced'."""
    owner = _forward_owner(model)
    module = getattr(owner, "__module__", "") or ""
    if owner is not None and owner.__name__ == "LlamaForCausalLM" and \
            module.rpartition(".")[2] == "torch_llama" and "llama_zoo" in module:
        return "zoo"
    return "traced"


def _head(model):
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if head is not None else getattr(model, "lm_head", None)


def _hf_causal_loss():
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return None
    return ForCausalLMLoss


def _is_hf(model):
    return any((k.__module__ or "").startswith("transformers.")
               for k in type(model).__mro__ if k.__name__ == "PreTrainedModel")


def _takes_labels(model):
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return True
    return "labels" in parameters or any(p.kind == p.VAR_KEYWORD for p in parameters.values())


def unsupported_reason(model):
    """Why install(model) would refuse it (a sentence), or None where it is supported."""
    name = type(model).__name__
    head = _head(model)
    if head is None:
        return "%s: it has no output head (get_output_embeddings() or lm_head)" % name
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        return ("%s: its head is a %s, not a plain nn.Linear (a wrapped or quantized head "
                "computes something else)" % (name, type(head).__name__))
    if not _takes_labels(model):
        return "%s: its forward takes no labels" % name
    if _is_hf(model) and getattr(model, "loss_function", None) is not _hf_causal_loss():
        return ("%s: its loss function is %r, not transformers' ForCausalLMLoss"
                % (name, getattr(model, "loss_function", None)))
    return None


class _Call:
    """One forward pass with labels, intercepted. zoo: the labels taken out, the loss computed
    from the head's input (hidden, loss); traced: the head's input kept (hidden), its empty
    output followed (trace)."""
    __slots__ = ("labels", "hidden", "loss", "zoo", "trace", "modes")

    def __init__(self, labels, zoo):
        self.labels, self.zoo = labels, zoo
        self.hidden = self.loss = self.trace = self.modes = None


class ChunkedLoss:
    """What install() returns (also model._strata_chunked_loss): enabled (set False to use
    the model's own loss until set True again), chunk_tokens, remove()."""

    def __init__(self, model, chunk_tokens, auto=False):
        self.model = model
        self.head = _head(model)
        self.flavour = _flavour(model)
        self.chunk_tokens = chunk_tokens
        self.enabled = True
        # True: a call whose labels fit one chunk computes the model's own loss (install's auto).
        self.auto = bool(auto)
        self._local = threading.local()
        signature = inspect.signature(_forward_owner(model).forward)
        positional = [p.name for p in signature.parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        # Where labels sit among the positional arguments (self not counted).
        self._labels_at = positional.index("labels") - 1 if "labels" in positional else None
        self._handles = [
            # First among the model's pre-hooks and always called after: one entry per call
            # on this thread's stack, popped whatever happens in between.
            model.register_forward_pre_hook(self._model_pre, with_kwargs=True, prepend=True),
            model.register_forward_hook(self._model_post, with_kwargs=True, always_call=True),
        ]
        self._head_handles = self._hook_head(self.head)

    def _hook_head(self, head):
        return [head.register_forward_pre_hook(self._head_pre, with_kwargs=True),
                head.register_forward_hook(self._head_post, prepend=True)]

    def _follow_head(self):
        """The model's head replaced since install (resize_token_embeddings builds a new one):
        checked again as install checks, and the hooks moved onto it."""
        head = _head(self.model)
        if head is self.head:
            return
        reason = unsupported_reason(self.model)
        if reason is not None:
            raise ValueError("strata.torch: the model's head changed since the chunked loss was "
                             "installed, and the new one cannot be matched: %s; "
                             "strata.torch._chunked_loss.uninstall(model) computes the model's "
                             "own loss" % reason)
        for handle in self._head_handles:
            handle.remove()
        self.head = head
        self._head_handles = self._hook_head(head)

    def __getstate__(self):  # copy.deepcopy(model), pickle: without the thread's state
        state = dict(self.__dict__)
        del state["_local"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local = threading.local()

    def remove(self):
        for handle in self._handles + self._head_handles:
            handle.remove()
        self._handles = self._head_handles = []
        if self.model.__dict__.get("_strata_chunked_loss") is self:
            del self.model.__dict__["_strata_chunked_loss"]

    def _stack(self):
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    # -- the model's pre-hook: the labels (taken out for the package's own model).

    def _intercept(self, args, kwargs):
        """(_Call, args, kwargs), or None for the model's own path."""
        if not self.enabled:
            return None
        positional = self._labels_at is not None and len(args) > self._labels_at
        labels = args[self._labels_at] if positional else kwargs.get("labels")
        if labels is None:
            return None
        if self.auto and torch.is_tensor(labels) and labels.numel() <= self.chunk_tokens:
            return None  # one chunk: the whole logits take no more than a chunk's would
        model = self.model
        if self.flavour == "zoo":
            if getattr(model.config, "loss_impl", "torch") != "torch":
                return None
            _check_integer(labels)
            self._follow_head()
            if positional:
                args = args[:self._labels_at] + (None,) + args[self._labels_at + 1:]
            else:
                kwargs = {k: v for k, v in kwargs.items() if k != "labels"}
            return _Call(labels, True), args, kwargs
        return_dict = kwargs.get("return_dict")
        if return_dict is None:
            return_dict = getattr(getattr(model, "config", None), "return_dict", True)
        if not return_dict:
            return None  # a tuple holding the whole logits is what was asked for
        if _is_hf(model) and model.loss_function is not _hf_causal_loss():
            return None  # the user's loss function: theirs to compute
        _check_integer(labels)
        self._follow_head()
        return _Call(labels, False), args, kwargs

    @torch.compiler.disable
    def _model_pre(self, module, args, kwargs):
        found = self._intercept(args, kwargs)
        self._stack().append(None if found is None else found[0])
        return None if found is None else found[1:]

    # -- the head's hooks: an empty input for the head; the loss (the package's model) or its
    # empty output followed (strata.torch._logit_trace).

    def _current(self):
        stack = self._stack()
        call = stack[-1] if stack else None
        if call is None or getattr(self._local, "materializing", False):
            return None
        return call

    @torch.compiler.disable
    def _head_pre(self, module, args, kwargs):
        call = self._current()
        if call is None:
            return None
        if call.hidden is not None:
            if not call.zoo:
                return None  # a second call: computed as the model asks
            raise RuntimeError("strata.torch: %s called its head twice in one forward pass "
                               "with labels; the chunked loss cannot tell which call is the "
                               "loss's: strata.torch._chunked_loss.uninstall(model) (or "
                               "handle.enabled = False) computes the model's own loss"
                               % type(self.model).__name__)
        hidden = args[0] if args else kwargs.get("input")
        if not torch.is_tensor(hidden) or hidden.dim() < 2:
            raise ValueError("strata.torch: the head of %s was called with %r, not hidden "
                             "states of shape (..., tokens, hidden)"
                             % (type(self.model).__name__, type(hidden).__name__))
        call.hidden = hidden
        if call.zoo:
            call.loss = self._zoo_loss(call, hidden)
        else:  # what the forward pass was: for the whole logits, when asked for
            call.modes = (torch.is_grad_enabled(), _autocast_state(hidden.device.type))
        empty = hidden[..., :0, :]
        if args:
            return (empty,) + tuple(args[1:]), kwargs
        return args, dict(kwargs, input=empty)

    @torch.compiler.disable
    def _head_post(self, module, args, output):
        call = self._current()
        if call is None or call.zoo or call.hidden is None or call.trace is not None:
            return None
        hidden = call.hidden
        if not torch.is_tensor(output):
            return None
        shape = tuple(hidden.shape[:-1]) + (output.shape[-1],)
        call.trace = _logit_trace.Trace(
            output, shape,
            functools.partial(self._logits, hidden, *call.modes, output.dtype),
            functools.partial(self._traced_loss, hidden), type(self.model).__name__)
        call.trace.start()
        return None

    def _traced_loss(self, hidden, transform, targets, ignore_index, reduction):
        return linear_cross_entropy(hidden, self.head.weight, self.head.bias, targets,
                                    ignore_index, None if reduction == "mean" else 1,
                                    self.chunk_tokens, transform)

    def _zoo_loss(self, call, hidden):
        # The package's model: logits[:, :-1] against labels[:, 1:]; the same as Hugging Face's
        # shift, the last position ignored, for (batch, tokens) labels.
        labels = call.labels
        if labels.dim() != 2 or labels.shape != hidden.shape[:2]:
            raise ValueError("strata.torch: labels of shape %s for hidden states of shape "
                             "%s; the model takes (batch, tokens) labels like its input"
                             % (tuple(labels.shape), tuple(hidden.shape)))
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        return linear_cross_entropy(hidden, self.head.weight, self.head.bias, targets,
                                    IGNORE_INDEX, None, self.chunk_tokens)

    # -- the model's forward hook: the loss into the output, the logits on demand.

    @torch.compiler.disable
    def _model_post(self, module, args, kwargs, output):
        stack = self._stack()
        if not stack:  # a pre-hook before ours failed: ours never ran
            return None
        call = stack.pop()
        if call is None:  # the model's own path
            return None
        if not call.zoo:
            trace = call.trace
            if trace is None:  # the head never ran with labels: nothing was changed
                return None
            trace.stop()
            return None if output is None else self._attach_traced(output, trace)
        if output is None:  # its forward failed
            return None
        if call.hidden is None:
            raise RuntimeError("strata.torch: the forward pass of %s did not call its head "
                               "(%s) with labels given, so the chunked loss has nothing to "
                               "compute from; strata.torch._chunked_loss.uninstall(model) "
                               "computes the model's own loss"
                               % (type(module).__name__, type(self.head).__name__))
        return self._attach(output, call)

    def _attach(self, output, call):
        placeholder = getattr(output, "logits", None)
        if not torch.is_tensor(placeholder) or not hasattr(output, "loss"):
            raise RuntimeError("strata.torch: %s returned %s, not an output with loss and "
                               "logits" % (type(self.model).__name__, type(output).__name__))
        hidden = call.hidden
        make = functools.partial(self._logits, hidden, torch.is_grad_enabled(),
                                 _autocast_state(hidden.device.type), placeholder.dtype)
        if isinstance(output, collections.OrderedDict):  # transformers' ModelOutput
            output["loss"] = call.loss
            output.move_to_end("loss", last=False)  # where the model puts it: first
        else:
            output.loss = call.loss
        return _lazy_logits(output, make)

    def _attach_traced(self, output, trace):
        """The model's output with its followed tensors whole: .logits on first access, any
        other at once (a tuple, another field)."""
        def whole(value):
            return value if trace.node_of(value) is None else trace.real(value)
        if isinstance(output, (tuple, list)):
            return type(output)(whole(v) for v in output) if \
                any(trace.node_of(v) is not None for v in output) else None
        fields = output.keys() if isinstance(output, collections.OrderedDict) else \
            [f for f in vars(output) if not f.startswith("_")] if hasattr(output, "__dict__") \
            else []
        placeholder = None
        for field in list(fields):
            value = getattr(output, field, None)
            if trace.node_of(value) is None:
                continue
            if field == "logits":
                placeholder = value
            else:
                setattr(output, field, whole(value))
        if placeholder is None:
            return None
        return _lazy_logits(output, functools.partial(trace.real, placeholder))

    def _logits(self, hidden, grad_enabled, autocast, dtype):
        """The logits of a forward pass with labels: its head over its hidden states, in the
        grad and autocast modes that forward pass had, in the dtype it returned."""
        self._local.materializing = True
        try:
            with torch.set_grad_enabled(grad_enabled), \
                    torch.autocast(hidden.device.type, dtype=autocast,
                                   enabled=autocast is not None):
                logits = self.head(hidden)
        finally:
            self._local.materializing = False
        return logits if logits.dtype == dtype else logits.to(dtype)


def _lazy_logits(output, make):
    output.__class__ = _lazy_class(type(output))
    output.__dict__["_strata_logits"] = make
    return output


# The output classes with .logits computed on first access: one subclass per output class, so
# that isinstance and the fields stay the model's; pickling and copying give the model's own
# class back, the logits computed.
_LAZY_CLASSES = {}
_LAZY_LOCK = threading.Lock()


def _materialize(output):
    make = output.__dict__.pop("_strata_logits", None)
    if make is not None:
        logits = make()
        if isinstance(output, collections.OrderedDict):
            collections.OrderedDict.__setitem__(output, "logits", logits)  # keeps its place
        output.__dict__["logits"] = logits


def _get_logits(self):
    _materialize(self)
    return self.__dict__.get("logits")


def _set_logits(self, value):
    # An explicit value replaces the pending one (transformers' __setattr__ has set the
    # mapping's entry already).
    self.__dict__.pop("_strata_logits", None)
    self.__dict__["logits"] = value


def _reading(name):
    def method(self, *args, **kwargs):
        _materialize(self)
        return getattr(super(type(self), self), name)(*args, **kwargs)
    method.__name__ = name
    return method


def _getitem(self, key):
    # Indexing by position, or the logits by name, reads them; another name does not
    # (transformers' own __getitem__ reads every item to find one).
    if not isinstance(key, str) or key == "logits":
        _materialize(self)
        return super(type(self), self).__getitem__(key)
    rename = getattr(self, "_replace_old_cache_name", None)  # its past_key_values -> cache
    return collections.OrderedDict.__getitem__(self, rename(key) if rename else key)


def _get(self, key, default=None):
    if key == "logits":
        _materialize(self)
    return super(type(self), self).get(key, default)


def _reduce_ex(self, protocol):
    _materialize(self)
    reduced = super(type(self), self).__reduce_ex__(protocol)
    if isinstance(reduced, str):
        return reduced
    base = type(self).__strata_base__

    def swap(x):
        return base if x is type(self) else x
    return (swap(reduced[0]), tuple(swap(a) for a in reduced[1])) + tuple(reduced[2:])


def _lazy_class(cls):
    with _LAZY_LOCK:
        lazy = _LAZY_CLASSES.get(cls)
        if lazy is None:
            namespace = {"logits": property(_get_logits, _set_logits),
                         "__strata_base__": cls, "__reduce_ex__": _reduce_ex,
                         "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                         "__doc__": cls.__doc__}
            if issubclass(cls, collections.OrderedDict):
                namespace.update(__getitem__=_getitem, get=_get, values=_reading("values"),
                                 items=_reading("items"), to_tuple=_reading("to_tuple"))
            lazy = _LAZY_CLASSES[cls] = type(cls.__name__, (cls,), namespace)
        return lazy


# ---------------------------------------------------------------------------------------------
# install / uninstall.

def install(model, chunk_tokens=None, auto=False):
    """Make `model` (a causal LM: see the module's docstring) compute its loss over chunks of
    chunk_tokens tokens (None: default_chunk_tokens of its vocabulary) whenever it is called
    with labels. auto: only a call with more labels than one chunk holds (where the whole
    logits would take more memory than a chunk's); a smaller one computes the model's own loss,
    its arithmetic exactly (strata.torch.offload's default). Returns the ChunkedLoss
    (model._strata_chunked_loss). Raises ValueError, changing nothing, for a model it cannot
    match (unsupported_reason says why), and RuntimeError where it is installed already."""
    if model.__dict__.get("_strata_chunked_loss") is not None:
        raise RuntimeError("strata.torch: the chunked loss is already installed on this model")
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError("strata.torch: the chunked loss cannot compute this model's loss: %s. "
                         "Its own loss (the whole logits) runs without install" % reason)
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(_head(model).out_features)
    handle = ChunkedLoss(model, check_chunk_tokens(chunk_tokens), auto)
    model.__dict__["_strata_chunked_loss"] = handle  # not a submodule: not in state_dict
    return handle


def installed(model):
    """The model's ChunkedLoss, or None."""
    return model.__dict__.get("_strata_chunked_loss")


def uninstall(model):
    """Back to the model's own loss. True if the chunked loss was installed."""
    handle = installed(model)
    if handle is None:
        return False
    handle.remove()
    return True
