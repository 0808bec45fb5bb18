"""StreamedGrad: the .grad of a streamed parameter. Its values live in Strata, in host memory or
with offload(grads="device") in the device's (the grad of the backward passes since it was last
zeroed, summed in fp32: in the optimizer's accumulator, or in place in the grad itself with
grad_dtype=torch.float32), so the tensor has the parameter's shape, dtype and device but no
storage. What PyTorch code does with grads works:

- norms (torch.linalg.vector_norm, Tensor.norm, torch._foreach_norm; the 2-norm comes from
  Strata's running sums of squares without moving data), hence
  torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm);
- scaling and zeroing in place (mul_, div_, zero_ and their _foreach_ forms), applied lazily in
  Strata (clip_grad_norm_, zero_grad(set_to_none=False)), and torch.amp.GradScaler's unscale_
  (the inf/NaN check comes from the sums of squares);
- elementwise changes in place (clamp_, clamp_min_, clamp_max_, nan_to_num_, add_, mul_ and
  div_ by a tensor, copy_, fill_, masked_fill_, any other pointwise in-place op, and their
  _foreach_ forms: torch.nn.utils.clip_grad_value_) on the values where the grads live: the
  grad is read, the op runs on the host in the parameter's dtype, and the result is written
  back (strata_optimizer_grad_write). Under data parallelism each rank changes its own chunk:
  an elementwise op commutes with sharding, and a tensor argument of the grad's shape gives
  each rank its slice;
- any other read (clone, allclose, indexing, arithmetic, printing) on a materialized fp32 copy
  converted to the parameter's dtype and device.

In-place changes that are not elementwise (cumsum_, t_, index_add_, ...) and writes through
out= raise, naming what is supported."""

import math

import torch
from torch.utils._pytree import tree_map

aten = torch.ops.aten

_NORMS = {aten.linalg_vector_norm.default}
_SCALE_INPLACE = {aten.mul_.Tensor, aten.mul_.Scalar, aten.div_.Tensor, aten.div_.Scalar}
_ZERO_INPLACE = {aten.zero_.default}
_FOREACH_NORM = {aten._foreach_norm.Scalar}
_FOREACH_SCALE = {aten._foreach_mul_.Scalar, aten._foreach_mul_.Tensor,
                  aten._foreach_mul_.ScalarList, aten._foreach_div_.Scalar,
                  aten._foreach_div_.Tensor, aten._foreach_div_.ScalarList}
_FOREACH_ZERO = {aten._foreach_zero_.default}
_PASSTHROUGH = {aten.detach.default, aten.alias.default}
_UNSCALE = {aten._amp_foreach_non_finite_check_and_unscale_.default}
# Elementwise in-place ops aten does not tag pointwise.
_ELEMENTWISE_INPLACE = {aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor,
                        aten.masked_fill_.Scalar, aten.masked_fill_.Tensor}
_SUPPORTED = ("streamed grads support elementwise in-place ops (clamp_, nan_to_num_, add_, mul_, "
              "div_, copy_, fill_ and their _foreach_ forms, as clip_grad_value_ uses them), "
              "zero_ and reading; their values live in Strata")


def _elementwise_inplace(func):
    """Whether `func` changes its first argument (a tensor, or a _foreach_ op's list) in place,
    element by element, so it can run on any part of the values (a rank's chunk)."""
    if func._schema.name.startswith("aten::_foreach_"):
        return func._schema.name.endswith("_") and _writes_first(func)
    return _is_inplace(func) and (torch.Tag.pointwise in func.tags
                                  or func in _ELEMENTWISE_INPLACE)


# torch.Tag.inplace is newer than some torch releases strata.torch supports (2.11 has none):
# without it an op is in place when it writes its first argument under an in-place name
# (aten::mul_; an out= variant writes its kwarg-only `out`, never the first argument).
_INPLACE_TAG = getattr(torch.Tag, "inplace", None)


def _is_inplace(func):
    if _INPLACE_TAG is not None:
        return _INPLACE_TAG in func.tags
    return func._schema.name.endswith("_") and _writes_first(func)


def _writes_first(func):
    arg = func._schema.arguments[0] if func._schema.arguments else None
    return arg is not None and arg.alias_info is not None and arg.alias_info.is_write


def _is_multi_element(x):
    return isinstance(x, torch.Tensor) and x.numel() != 1


