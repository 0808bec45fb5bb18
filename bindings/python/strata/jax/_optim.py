"""strata.jax.AdamW: the streamed blocks' optimizer (Strata's CPU AdamW), its param groups and
its schedules."""


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


class AdamW:
    """Strata's CPU AdamW for the streamed blocks: fp32 masters and m, v in DRAM, decoupled
    weight decay (optax.adamw's and torch's), each block updated as soon as its grads land.

    learning_rate, weight_decay: floats or callables of the step (the number of updates done
    before this one, as optax schedules take it). groups: param groups, a list of dicts
    {"params": filter, "learning_rate": ..., "weight_decay": ...}; filter is a callable of a
    block leaf's name ("attn_norm", "mlp.w_up": its path inside one block, dot-joined) or a
    collection of names; a leaf takes the first group whose filter matches, else the defaults.
    Missing keys take the defaults. threads: CPU threads (0: the runtime's choice)."""

    def __init__(self, learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4,
                 groups=(), threads=0):
        self.learning_rate, self.weight_decay = learning_rate, weight_decay
        self.b1, self.b2, self.eps, self.threads = b1, b2, eps, threads
        self.groups = []
        for g in groups:
            unknown = set(g) - {"params", "learning_rate", "weight_decay"}
            if unknown or "params" not in g:
                raise ValueError("strata.jax.AdamW: a group is a dict with 'params' (a filter) "
                                 "and optionally 'learning_rate', 'weight_decay'; got keys %s"
                                 % sorted(g))
            self.groups.append(dict(g))

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
