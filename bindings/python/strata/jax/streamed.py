"""strata.jax.Trainer: train any JAX model whose repeated blocks stream through Strata.

The user gives the model as three pure functions and two pytrees:

    embed_fn(residents, batch) -> hidden | (hidden, extras)   # before the blocks
    block_fn(block_params, hidden, *extras) -> hidden          # one block, repeated
    loss_fn(residents, hidden, batch) -> scalar loss           # after the blocks

blocks: the blocks' parameters, stacked (one pytree whose leaves carry a leading layer axis,
as for jax.lax.scan) or listed (a list of pytrees of one structure); residents: any pytree of
arrays kept on the device and trained by any optax GradientTransformation. The blocks' leaves
live in Strata's DRAM (or NVMe) and are trained by Strata's CPU AdamW (strata.jax.AdamW: fp32
masters, param groups, learning rates as floats, callables or optax schedules), each block
updated as soon as its grads land. See docs/python-guide.md and docs/python-reference.md."""
import json
import os
import shutil
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from .. import core
from . import _ffi, _weights
from ..core import BACKWARD, FORWARD, VIEW_GRAD, VIEW_WEIGHT

# The dtypes Strata's optimizer trains (working copies and grads; masters are fp32).
_DTYPE_NAMES = {jnp.dtype(jnp.float32): "float32", jnp.dtype(jnp.bfloat16): "bfloat16",
                jnp.dtype(jnp.float16): "float16"}
_SUPPORTED = "float32, bfloat16 or float16"
_FORMAT = "strata.jax/1"
_FFI_WARNED = []  # the FFI ops' absence is reported once per process


def _path_name(path):
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts) or "param"


def _is_array(x):
    return isinstance(x, (np.ndarray, jax.Array)) or (
        hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "__array__"))


def _check_leaf(where, name, leaf, inexact=True):
    if not _is_array(leaf):
        raise TypeError("strata.jax: %s leaf %r is a %s, not an array: every leaf must be a "
                        "jax or numpy array (pass constants through embed_fn's extras or close "
                        "over them in the function)" % (where, name, type(leaf).__name__))
    if inexact and not jnp.issubdtype(leaf.dtype, jnp.inexact):
        raise TypeError("strata.jax: %s leaf %r has dtype %s: trainable leaves must be floating "
                        "point (pass integer or boolean constants through embed_fn's extras "
                        "or close over them)" % (where, name, leaf.dtype))


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


def _array(leaf):
    """A leaf as it is when a JAX array (it stays on its device), else as a numpy array."""
    return leaf if isinstance(leaf, jax.Array) else np.asarray(leaf)


class _StackedLayers:
    """Stacked leaves per layer: layer i's slices, taken when the layer is indexed (on the
    leaves' device for JAX arrays)."""

    def __init__(self, leaves, layers):
        self.leaves, self.layers = leaves, layers

    def __len__(self):
        return self.layers

    def __getitem__(self, i):
        return [leaf[i] for leaf in self.leaves]


class _ListedLayers:
    """Listed blocks' leaves per layer (numpy arrays, or JAX arrays where given), read from the
    blocks when a layer is indexed (a lazy sequence of blocks builds each block then, one at a
    time)."""

    def __init__(self, blocks):
        self.blocks = blocks

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return [_array(leaf) for leaf in jax.tree_util.tree_leaves(self.blocks[i])]

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def _normalize_embed(out):
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], (tuple, list)):
        return out[0], tuple(out[1])
    if isinstance(out, (tuple, list)):
        raise TypeError("strata.jax: embed_fn must return hidden or (hidden, extras) with extras "
                        "a tuple; got a %s of %d" % (type(out).__name__, len(out)))
    return out, ()