def _factor(x, i=None):
    """The one number a streamed grad is scaled by lazily (`x`, or its i-th item for a _foreach_
    op's list): a Python number or a one-element tensor."""
    if isinstance(x, (list, tuple)):
        x = x[i]
    if isinstance(x, torch.Tensor):
        return float(x.reshape(-1)[0])
    return float(x)


def _elementwise(func, grad, args, kwargs, listed=False):
    """`func` (in place on `grad`, or on [grad] for a _foreach_ op: `listed`) as a function
    that, once called, reads the part of the grad's values this process holds, applies func to
    them on the host in the grad's dtype and writes them back. Checked here, before any grad
    changes: every tensor argument broadcasts to the grad's shape."""
    grad._optimizer()
    sp, layout = grad._sp, grad._session.layout

    def check(x):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            try:
                ok = torch.broadcast_shapes(tuple(x.shape), sp.shape) == tuple(sp.shape)
            except RuntimeError:
                ok = False
            if not ok:
                raise RuntimeError(
                    "strata.torch: %s: a tensor of shape %s does not broadcast to the shape %s "
                    "of the streamed grad it changes" % (func.__name__, list(x.shape),
                                                         list(sp.shape)))
        return x

    tree_map(check, (args, kwargs))

    def part(x):
        if isinstance(x, StreamedGrad):
            x = x.materialize()
        if not isinstance(x, torch.Tensor):
            return x
        x = x.detach().cpu()
        return layout.own_part(sp, x) if x.dim() > 0 else x

    def run():
        values = layout.own_grad(sp).to(grad.dtype)
        func([values] if listed else values, *tree_map(part, args), **tree_map(part, kwargs))
        layout.write_own_grad(sp, values)

    return run


def _foreach_elementwise(func, args, kwargs):
    """A _foreach_ op changing a list that holds streamed grads: the plain tensors in one call,
    each streamed grad as its own elementwise change; every streamed one checked first, so a
    refused call changes no grad."""
    tensors = list(args[0])
    n = len(tensors)

    def pick(x, indices):
        # A list argument of the call's length has one entry per tensor (TensorList, ScalarList).
        if isinstance(x, (list, tuple)) and len(x) == n:
            return [x[i] for i in indices]
        return x

    streamed = [i for i, t in enumerate(tensors) if isinstance(t, StreamedGrad)]
    plain = [i for i, t in enumerate(tensors) if not isinstance(t, StreamedGrad)]
    runs = [_elementwise(func, tensors[i], [pick(a, [i]) for a in args[1:]],
                         {k: pick(v, [i]) for k, v in kwargs.items()}, listed=True)
            for i in streamed]
    if plain:
        func([tensors[i] for i in plain], *[pick(a, plain) for a in args[1:]],
             **{k: pick(v, plain) for k, v in kwargs.items()})
    for run in runs:
        run()


def _writes_streamed_grad(func, args, kwargs):
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, StreamedGrad) for v in values):
            return True
    return False


def _norm_of(grad, sum_squares):
    return torch.tensor(sum_squares ** 0.5, dtype=grad.dtype, device=grad.device)


def _sums(grads):
    """The sums of squares of StreamedGrads, asked for together per session (under data
    parallelism that is one collective for all of them, not one per grad)."""
    by_session, sums = {}, {}
    for t in grads:
        t._optimizer()
        by_session.setdefault(id(t._session), []).append(t)
    for group in by_session.values():
        for t, s in zip(group, group[0]._session.grad_sums([t._sp for t in group])):
            sums[id(t)] = s
    return [sums[id(t)] for t in grads]


def _foreach_norm(tensors, ord_):
    streamed = [t for t in tensors if isinstance(t, StreamedGrad)] if float(ord_) == 2.0 else []
    sums = dict(zip(map(id, streamed), _sums(streamed)))
    return [_norm_of(t, sums[id(t)]) if id(t) in sums
            else t._norm(ord_) if isinstance(t, StreamedGrad)
            else torch.linalg.vector_norm(t, ord_) for t in tensors]


