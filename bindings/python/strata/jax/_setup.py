"""Building a Trainer: the FFI choice, the blocks checked and read per layer, their tensors
registered with the runtime (where the placement says: strata.jax._tiers) and filled, the
optimizer, the executor, the residents."""
import os
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from .. import core
from . import _ffi, _weights
from ._optim import _lookup
from ._tree import (_DTYPE_NAMES, _SUPPORTED, _ListedLayers, _StackedLayers, _array,
                    _check_leaf, _path_name)

_FFI_WARNED = []  # the FFI ops' absence is reported once per process


class _Setup:
    """Trainer's construction steps (a mixin of Trainer: they set its attributes)."""

    def _timed(self, phase, started):
        now = time.perf_counter()
        self.setup_seconds[phase] = self.setup_seconds.get(phase, 0.0) + now - started
        return now

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

    def _refuse_data_parallel(self, ffi, nvme):
        """What data parallel does not run (yet), refused on every rank alike before anything
        is made (every rank builds the Trainer with the same arguments)."""
        if nvme:
            raise NotImplementedError("strata.jax: nvme= with data parallel is not supported "
                                      "yet (each rank would need NVMe files of its own)")
        if ffi is False:
            raise ValueError("strata.jax: data parallel runs the step as one XLA program with "
                             "the FFI ops (their collectives inside it): ffi=False (or "
                             "$STRATA_JAX_FFI=0) is not supported with it")
        if self.embed_fn is None:
            raise TypeError("strata.jax: data parallel (on by default under jax.distributed "
                            "with several processes) trains through step(), whose program "
                            "reduces the grads over the ranks: give embed_fn and loss_fn; "
                            "apply_blocks in your own jitted step (strata.jax.offload) is not "
                            "supported with it yet (data_parallel=False trains each process "
                            "alone)")

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
                                        beta2=opt.b2, eps=opt.eps,
                                        threads=self._layout.optimizer_threads(self.runtime,
                                                                               opt.threads),
                                        update_mode="explicit" if opt.holds_grads else "auto",
                                        **self._state_options)
        self.leaf_groups = [opt.group_of(n) for n in self.names]
        self.weights, self.grads = [], []
        t = time.perf_counter()
        # Every layer's weights and grads are registered (shapes only) before any optimizer
        # state, as strata.torch does: the state the optimizer places in DRAM first then sees
        # what DRAM has left for it, and with NVMe the staging slots the placement counted
        # stay free (a layer's state made before the next layer's grads took their room).
        for i in range(self.layers):
            ws, gs = [], []
            # The weights' home: the placement's for this layer (NVMe: streamed from there,
            # written back by the updates), else DRAM.
            home = self.placement.homes[i][0] if self.placement is not None else "dram"
            for name, shape, d in zip(self.names, self.shapes[i], self.leaf_dtypes):
                # Under data parallel this rank's chunk of the leaf (its flat elements).
                full = self._layout.registered_name("layers.%d.%s" % (i, name))
                shape = self._layout.registered_shape(shape)
                ws.append(self.runtime.register(full, shape, _DTYPE_NAMES[d], "weight", home))
                gs.append(self.runtime.register(full + ".grad", shape, _DTYPE_NAMES[d],
                                                "grad"))
            self.weights.append(ws)
            self.grads.append(gs)
        t = self._timed("register", t)
        with self._writer() as writer:
            for i in range(self.layers):
                leaves = per_layer[i]
                t = self._timed("read", t)  # a lazy sequence builds the block here
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
        leaves = [self._layout.own_chunk(v) for v in leaves]  # under data parallel, its chunk
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
            self._ffi.bind(ex, [[self._layout.kept(int(np.prod(shape))) * d.itemsize
                                 for shape, d in zip(shapes, self.leaf_dtypes)]
                                for shapes in self.shapes])

    def _init_residents(self, residents, optimizer):
        residents = {} if residents is None else residents
        for path, leaf in jax.tree_util.tree_flatten_with_path(residents)[0]:
            _check_leaf("resident", _path_name(path), leaf, inexact=optimizer is not None)
        self.resident_optimizer = optimizer
        if self.data_parallel is not None:  # replicas on every rank, from rank 0's values
            self.residents = self.data_parallel.replicate(residents)
            self.opt_state = self.data_parallel.replicate(optimizer.init(residents)) \
                if optimizer is not None else None
            return
        self.residents = jax.device_put(residents, self.device)
        # Committed to the device like the residents (and like what the step returns), so the
        # second step reuses the first one's compiled program instead of compiling again.
        self.opt_state = jax.device_put(optimizer.init(self.residents), self.device) \
            if optimizer is not None else None
