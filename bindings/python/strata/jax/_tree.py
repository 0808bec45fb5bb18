"""The pytrees strata.jax trains: leaf names and checks, the dtypes Strata streams, the blocks
read per layer (stacked or listed) and embed_fn's result normalized."""
import jax
import jax.numpy as jnp
import numpy as np

# The dtypes Strata's optimizer trains (working copies and grads; masters are fp32).
_DTYPE_NAMES = {jnp.dtype(jnp.float32): "float32", jnp.dtype(jnp.bfloat16): "bfloat16",
                jnp.dtype(jnp.float16): "float16"}
_SUPPORTED = "float32, bfloat16 or float16"


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

