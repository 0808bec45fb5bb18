"""Evaluation and the blocks' and residents' values: read from Strata's DRAM, written back."""
import jax
import jax.numpy as jnp
import numpy as np


class _Params:
    """Trainer's evaluation and parameter access (a mixin of Trainer)."""

    def _read_layer(self, layer, masters=False):
        """Layer `layer`'s leaves (under data parallel gathered from every shard's chunk:
        collective)."""
        out = []
        ranks = self.data_parallel
        for w, shape, d in zip(self.weights[layer], self.shapes[layer], self.leaf_dtypes):
            t = self.optimizer.state(w, "master") if masters else w
            host = np.empty(self._layout.registered_shape(shape), np.float32 if masters else d)
            t.read_pointer(host.ctypes.data, host.nbytes)
            out.append(host if ranks is None else ranks.gather(host, shape))
        return out

    def _local_residents(self):
        """The residents on this process's device (under data parallel the replicas)."""
        ranks = self.data_parallel
        return self.residents if ranks is None else ranks.local(self.residents)

    def evaluate(self, batch):
        """The loss on `batch` without grads or updates: each block's weights are read from
        DRAM (after running updates finish), not streamed by the executor. Under data parallel
        collective: each process passes its rows, and gets the mean of the ranks' losses."""
        residents = self._local_residents()
        hidden, diff, const, mask, extras_def = self._prepare(batch, "evaluate", residents)
        self._settle()
        self.optimizer.synchronize()
        x = hidden
        for layer in range(self.layers):
            p = [jax.device_put(a, self.device) for a in self._read_layer(layer)]
            x = self._forward(p, x, diff, const, mask, extras_def)
        loss = float(self._loss(residents, x, batch))
        if self.data_parallel is not None:
            loss = self.data_parallel.mean_of(loss)
        return loss

    def get_params(self, masters=False):
        """(blocks, residents): the blocks as numpy arrays in the form they were given (stacked
        or listed), in the compute dtype (masters=True: the fp32 masters), and the residents.
        Under data parallel collective (every process calls it: the chunks are gathered)."""
        self._settle()
        self.optimizer.synchronize()
        layers = [self._read_layer(i, masters) for i in range(self.layers)]
        if self.stacked:
            blocks = jax.tree_util.tree_unflatten(
                self.treedef, [np.stack([layers[i][k] for i in range(self.layers)])
                               for k in range(len(self.names))])
        else:
            blocks = [jax.tree_util.tree_unflatten(self.treedef, leaves) for leaves in layers]
        return blocks, self._local_residents()

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
            if self.data_parallel is not None:  # replicas, from rank 0's values
                self.residents = self.data_parallel.replicate(jax.tree_util.tree_map(
                    lambda a, b: np.asarray(a, b.dtype), residents, self.residents))
                return
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