class StreamedGrad(torch.Tensor):
    @staticmethod
    def __new__(cls, session, sp, dtype, device):
        t = torch.Tensor._make_wrapper_subclass(cls, sp.shape, dtype=dtype, device=device,
                                                requires_grad=False)
        t._session, t._sp = session, sp
        return t

    def __init__(self, session, sp, dtype, device):
        super().__init__()

    @classmethod
    def of(cls, session, sp):
        return cls(session, sp, sp.param.dtype, sp.param.device)

    def __repr__(self, *, tensor_contents=None):
        return "StreamedGrad(%r)" % (self.materialize(),)

    # --- Strata's side -------------------------------------------------------------------

    def _optimizer(self):
        self._session.check_open()
        if id(self._sp.param) not in self._session.held:
            raise RuntimeError("strata.torch: this grad of %r was zeroed to None; it has no "
                               "values any more" % self._sp.name)
        return self._session.optimizer

    def materialize(self):
        """The grad's values as an ordinary tensor (a copy)."""
        self._optimizer()
        return self._session.read_grad(self._sp).to(device=self.device, dtype=self.dtype)

    def _norm(self, ord=2.0):
        if float(ord) != 2.0:
            return torch.linalg.vector_norm(self.materialize(), ord)
        self._optimizer()
        return _norm_of(self, self._session.grad_sums([self._sp])[0])

    def _scale(self, factor):
        self._optimizer().grad_scale(self._sp.weight, factor)

    def _zero(self):
        self._optimizer().grad_zero(self._sp.weight, keep_zeros=True)

    # --- dispatch --------------------------------------------------------------------------

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _PASSTHROUGH and isinstance(args[0], StreamedGrad):
            return args[0]
        if func in _NORMS and isinstance(args[0], StreamedGrad):
            ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2.0)
            dim = args[2] if len(args) > 2 else kwargs.get("dim", None)
            if dim is None and not kwargs.get("dtype"):
                return args[0]._norm(ord_)
        if (func in _SCALE_INPLACE and isinstance(args[0], StreamedGrad)
                and not _is_multi_element(args[1])):
            f = _factor(args[1])
            args[0]._scale(1.0 / f if func in (aten.div_.Tensor, aten.div_.Scalar) else f)
            return args[0]
        if func in _ZERO_INPLACE and isinstance(args[0], StreamedGrad):
            args[0]._zero()
            return args[0]
        if func in _FOREACH_NORM:
            ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2.0)
            return _foreach_norm(args[0], ord_)
        if func in _FOREACH_SCALE and not any(
                _is_multi_element(args[1][i] if isinstance(args[1], (list, tuple)) else args[1])
                for i, t in enumerate(args[0]) if isinstance(t, StreamedGrad)):
            divide = "div" in func.__name__
            factors = [_factor(args[1], i) if isinstance(t, StreamedGrad) else None
                       for i, t in enumerate(args[0])]
            for i, t in enumerate(args[0]):
                if isinstance(t, StreamedGrad):
                    t._scale(1.0 / factors[i] if divide else factors[i])
                    continue
                other = args[1][i] if isinstance(args[1], (list, tuple)) else args[1]
                if divide:
                    t.div_(other)
                else:
                    t.mul_(other)
            return None
        if func in _UNSCALE:
            # torch.amp.GradScaler.unscale_: grads *= inv_scale, found_inf = 1 if any is not
            # finite. Streamed grads: their sums of squares say whether all are finite.
            grads, found_inf, inv_scale = args[0], args[1], args[2]
            plain = [t for t in grads if not isinstance(t, StreamedGrad)]
            if plain:
                func(plain, found_inf, inv_scale)
            factor = float(inv_scale)
            streamed = [t for t in grads if isinstance(t, StreamedGrad)]
            for t, sum_squares in zip(streamed, _sums(streamed)):
                if not math.isfinite(sum_squares):
                    found_inf.fill_(1.0)
                t._scale(factor)
            return None
        if func in _FOREACH_ZERO:
            for t in args[0]:
                if isinstance(t, StreamedGrad):
                    t._zero()
                else:
                    t.zero_()
            return None
        if _elementwise_inplace(func):
            if func._schema.name.startswith("aten::_foreach_"):
                if any(isinstance(t, StreamedGrad) for t in args[0]):
                    _foreach_elementwise(func, args, kwargs)
                    return None
            elif isinstance(args[0], StreamedGrad):
                _elementwise(func, args[0], args[1:], kwargs)()
                return args[0]
        if _writes_streamed_grad(func, args, kwargs):
            if _writes_first(func):
                raise RuntimeError(
                    "strata.torch: %s changes the grad of a streamed parameter in place and is "
                    "not elementwise; %s" % (func.__name__, _SUPPORTED))
            raise RuntimeError(
                "strata.torch: %s writes the grad of a streamed parameter through out=; change "
                "it in place instead (grad.copy_(result)): %s" % (func.__name__, _SUPPORTED))

        def unwrap(x):
            return x.materialize() if isinstance(x, StreamedGrad) else x

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
