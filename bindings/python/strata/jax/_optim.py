"""strata.jax.AdamW: the streamed blocks' optimizer (Strata's CPU AdamW), its param groups and
its schedules; global-norm clipping and accumulation (optax's semantics)."""
import math
import numbers


def _lookup(value, step):
    """A float, or a callable of the number of updates done so far (an optax schedule)."""
    if callable(value):
        value = value(step)
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        return float(value)
    except (TypeError, ValueError):
        raise TypeError("strata.jax: a learning rate or weight decay must be a float or a "
                        "callable step -> float (such as an optax schedule); got %r" % (value,))


def _max_grad_norm(value):
    if value is None:
        return None
    try:
        if isinstance(value, (str, bytes, bool)):
            raise TypeError
        norm = float(value)
    except (TypeError, ValueError):
        raise TypeError("strata.jax.AdamW: max_grad_norm must be a number (the global norm to "
                        "clip to) or None (no clipping); got %r" % (value,)) from None
    if not math.isfinite(norm) or norm <= 0:
        raise ValueError("strata.jax.AdamW: max_grad_norm must be a finite number above 0 (the "
                         "global norm the grads are clipped to), or None for no clipping; got "
                         "%r" % (value,))
    return norm


def _accumulation(value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError("strata.jax.AdamW: accumulation must be an integer (micro-batches per "
                        "update); got %r" % (value,))
    if value < 1:
        raise ValueError("strata.jax.AdamW: accumulation must be at least 1 (micro-batches per "
                         "update; 1: every step updates); got %d" % value)
    return int(value)


class AdamW:
    """Strata's CPU AdamW for the streamed blocks: fp32 masters and m, v in DRAM, decoupled
    weight decay (optax.adamw's and torch's), each block updated as soon as its grads land.

    learning_rate, weight_decay: floats or callables of the step (the number of updates done
    before this one, as optax schedules take it). groups: param groups, a list of dicts
    {"params": filter, "learning_rate": ..., "weight_decay": ...}; filter is a callable of a
    block leaf's name ("attn_norm", "mlp.w_up": its path inside one block, dot-joined) or a
    collection of names; a leaf takes the first group whose filter matches, else the defaults.
    Missing keys take the defaults. threads: CPU threads (0: the runtime's choice).

    max_grad_norm: optax.clip_by_global_norm(max_grad_norm) before the update, over every
    trained leaf at once: the streamed blocks' grads (their norms measured by the runtime) and
    the residents' (the Trainer scales the grads its `optimizer` receives by the same factor);
    None: no clipping. accumulation: micro-batches per update, as optax.MultiSteps(...,
    every_k_schedule=accumulation): each step() adds one micro-batch's grads, the last of
    every `accumulation` updates the blocks and the residents with their mean (clipped after
    averaging, as MultiSteps wraps the chain); schedules count updates, not micro-batches."""

    def __init__(self, learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4,
                 groups=(), threads=0, max_grad_norm=None, accumulation=1):
        self.learning_rate, self.weight_decay = learning_rate, weight_decay
        self.b1, self.b2, self.eps, self.threads = b1, b2, eps, threads
        self.max_grad_norm = _max_grad_norm(max_grad_norm)
        self.accumulation = _accumulation(accumulation)
        self.groups = []
        for g in groups:
            unknown = set(g) - {"params", "learning_rate", "weight_decay"}
            if unknown or "params" not in g:
                raise ValueError("strata.jax.AdamW: a group is a dict with 'params' (a filter) "
                                 "and optionally 'learning_rate', 'weight_decay'; got keys %s"
                                 % sorted(g))
            self.groups.append(dict(g))

    @property
    def holds_grads(self):
        """Whether updates wait for the host (clipping or accumulation): the runtime then holds
        the blocks' grads (its explicit update mode) until the Trainer updates."""
        return self.max_grad_norm is not None or self.accumulation > 1

    def group_of(self, name):
        for i, g in enumerate(self.groups):
            f = g["params"]
            if (f(name) if callable(f) else name in f):
                return i + 1
        return 0

    def hyper(self, group, step):
        """(lr, weight_decay) of a group at `step`."""
        g = self.groups[group - 1] if group > 0 else {}
        return (_lookup(g.get("learning_rate", self.learning_rate), step),
                _lookup(g.get("weight_decay", self.weight_decay), step))