class Trainer:
    """Train a JAX model whose blocks stream through Strata (see the module's docstring).

    block_fn(block_params, hidden, *extras) -> hidden; blocks: stacked or listed block params
    (stacked=None decides: a list or tuple is listed, anything else stacked; with
    stacked=False any sequence is listed, and a lazy one that builds block i when indexed is
    read one block at a time, so host memory holds one block); residents: a
    pytree of arrays on the device; embed_fn(residents, batch) -> hidden or (hidden, extras);
    loss_fn(residents, hidden, batch) -> scalar. optimizer: an optax GradientTransformation for
    the residents (None: they stay frozen); block_optimizer: a strata.jax.AdamW. dtype: the
    compute dtype of the streamed weights (None: each leaf's own; float32, bfloat16 or float16;
    fp32 masters either way, initialized from fp32 values where given). backend: "cuda" or
    "host" (None: cuda when JAX's default device is a GPU). Budgets in bytes (None: from the
    model's size); nvme: paths for the NVMe tier.

    ffi: run each step as one XLA program whose begin and end of the executor's step and
    acquire and release of the blocks are XLA FFI custom calls (no host call inside a step;
    docs/python-reference.md). None (the default): when
    the FFI library can be built and loaded here and JAX's device matches the backend (a GPU
    with cuda, the CPU with host), else the host-synchronised loop (with a warning saying why);
    $STRATA_JAX_FFI=0 or 1 overrides None. True: required (raises if unavailable); False: the
    host-synchronised loop. scan: in the FFI program, loop over the blocks with jax.lax.scan
    (one compiled body; needs every block of one shape) rather than unrolled; None: scan when
    the blocks' shapes allow.

    Inside your own jax.jit: trainer.apply_blocks(hidden, *extras) is the streamed blocks as a
    differentiable JAX function (FFI path only), so your jitted step can embed, run the blocks,
    compute its loss and metrics and update the residents with your optax; embed_fn and
    loss_fn may then be None (step() needs them). Each differentiated call is one step of the
    blocks (their grads go to Strata's AdamW); see apply_blocks.

    Setup: block values may be numpy arrays or JAX arrays on any device; JAX arrays on the GPU
    are converted there and copied straight into Strata's pinned memory (build the model on the
    device for the fastest setup). A lazy sequence of listed blocks is indexed twice per block
    (shapes first, then values). setup_seconds says where the construction's time went, per
    phase."""

    def __init__(self, block_fn, blocks, residents=None, *, embed_fn=None, loss_fn=None,
                 optimizer=None, block_optimizer=None, stacked=None, dtype=None,
                 gpu_budget=None, host_budget=None, nvme=None, backend=None, slot_budget=0,
                 ffi=None, scan=None):
        self.setup_seconds = {}
        started = time.perf_counter()
        if (embed_fn is None) != (loss_fn is None):
            raise TypeError("strata.jax: give both embed_fn and loss_fn (for step()), or neither "
                            "(your own jitted step calls trainer.apply_blocks)")
        self.block_fn, self.embed_fn, self.loss_fn = block_fn, embed_fn, loss_fn
        self.block_optimizer = block_optimizer if block_optimizer is not None else AdamW()
        if not isinstance(self.block_optimizer, AdamW):
            raise TypeError("strata.jax: block_optimizer must be a strata.jax.AdamW (Strata's "
                            "CPU optimizer updates the streamed blocks); use `optimizer` for an "
                            "optax transformation of the resident parameters")
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        if self.dtype is not None and self.dtype not in _DTYPE_NAMES:
            raise TypeError("strata.jax: dtype %s is not supported: streamed weights are %s"
                            % (self.dtype, _SUPPORTED))
        self.device = jax.devices()[0]
        if backend is None:
            backend = "cuda" if self.device.platform == "gpu" else "host"
        self.stacked = not isinstance(blocks, (list, tuple)) if stacked is None else stacked
        ffi = self._ffi_choice(ffi, backend)
        if ffi is not False:
            _ffi.start_build()  # compiled (first use) while the blocks are read, runtime made
        per_layer = self._split_blocks(blocks)  # per layer, its leaves (numpy or JAX arrays)
        self.layers = len(per_layer)
        started = self._timed("check", started)
        itemsize = max(d.itemsize for d in self.leaf_dtypes)
        hbm, dram = core.streaming_budgets([sum(int(np.prod(s)) for s in shapes)
                                            for shapes in self.shapes], itemsize)
        self.scan = scan if scan is not None else all(s == self.shapes[0] for s in self.shapes)
        if self.scan and any(s != self.shapes[0] for s in self.shapes):
            raise ValueError("strata.jax: scan=True needs every block of one shape")
        dram = dram if host_budget is None else host_budget
        # Only what the GPU's copies touch of the arena is pinned (core.pinned_dram): each
        # leaf's weight and grad, not the optimizer's state.
        pinned = core.pinned_dram([[int(np.prod(s)) for s in shapes] for shapes in self.shapes],
                                  itemsize, dram)
        self.runtime = core.Runtime(backend=backend,
                                    hbm_budget=hbm if gpu_budget is None else gpu_budget,
                                    dram_budget=dram, nvme=nvme, dram_pinned=pinned)
        started = self._timed("runtime", started)
        try:
            self._ffi = self._open_ffi(ffi)  # waits for the library's compile, if still running
        except BaseException:
            self.runtime.close()
            raise
        self._steps = 0  # the host loop's count (the FFI path counts in its session)
        self._timed("ffi", started)
        try:
            self._register(per_layer, slot_budget)
            del per_layer
            started = time.perf_counter()
            self._init_residents(residents, optimizer)
            started = self._timed("residents", started)
            if self._ffi is not None:
                self._ffi.set_hook(self._set_hyperparameters)
            self._compile()
            self._timed("compile", started)
        except BaseException:
            if self._ffi is not None:
                self._ffi.close()
            self.runtime.close()
            raise

    def _timed(self, phase, started):
        now = time.perf_counter()
        self.setup_seconds[phase] = self.setup_seconds.get(phase, 0.0) + now - started
        return now

    @property
    def step_count(self):
        """Training steps done (a step that raised is not counted)."""
        return self._ffi.state()[0] if self._ffi is not None else self._steps

    @step_count.setter
    def step_count(self, value):
        if self._ffi is not None:
            self._ffi.set_steps(value)
        self._steps = int(value)

    def _set_hyperparameters(self, step):
        """Each group's learning rate and weight decay for the step about to begin (the
        optimizer reads them at the executor's step begin)."""
        for group in range(len(self.block_optimizer.groups) + 1):
            self.optimizer.set_group(group, *self.block_optimizer.hyper(group, step))

    def apply_blocks(self, hidden, *extras):
        """The streamed blocks applied to `hidden` (block_fn(block_i, x, *extras) for each
        block in order), as a JAX function for use inside your own jax.jit (FFI path only).

        Differentiated (jax.grad, value_and_grad, vjp of something that depends on `hidden`
        or on an inexact extra), one call is one training step of the blocks: its forward pass
        begins the executor's step and streams the blocks in, its backward pass streams them
        again, hands their grads to Strata's AdamW (which updates each block as its grads land,
        with this step's learning rate) and ends the step; grads flow back to `hidden` and to
        the inexact extras as for any JAX function. Not differentiated, it is a forward-only
        step (evaluation: nothing is updated). Call it once per step (per jitted call); the
        block params are not arguments (Strata owns them: get_params reads them). A program
        that fails mid-step leaves the step to be abandoned by the next one (its released
        grads were applied; it is not counted), as step() does."""
        if self._ffi is None:
            raise RuntimeError("strata.jax: apply_blocks needs the XLA FFI ops (this trainer "
                               "runs the host-synchronised loop: ffi=False, or the library is "
                               "unavailable); use step()")
        if self.runtime._handle is None:
            raise ValueError("strata.jax: the trainer is closed")
        return self._apply_blocks(hidden, *extras)

    def _settle(self):
        """Before host work on the blocks' state: wait for running programs (the outputs JAX
        holds), abandon a step a failed program left open, wait for running updates."""
        if self._ffi is None:
            return
        if self._ffi.state()[2]:
            for a in jax.live_arrays():
                try:
                    a.block_until_ready()
                except Exception:  # noqa: BLE001: a failed program's outputs
                    pass
            if self._ffi.abandon():
                warnings.warn("strata.jax: a step that failed after it began was abandoned: "
                              "blocks whose grads it had released were updated; it is not "
                              "counted", RuntimeWarning, stacklevel=3)

    # -- construction --------------------------------------------------------------------
    def _ffi_choice(self, ffi, backend):
        """ffi resolved: False (the host loop), True (required) or None (if available)."""
        if ffi is None:
            env = os.environ.get("STRATA_JAX_FFI", "")
            if env in ("0", "1"):
                ffi = env == "1"
        if ffi is False:
            return False
        platform = self.device.platform
        if (backend == "cuda") != (platform == "gpu") or platform not in ("gpu", "cpu"):
            why = ("the FFI ops need JAX's device and Strata's backend to match (a GPU with "
                   "backend cuda, the CPU with backend host); here %s with %s"
                   % (platform, backend))
            if ffi:
                raise ValueError("strata.jax: ffi=True: " + why)
            return False
        return ffi

    def _open_ffi(self, ffi):
        """The FFI session for this trainer (ffi: _ffi_choice's), or None for the
        host-synchronised loop."""
        if ffi is False:
            return None
        try:
            return _ffi.Session()
        except _ffi.FfiUnavailable as e:
            if ffi:
                raise
            if not _FFI_WARNED:
                _FFI_WARNED.append(True)
                warnings.warn("strata.jax: the XLA FFI ops are unavailable, so each layer is "
                              "synchronised with the host (slower); why: %s" % e, RuntimeWarning,
                              stacklevel=3)
            return None

    @property
    def uses_ffi(self):
        """Whether steps run as one XLA program with the FFI acquire/release ops."""
        return self._ffi is not None

    def _split_blocks(self, blocks):
        """Validate the blocks and return, per layer, its list of numpy leaves (indexable and
        iterable; listed blocks are read when a layer is, so a lazy sequence that builds block
        i when indexed keeps one block in host memory); sets the block treedef, leaf names,
        shapes and dtypes."""
        if self.stacked:
            flat, self.treedef = jax.tree_util.tree_flatten_with_path(blocks)
            if not flat:
                raise ValueError("strata.jax: the stacked block params have no arrays")
            names = [_path_name(p) for p, _ in flat]
            for name, (_, leaf) in zip(names, flat):
                _check_leaf("block", name, leaf)
                if leaf.ndim < 1:
                    raise ValueError("strata.jax: stacked block leaf %r is a scalar: stacked "
                                     "leaves carry the layer axis first (or pass a list of "
                                     "blocks)" % name)
            counts = {leaf.shape[0] for _, leaf in flat}
            if len(counts) != 1:
                raise ValueError("strata.jax: stacked block leaves disagree on the layer count "
                                 "(leading axis): %s" % {n: l.shape[0] for n, (_, l) in
                                                         zip(names, flat)})
            leaves = [_array(leaf) for _, leaf in flat]
            per_layer = _StackedLayers(leaves, counts.pop())
            metas = [[(a.shape[1:], a.dtype) for a in leaves]] * len(per_layer)
        else:
            if len(blocks) == 0:
                raise ValueError("strata.jax: no blocks")
            flat0, self.treedef = jax.tree_util.tree_flatten_with_path(blocks[0])
            if not flat0:
                raise ValueError("strata.jax: block 0 has no arrays")
            names = [_path_name(p) for p, _ in flat0]
            del flat0
            metas = []
            for i in range(len(blocks)):
                block = blocks[i]
                flat, treedef = jax.tree_util.tree_flatten_with_path(block)
                these = [_path_name(p) for p, _ in flat]
                if treedef != self.treedef:
                    extra = sorted(set(these) - set(names))
                    missing = sorted(set(names) - set(these))
                    raise ValueError(
                        "strata.jax: block %d's structure differs from block 0's (every block "
                        "must hold the same leaves): %s%s" % (
                            i, ("extra leaves %s " % extra) if extra else "",
                            ("missing leaves %s" % missing) if missing else
                            "(%s vs %s)" % (treedef, self.treedef)))
                for name, (_, leaf) in zip(these, flat):
                    _check_leaf("block %d" % i, name, leaf)
                metas.append([(tuple(leaf.shape), leaf.dtype) for _, leaf in flat])
                del block, flat
            per_layer = _ListedLayers(blocks)
        if len(set(names)) != len(names):
            raise ValueError("strata.jax: block leaf names collide: %s" % names)
        self.names = names
        def compute(dtype):
            return self.dtype if self.dtype is not None else jnp.dtype(dtype)

        for name, (_, dtype) in zip(names, metas[0]):
            d = compute(dtype)
            if d not in _DTYPE_NAMES:
                raise TypeError("strata.jax: block leaf %r has dtype %s: streamed weights are %s "
                                "(cast them, or pass dtype=)" % (name, d, _SUPPORTED))
        self.shapes = [[tuple(shape) for shape, _ in leaves] for leaves in metas]
        self.leaf_dtypes = [compute(dtype) for _, dtype in metas[0]]
        for i, leaves in enumerate(metas):
            for name, (_, dtype), d in zip(names, leaves, self.leaf_dtypes):
                if compute(dtype) != d:
                    raise TypeError("strata.jax: block %d leaf %r is %s, block 0's is %s"
                                    % (i, name, dtype, d))
        return per_layer

    def _register(self, per_layer, slot_budget):
        opt = self.block_optimizer
        self.optimizer = core.Optimizer(self.runtime, "adamw", lr=_lookup(opt.learning_rate, 0),
                                        weight_decay=_lookup(opt.weight_decay, 0), beta1=opt.b1,
                                        beta2=opt.b2, eps=opt.eps, threads=opt.threads)
        self.leaf_groups = [opt.group_of(n) for n in self.names]
        self.weights, self.grads = [], []
        t = time.perf_counter()
        with self._writer() as writer:
            for i in range(self.layers):
                leaves = per_layer[i]
                t = self._timed("read", t)  # a lazy sequence builds the block here
                ws, gs = [], []
                for name, shape, d in zip(self.names, self.shapes[i], self.leaf_dtypes):
                    full = "layers.%d.%s" % (i, name)
                    ws.append(self.runtime.register(full, shape, _DTYPE_NAMES[d], "weight"))
                    gs.append(self.runtime.register(full + ".grad", shape, _DTYPE_NAMES[d],
                                                    "grad"))
                self.weights.append(ws)
                self.grads.append(gs)
                t = self._timed("register", t)
                self._write_layer(writer, i, leaves, new=True)
                t = time.perf_counter()
        self._slot_budget = slot_budget
        self.executor = None
        self._new_executor()
        self._timed("executor", t)

    def _writer(self):
        return _weights.Writer(self.device,
                               _ffi.copy_to_host if self._ffi is not None else None)

    def _write_layer(self, writer, i, leaves, new=False):
        """Layer i's values into its weights (converted to the compute dtype where they are: on
        the device for JAX arrays there) and, trained in a narrower dtype, into its fp32 masters
        (from fp32 values; else widened from the weights). new: add the params to the
        optimizer between the two (its state is made there, the master widened from the
        weight)."""
        t = time.perf_counter()
        staged = [writer.stage(v, d) for v, d in zip(leaves, self.leaf_dtypes)]
        for w, value, d in zip(self.weights[i], staged, self.leaf_dtypes):
            writer.write(w, value, d)
        t = self._timed("weights", t) if new else t
        for w, g, value, d, group in zip(self.weights[i], self.grads[i], leaves,
                                         self.leaf_dtypes, self.leaf_groups):
            if new:
                self.optimizer.add_param(w, g, group=group)
            # A new param's master is its weight widened (add_param): fp32 values replace it,
            # so it starts from them, not their rounded copy; set_params writes it from any.
            if d != jnp.float32 and (value.dtype == np.float32 or not new):
                writer.write(self.optimizer.state(w, "master"), value, np.float32)
        if new:
            self._timed("optimizer_state", t)

    def _new_executor(self):
        if self.executor is not None:
            old, self.executor = self.executor, None
            old.close()  # waits for its transfers; detaches the optimizer
            if old in self.runtime._owned:
                self.runtime._owned.remove(old)
        ex = core.Executor(self.runtime, [{"name": "layers.%d" % i, "weights": ws, "grads": gs}
                                          for i, (ws, gs) in enumerate(zip(self.weights,
                                                                           self.grads))],
                           slot_budget=self._slot_budget)
        self.optimizer.attach(ex)
        self.executor = ex
        if self._ffi is not None:
            self._ffi.bind(ex, [[int(np.prod(shape)) * d.itemsize for shape, d in
                                 zip(shapes, self.leaf_dtypes)] for shapes in self.shapes])

    def _init_residents(self, residents, optimizer):
        residents = {} if residents is None else residents
        for path, leaf in jax.tree_util.tree_flatten_with_path(residents)[0]:
            _check_leaf("resident", _path_name(path), leaf, inexact=optimizer is not None)
        self.residents = jax.device_put(residents, self.device)
        self.resident_optimizer = optimizer
        # Committed to the device like the residents (and like what the step returns), so the
        # second step reuses the first one's compiled program instead of compiling again.
        self.opt_state = jax.device_put(optimizer.init(self.residents), self.device) \
            if optimizer is not None else None

    def _compile(self):
        block_fn, embed_fn, loss_fn = self.block_fn, self.embed_fn, self.loss_fn
        treedef = self.treedef

        def merge(diff, const, mask):
            it_d, it_c = iter(diff), iter(const)
            return [next(it_d) if m else next(it_c) for m in mask]

        def call_block(leaves, x, diff, const, mask, extras_def):
            extras = jax.tree_util.tree_unflatten(extras_def, merge(diff, const, mask))
            return block_fn(jax.tree_util.tree_unflatten(treedef, leaves), x, *extras)

        self._forward = jax.jit(call_block, static_argnums=(4, 5))

        def backward(leaves, x, diff, const, g, acc, mask, extras_def):
            _, vjp = jax.vjp(lambda l, x_, d: call_block(l, x_, d, const, mask, extras_def),
                             leaves, x, diff)
            g_l, g_x, g_d = vjp(g)
            return g_l, g_x, [a + b for a, b in zip(acc, g_d)]

        self._backward = jax.jit(backward, static_argnums=(6, 7))

        def embed(r, batch):
            hidden, extras = _normalize_embed(embed_fn(r, batch))
            return hidden, extras

        if embed_fn is not None:
            self._embed = jax.jit(embed)
            self._head = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))
            self._loss = jax.jit(loss_fn)
        opt = self.resident_optimizer

        def finish(r, opt_state, batch, g_head, g_x, g_diff, mask):
            # The embedding's backward (recomputed), the residents' grads, their optax update.
            def f(r_):
                hidden, extras = embed(r_, batch)
                leaves = jax.tree_util.tree_leaves(extras)
                return hidden, [e for e, m in zip(leaves, mask) if m]

            _, vjp = jax.vjp(f, r)
            (g_embed,) = vjp((g_x, list(g_diff)))
            grads = jax.tree_util.tree_map(jnp.add, g_head, g_embed)
            if opt is None:
                return r, opt_state
            updates, opt_state = opt.update(grads, opt_state, r)
            r = jax.tree_util.tree_map(
                lambda p, u: jnp.asarray(p + u).astype(jnp.asarray(p).dtype), r, updates)
            return r, opt_state

        self._finish = jax.jit(finish, static_argnums=(6,))
        self._probe = jax.jit(lambda: jnp.zeros((), jnp.int32))
        if self._ffi is not None:
            self._apply_blocks = self._ffi_apply(call_block, backward)
            if embed_fn is not None:
                self._program = jax.jit(self._ffi_program(embed, opt))

    def _ffi_apply(self, call_block, backward):
        """The streamed blocks as a differentiable JAX function f(x, diff, const) -> x for one
        (mask, extras_def): a jax.custom_vjp whose forward begins the executor's step (begin op)
        and runs the blocks (acquire op, block), and whose backward runs them in reverse
        (acquire op, recomputed vjp, release op with the grads) and ends the step (end op).
        Called without differentiation: a forward-only step, abandoned at its end."""
        session, layers, scan = self._ffi, self.layers, self.scan

        def shapes(layer):
            return [jax.ShapeDtypeStruct(s, d) for s, d in zip(self.shapes[layer],
                                                               self.leaf_dtypes)]

        def build(mask, extras_def):
            def forward(x, diff, const, mode):
                token = session.begin(jnp.zeros((), jnp.uint32), mode)
                # Each acquire takes the hidden state (its grad in the backward pass) as an
                # operand: XLA cannot issue it before the previous block, so at most one
                # block's weights (and the slots Strata prefetches into) are in HBM at a time.
                if scan:
                    def body(carry, _):
                        x_, tok = carry
                        tok, w = session.acquire(tok, x_, FORWARD, shapes(0))
                        return (call_block(w, x_, diff, const, mask, extras_def), tok), x_

                    (x, token), inputs = jax.lax.scan(body, (x, token), None, length=layers)
                else:
                    inputs = []
                    for layer in range(layers):
                        token, w = session.acquire(token, x, FORWARD, shapes(layer), layer)
                        inputs.append(x)
                        x = call_block(w, x, diff, const, mask, extras_def)
                return x, inputs, token

            @jax.custom_vjp
            def apply(x, diff, const):
                x, _, token = forward(x, diff, const, _ffi.EVAL)
                session.end(token, _ffi.EVAL)
                return x

            def apply_fwd(x, diff, const):
                x, inputs, token = forward(x, diff, const, _ffi.TRAIN)
                return x, (inputs, diff, const, token)

            def apply_bwd(res, g_x):
                inputs, diff, const, token = res
                acc = [jnp.zeros_like(d) for d in diff]
                if scan:
                    def body(carry, x_in):
                        g, acc_, tok = carry
                        tok, w = session.acquire(tok, g, BACKWARD, shapes(0))
                        g_w, g, acc_ = backward(w, x_in, diff, const, g, acc_, mask, extras_def)
                        return (g, acc_, session.release(tok, g_w)), None

                    (g_x, acc, token), _ = jax.lax.scan(body, (g_x, acc, token), inputs,
                                                        reverse=True)
                else:
                    for layer in reversed(range(layers)):
                        token, w = session.acquire(token, g_x, BACKWARD, shapes(layer), layer)
                        g_w, g_x, acc = backward(w, inputs[layer], diff, const, g_x, acc, mask,
                                                 extras_def)
                        token = session.release(token, g_w)
                session.end(token, _ffi.TRAIN)
                return g_x, list(acc), [None] * len(const)

            apply.defvjp(apply_fwd, apply_bwd)
            return apply

        cache = {}

        def apply_blocks(hidden, *extras):
            leaves, extras_def = jax.tree_util.tree_flatten(tuple(extras))
            mask = tuple(bool(jnp.issubdtype(jnp.asarray(e).dtype, jnp.inexact))
                         for e in leaves)
            diff = [e for e, m in zip(leaves, mask) if m]
            const = [e for e, m in zip(leaves, mask) if not m]
            key = (mask, extras_def)
            if key not in cache:
                cache[key] = build(mask, extras_def)
            return cache[key](hidden, diff, const)

        return apply_blocks

    def _ffi_program(self, embed, opt):
        """Trainer.step as one function for jax.jit: embed, the streamed blocks
        (apply_blocks: the executor's whole step as ops), the head's loss; the grads of the
        head, the blocks' input and the extras, the embedding's vjp, the residents' optax
        update. The blocks are differentiated through their input, so they train even with
        frozen residents."""
        apply_blocks, loss_fn = self.apply_blocks, self.loss_fn

        def program(r, opt_state, batch):
            def split(r_):
                hidden, extras = embed(r_, batch)
                leaves, extras_def = jax.tree_util.tree_flatten(extras)
                mask = [bool(jnp.issubdtype(jnp.asarray(e).dtype, jnp.inexact))
                        for e in leaves]
                return (hidden, [e for e, m in zip(leaves, mask) if m]), (leaves, extras_def,
                                                                          mask)

            (hidden, diff), embed_vjp, (leaves, extras_def, mask) = jax.vjp(split, r,
                                                                            has_aux=True)

            def head(r_, x, d):
                it = iter(d)
                merged = [next(it) if m else e for e, m in zip(leaves, mask)]
                extras = jax.tree_util.tree_unflatten(extras_def, merged)
                return loss_fn(r_, apply_blocks(x, *extras), batch)

            loss, (g_head, g_x, g_diff) = jax.value_and_grad(head, argnums=(0, 1, 2))(
                r, hidden, diff)
            (g_embed,) = embed_vjp((g_x, g_diff))
            if opt is None:
                return loss, r, opt_state
            grads = jax.tree_util.tree_map(jnp.add, g_head, g_embed)
            updates, opt_state = opt.update(grads, opt_state, r)
            r = jax.tree_util.tree_map(
                lambda p, u: jnp.asarray(p + u).astype(jnp.asarray(p).dtype), r, updates)
            return loss, r, opt_state

        return program

    # -- the step ------------------------------------------------------------------------
    def _bind(self, layer, phase):
        return [jax.dlpack.from_dlpack(self.executor.view(layer, phase, VIEW_WEIGHT, k))
                for k in range(len(self.names))]

    def _prepare(self, batch, what):
        for leaf in jax.tree_util.tree_leaves(batch):
            if isinstance(leaf, jax.core.Tracer):
                raise TypeError(self._in_trace_message(what))
        hidden, extras = self._embed(self.residents, batch)
        if any(isinstance(a, jax.core.Tracer) for a in jax.tree_util.tree_leaves(hidden)):
            raise TypeError(self._in_trace_message(what))
        leaves, extras_def = jax.tree_util.tree_flatten(extras)
        mask = tuple(bool(jnp.issubdtype(jnp.asarray(e).dtype, jnp.inexact)) for e in leaves)
        diff = [e for e, m in zip(leaves, mask) if m]
        const = [e for e, m in zip(leaves, mask) if not m]
        return hidden, diff, const, mask, extras_def

    @staticmethod
    def _in_trace_message(what):
        return ("strata.jax.Trainer.%s cannot run inside jax.jit, grad or vmap: it drives "
                "Strata's executor from the host between XLA programs (each block's program "
                "is jitted already). Call it outside any transformation." % what)

    def _check_not_traced(self, batch, what):
        if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(batch)) \
                or isinstance(self._probe(), jax.core.Tracer):
            raise TypeError(self._in_trace_message(what))

    def step(self, batch):
        """One training step on `batch` (any pytree: it is passed to embed_fn and loss_fn).
        Returns the loss (a float). A step that raises leaves the trainer usable: before any
        block's grads were released, nothing was updated; after (an interrupt mid-backward),
        the blocks whose grads were released were updated and the step is not counted."""
        if self.runtime._handle is None:
            raise ValueError("strata.jax: the trainer is closed")
        if self.embed_fn is None:
            raise TypeError("strata.jax: step() needs embed_fn and loss_fn (this trainer was made "
                            "without them: call trainer.apply_blocks in your own jitted step)")
        if self._ffi is not None:
            return self._step_ffi(batch)
        hidden, diff, const, mask, extras_def = self._prepare(batch, "step")
        self._set_hyperparameters(self.step_count)
        ex = self.executor
        released = 0
        live = None
        ex.step_begin()
        try:
            inputs, x = [], hidden
            for layer in range(self.layers):
                # JAX's streams are not visible to Strata: wait here for the layer's data, and
                # let JAX finish with the slot before releasing it.
                ex.acquire(layer, FORWARD, host_wait=True)
                p = self._bind(layer, FORWARD)
                inputs.append(x)
                x = live = self._forward(p, x, diff, const, mask, extras_def)
                jax.block_until_ready(x)
                del p
                ex.release(layer, FORWARD)
            loss, (g_head, g_x) = self._head(self.residents, x, batch)
            acc = [jnp.zeros_like(d) for d in diff]
            for layer in reversed(range(self.layers)):
                ex.acquire(layer, BACKWARD, host_wait=True)
                p = self._bind(layer, BACKWARD)
                g_p, g_x, acc = live = self._backward(p, inputs[layer], diff, const, g_x, acc,
                                                      mask, extras_def)
                jax.block_until_ready(live)
                for k, g in enumerate(g_p):
                    ex.write_view(layer, BACKWARD, VIEW_GRAD, k, g.unsafe_buffer_pointer(),
                                  g.nbytes)
                del p, g_p
                live = None
                ex.release(layer, BACKWARD)
                released += 1
                inputs[layer] = None
            ex.step_end()
        except BaseException:
            self._abort(live, released)
            raise
        self.residents, self.opt_state = self._finish(self.residents, self.opt_state, batch,
                                                      g_head, g_x, acc, mask)
        self._steps += 1
        return float(loss)

    def _step_ffi(self, batch):
        """The step as one XLA program whose begin, acquire, release and end ops drive the
        executor (see _ffi_program); the host waits once, for the loss."""
        self._check_not_traced(batch, "step")
        self._settle()
        out = None
        try:
            out = self._program(self.residents, self.opt_state, batch)
            jax.block_until_ready(out)
        except BaseException:
            # Traced but failed while running: some blocks may have released their grads.
            self._abort(out, 1 if out is not None else 0, exact=False)
            raise
        loss, self.residents, self.opt_state = out
        return float(loss)

    def _abort(self, live, released, exact=True):
        """A step raised: let JAX finish with the slots, then replace the executor (whose step
        cannot be completed without feeding the optimizer zero grads)."""
        try:
            if live is not None:
                jax.block_until_ready(live)
        except Exception:
            pass
        self._new_executor()
        if released:
            warnings.warn("strata.jax: the step failed after %s block(s) released their grads: "
                          "those blocks were updated with this step's grads; the step is not "
                          "counted" % (released if exact else "some"), RuntimeWarning,
                          stacklevel=3)

    # -- evaluation and parameters -------------------------------------------------------
    def _read_layer(self, layer, masters=False):
        out = []
        for w, shape, d in zip(self.weights[layer], self.shapes[layer], self.leaf_dtypes):
            t = self.optimizer.state(w, "master") if masters else w
            host = np.empty(shape, np.float32 if masters else d)
            t.read_pointer(host.ctypes.data, host.nbytes)
            out.append(host)
        return out

    def evaluate(self, batch):
        """The loss on `batch` without grads or updates: each block's weights are read from
        DRAM (after running updates finish), not streamed by the executor."""
        hidden, diff, const, mask, extras_def = self._prepare(batch, "evaluate")
        self._settle()
        self.optimizer.synchronize()
        x = hidden
        for layer in range(self.layers):
            p = [jax.device_put(a, self.device) for a in self._read_layer(layer)]
            x = self._forward(p, x, diff, const, mask, extras_def)
        return float(self._loss(self.residents, x, batch))

    def get_params(self, masters=False):
        """(blocks, residents): the blocks as numpy arrays in the form they were given (stacked
        or listed), in the compute dtype (masters=True: the fp32 masters), and the residents."""
        self._settle()
        self.optimizer.synchronize()
        layers = [self._read_layer(i, masters) for i in range(self.layers)]
        if self.stacked:
            blocks = jax.tree_util.tree_unflatten(
                self.treedef, [np.stack([layers[i][k] for i in range(self.layers)])
                               for k in range(len(self.names))])
        else:
            blocks = [jax.tree_util.tree_unflatten(self.treedef, leaves) for leaves in layers]
        return blocks, self.residents

    def set_params(self, blocks=None, residents=None):
        """Replace the blocks' weights (and fp32 masters) and/or the residents, keeping the
        optimizer state. Same form, structure, shapes as given at construction."""
        if blocks is not None:
            per_layer = self._split_blocks_like(blocks)
            self._settle()
            self.optimizer.synchronize()
            with self._writer() as writer:
                for i in range(self.layers):
                    self._write_layer(writer, i, per_layer[i])
        if residents is not None:
            new, old = jax.tree_util.tree_structure(residents), \
                jax.tree_util.tree_structure(self.residents)
            if new != old:
                raise ValueError("strata.jax.set_params: the residents' structure differs: "
                                 "%s vs %s" % (new, old))
            for a, b in zip(jax.tree_util.tree_leaves(residents),
                            jax.tree_util.tree_leaves(self.residents)):
                if tuple(a.shape) != tuple(b.shape):
                    raise ValueError("strata.jax.set_params: a resident's shape %s differs from "
                                     "%s" % (a.shape, b.shape))
            self.residents = jax.device_put(
                jax.tree_util.tree_map(lambda a, b: jnp.asarray(a, b.dtype), residents,
                                       self.residents), self.device)

    def _split_blocks_like(self, blocks):
        stacked = not isinstance(blocks, (list, tuple))
        if stacked != self.stacked:
            raise ValueError("strata.jax.set_params: give the blocks %s, as at construction"
                             % ("stacked" if self.stacked else "as a list"))
        saved = (self.treedef, self.names, self.shapes, self.leaf_dtypes)
        try:
            per_layer = self._split_blocks(blocks)
            if (self.treedef, self.names, self.shapes) != saved[:3]:
                raise ValueError("strata.jax.set_params: the blocks' structure or shapes differ "
                                 "from the trainer's")
        finally:
            self.treedef, self.names, self.shapes, self.leaf_dtypes = saved
        return per_layer

    # -- checkpoints ---------------------------------------------------------------------
    def _jax_leaves(self):
        return jax.tree_util.tree_leaves((self.residents, self.opt_state))

    def save(self, path):
        """Save the whole training state to the directory `path`: the blocks' weights, fp32
        masters and AdamW state (Strata's checkpoint, in path/strata: safetensors), the
        residents, the optax state and the step count (path/jax.npz). Written to
        "<path>.partial" and renamed into place, so a crash leaves the previous one whole."""
        path = os.fspath(path)
        self._settle()
        tmp = path + ".partial"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        self.runtime.save_checkpoint(os.path.join(tmp, "strata"), self.optimizer)
        leaves = [np.asarray(a) for a in self._jax_leaves()]
        meta = {"format": _FORMAT, "step": self.step_count, "layers": self.layers,
                "names": self.names,
                "leaves": [[str(a.dtype), list(a.shape)] for a in leaves]}
        arrays = {"leaf%d" % i: np.ascontiguousarray(a).reshape(-1).view(np.uint8)
                  for i, a in enumerate(leaves)}
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
        with open(os.path.join(tmp, "jax.npz"), "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        old = path + ".old"
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)

    def load(self, path):
        """Load a checkpoint that save() wrote, from a trainer of the same model and
        optimizers: resumes bit for bit. Everything is checked before anything is written."""
        path = os.fspath(path)
        with np.load(os.path.join(path, "jax.npz")) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            raw = [z["leaf%d" % i] for i in range(len(meta["leaves"]))]
        if meta.get("format") != _FORMAT:
            raise ValueError("strata.jax.load: %s is not a strata.jax checkpoint" % path)
        if meta["layers"] != self.layers or meta["names"] != self.names:
            raise ValueError("strata.jax.load: the checkpoint's blocks (%d layers of %s) are "
                             "not this trainer's (%d of %s)" % (meta["layers"], meta["names"],
                                                                 self.layers, self.names))
        template, treedef = jax.tree_util.tree_flatten((self.residents, self.opt_state))
        if len(template) != len(raw):
            raise ValueError("strata.jax.load: the checkpoint holds %d resident and optax state "
                             "arrays, this trainer %d (another resident model or optimizer?)"
                             % (len(raw), len(template)))
        values = []
        for i, (t, (dtype, shape), r) in enumerate(zip(template, meta["leaves"], raw)):
            t = np.asarray(t)
            if str(t.dtype) != dtype or list(t.shape) != shape:
                raise ValueError("strata.jax.load: resident/optax array %d is %s%s in the "
                                 "checkpoint, %s%s here" % (i, dtype, shape, t.dtype,
                                                            list(t.shape)))
            values.append(r.view(t.dtype).reshape(t.shape))
        self._settle()
        self.runtime.load_checkpoint(os.path.join(path, "strata"), self.optimizer)
        tree = jax.tree_util.tree_unflatten(treedef, values)
        self.residents, self.opt_state = jax.device_put(tree, self.device)
        self.step_count = meta["step"]

    def synchronize(self):
        """Wait for the blocks' running updates."""
        self._settle()
        self.optimizer.synchronize()

    def close(self):
        if self._ffi is not None and self.runtime._handle is not None:
            self._settle()
        if self._ffi is not None:
            self._ffi.close()
        self.runtime.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
