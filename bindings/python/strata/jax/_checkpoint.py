"""The Trainer's whole-state checkpoints: Strata's (the blocks' weights, masters and AdamW
state) and JAX's (the residents, the optax state, the step count), in one of the runtime's
atomic directories (strata.atomic_dir)."""
import json
import os

import jax
import numpy as np

from .. import atomic_dir

_FORMAT = "strata.jax/1"


class _Checkpoints:
    """Trainer's save and load (a mixin of Trainer)."""

    def _no_data_parallel(self, what):
        if self.data_parallel is not None:
            raise NotImplementedError("strata.jax.%s: checkpoints of a data-parallel Trainer "
                                      "(each rank's chunks) are not supported yet" % what)

    def _jax_leaves(self):
        return jax.tree_util.tree_leaves((self.residents, self.opt_state))

    def save(self, path):
        """Save the whole training state to the directory `path`: the blocks' weights, fp32
        masters and AdamW state (Strata's checkpoint, in path/strata: safetensors), the
        residents, the optax state and the step count (path/jax.npz). Written in the runtime's
        atomic directory (strata.atomic_dir), so a crash leaves the previous one whole."""
        path = os.fspath(path)
        self._no_data_parallel("save")
        self._settle()
        if self.micro_step:
            raise ValueError("strata.jax.save: the trainer is inside an accumulation (%d of %d "
                             "micro-batches towards the next update): save after an update"
                             % (self.micro_step, self.block_optimizer.accumulation))
        tmp = atomic_dir.begin(path)
        self.runtime.save_checkpoint(os.path.join(tmp, "strata"), self.optimizer)
        leaves = [np.asarray(a) for a in self._jax_leaves()]
        meta = {"format": _FORMAT, "step": self.step_count, "layers": self.layers,
                "names": self.names,
                "leaves": [[str(a.dtype), list(a.shape)] for a in leaves]}
        arrays = {"leaf%d" % i: np.ascontiguousarray(a).reshape(-1).view(np.uint8)
                  for i, a in enumerate(leaves)}
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
        with open(os.path.join(tmp, "jax.npz"), "wb") as f:
            np.savez(f, **arrays)  # made durable by the commit, with the rest
        atomic_dir.commit(path)

    def load(self, path):
        """Load a checkpoint that save() wrote, from a trainer of the same model and
        optimizers: resumes bit for bit. Everything is checked before anything is written.
        Where a save was interrupted mid-commit, the previous checkpoint ("<path>.old") loads."""
        self._no_data_parallel("load")
        path = atomic_dir.resolve(path)
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
        if self.block_optimizer.holds_grads:
            self._drop_held(None)  # an accumulation in progress gives way to the loaded state
        self.runtime.load_checkpoint(os.path.join(path, "strata"), self.optimizer)
        tree = jax.tree_util.tree_unflatten(treedef, values)
        self.residents, self.opt_state = jax.device_put(tree, self.device)
        self.step_count = meta["step"]
