"""strata.jax.offload for Equinox: a model's stacked blocks (an eqx.Module whose arrays carry a
leading layer axis, as eqx.filter_vmap makes them) handed to a Trainer as their
eqx.partition'ed arrays, and replaced in the model by StreamedBlocks, an eqx.Module without
arrays whose call streams them."""
import equinox as eqx
import jax
import jax.numpy as jnp

from ._offload import _make_trainer, _Streamed, _StreamedCalls
from ._tree import _path_name


class StreamedBlocks(_StreamedCalls, eqx.Module):
    """The stack strata.jax.offload streams (its call, `trainer` and `plain()`: _StreamedCalls).
    Its one field is static, so eqx.filter, eqx.filter_value_and_grad and optax see only the
    rest of the model."""

    streamed: _Streamed = eqx.field(static=True)


def _where(blocks):
    if callable(blocks):
        return blocks
    if not isinstance(blocks, str) or not blocks:
        raise TypeError("strata.jax.offload: for an Equinox model, blocks is a function "
                        "model -> stacked blocks (as eqx.tree_at takes) or their attribute "
                        "path (\"layers\"); got %r" % (blocks,))

    def where(model):
        for name in blocks.split("."):
            model = getattr(model, name)
        return model

    return where


def offload(model, blocks, block_optimizer, trainer_kw):
    """strata.jax.offload for an eqx.Module (see there): a new model."""
    where = _where(blocks)
    layers = where(model)
    if not isinstance(layers, eqx.Module) or isinstance(layers, StreamedBlocks):
        raise TypeError("strata.jax.offload: the blocks are %s, not a stacked eqx.Module "
                        "(blocks made with eqx.filter_vmap)%s" % (
                            type(layers).__name__,
                            " (already offloaded)" if isinstance(layers, StreamedBlocks)
                            else ""))
    arrays, static = eqx.partition(layers, eqx.is_array)
    for path, leaf in jax.tree_util.tree_flatten_with_path(arrays)[0]:
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            # Trained leaves stream; a constant array of a block has no slot in Strata.
            raise TypeError("strata.jax.offload: block array %r has dtype %s: every array of "
                            "the blocks is a trained parameter here (keep integer constants "
                            "as Python values or pass them as extras)"
                            % (_path_name(path), leaf.dtype))

    def block_fn(p, hidden, *extras):
        return eqx.combine(p, static)(hidden, *extras)

    trainer = _make_trainer(block_fn, arrays, block_optimizer, trainer_kw)
    streamed = _Streamed(trainer, lambda stacked: eqx.combine(
        jax.tree_util.tree_map(jnp.asarray, stacked), static))
    return eqx.tree_at(where, model, StreamedBlocks(streamed)), trainer


def scan(layers, hidden, extras):
    """The Equinox idiom for a stack made by eqx.filter_vmap: jax.lax.scan over its
    eqx.partition'ed arrays, each block recombined with the static part."""
    arrays, static = eqx.partition(layers, eqx.is_array)

    def body(x, block_arrays):
        return eqx.combine(block_arrays, static)(x, *extras), None

    return jax.lax.scan(body, hidden, arrays)[0]
