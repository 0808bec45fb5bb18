"""strata.jax.offload for Flax NNX: a model's stacked blocks (an nnx.Module whose nnx.Params
carry a leading layer axis, as nnx.vmap makes them) handed to a Trainer and replaced in the
model by StreamedBlocks, an nnx.Module without arrays whose call streams them."""
import jax
import jax.numpy as jnp
from flax import nnx

from ._offload import _make_trainer, _Streamed, _StreamedCalls
from ._tree import _path_name


class StreamedBlocks(_StreamedCalls, nnx.Module):
    """The stack strata.jax.offload streams (its call, `trainer` and `plain()`: _StreamedCalls).
    It holds no nnx.Variable, so nnx.state, nnx.Optimizer and nnx.value_and_grad see only the
    rest of the model; `streamed` (static) holds the trainer and the stack's graph."""

    def __init__(self, streamed):
        self.streamed = streamed


def _names(flat):
    """Leaf names of a State (its Variables' `.value` dropped) or of a pure dict."""
    return [_path_name([k for k in path if getattr(k, "name", None) != "value"])
            for path, _ in flat]


def _resolve(model, blocks):
    if not isinstance(blocks, str) or not blocks:
        raise TypeError("strata.jax.offload: for a Flax NNX model, blocks is the attribute path "
                        "of its stacked blocks (\"layers\", \"decoder.layers\"); got %r"
                        % (blocks,))
    *path, attr = blocks.split(".")
    parent = model
    for name in path:
        parent = getattr(parent, name)
    layers = getattr(parent, attr, None)
    if not isinstance(layers, nnx.Module) or isinstance(layers, StreamedBlocks):
        raise TypeError("strata.jax.offload: model.%s is %s, not a stacked nnx.Module (blocks "
                        "made with nnx.vmap)%s" % (
                            blocks, type(layers).__name__,
                            " (already offloaded)" if isinstance(layers, StreamedBlocks) else ""))
    return parent, attr, layers


def offload(model, blocks, block_optimizer, trainer_kw):
    """strata.jax.offload for an nnx.Module (see there): the model changed in place."""
    parent, attr, layers = _resolve(model, blocks)
    graphdef, params, rest = nnx.split(layers, nnx.Param, ...)
    others = _names(jax.tree_util.tree_flatten_with_path(rest)[0])
    if others:
        # Dropout's RNG streams, BatchNorm's statistics: state a block changes as it runs,
        # which the streamed blocks (whose only state is their trained weights) cannot carry.
        raise TypeError("strata.jax.offload: the blocks hold variables other than nnx.Param "
                        "(%s): only trained parameters stream (make the blocks without RNG "
                        "streams or batch statistics)" % ", ".join(others))
    state_def = jax.tree_util.tree_structure(params)
    pure = nnx.to_pure_dict(params)
    # The Trainer flattens the pure dict (names without ".value"); one block is rebuilt from
    # those leaves through the State's structure, so both must flatten in one order.
    if _names(jax.tree_util.tree_flatten_with_path(params)[0]) != \
            _names(jax.tree_util.tree_flatten_with_path(pure)[0]):
        raise RuntimeError("strata.jax.offload: this Flax's State and its pure dict flatten in "
                           "different orders (an unsupported Flax version)")

    def module(leaves):
        return nnx.merge(graphdef, jax.tree_util.tree_unflatten(state_def, leaves))

    def block_fn(p, hidden, *extras):
        return module(jax.tree_util.tree_leaves(p))(hidden, *extras)

    trainer = _make_trainer(block_fn, pure, block_optimizer, trainer_kw)
    streamed = _Streamed(trainer, lambda stacked: module(
        [jnp.asarray(a) for a in jax.tree_util.tree_leaves(stacked)]))
    setattr(parent, attr, StreamedBlocks(streamed))
    return model, trainer


def scan(layers, hidden, extras):
    """The Flax idiom for a stack made by nnx.vmap: nnx.scan over its layer axis."""
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, block):
        return block(x, *extras)

    return body(hidden, layers)
