"""The Llama-style decoder of llama_zoo.jax_llama built from Flax NNX's own layers (nnx.Embed,
nnx.Linear, nnx.RMSNorm), its blocks stacked by nnx.vmap and applied with
strata.jax.scan_blocks (nnx.scan on a plain stack, streamed once strata.jax.offload has taken
it): the model a Flax user brings. load_jax_llama gives it jax_llama's weights, so the two can
be compared on the same weights. Needs flax (pyproject's jax-flax extra)."""
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

import strata.jax as sj

from . import jax_llama
from .shapes import LlamaConfig, PRESETS, flops_per_token  # noqa: F401

_INIT = nnx.initializers.normal(0.02)


def _config(fields):
    # nnx keeps static attributes in the graph that jit hashes: the config as a tuple.
    return LlamaConfig(*fields)


class Block(nnx.Module):
    """One decoder block: block(x, cos, sin) -> x, as jax_llama.block_forward."""

    def __init__(self, config, rngs, dtype=None):
        h, i = config.hidden_size, config.intermediate_size
        kv = h // config.num_attention_heads * config.num_key_value_heads
        self.fields = dataclasses.astuple(config)

        def linear(n_in, n_out):
            return nnx.Linear(n_in, n_out, use_bias=False, dtype=dtype, kernel_init=_INIT,
                              rngs=rngs)

        def norm():
            return nnx.RMSNorm(h, epsilon=config.rms_norm_eps, dtype=dtype, rngs=rngs)

        self.attn_norm, self.mlp_norm = norm(), norm()
        self.wq, self.wk, self.wv, self.wo = linear(h, h), linear(h, kv), linear(h, kv), \
            linear(h, h)
        self.w_gate, self.w_up, self.w_down = linear(h, i), linear(h, i), linear(i, h)

    def __call__(self, x, cos, sin):
        y = self.attn_norm(x)
        x = x + self.wo(jax_llama.attention(_config(self.fields), self.wq(y), self.wk(y),
                                            self.wv(y), cos, sin))
        y = self.mlp_norm(x)
        return x + self.w_down(jax.nn.silu(self.w_gate(y)) * self.w_up(y))


class Llama(nnx.Module):
    """The whole decoder: model(ids) -> logits (fp32)."""

    def __init__(self, config, rngs, dtype=None):
        h = config.hidden_size
        self.fields = dataclasses.astuple(config)
        self.embed = nnx.Embed(config.vocab_size, h, dtype=dtype, embedding_init=_INIT,
                               rngs=rngs)

        @nnx.split_rngs(splits=config.num_hidden_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return Block(config, rngs, dtype)

        self.layers = make_blocks(rngs)
        self.norm = nnx.RMSNorm(h, epsilon=config.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(h, config.vocab_size, use_bias=False, dtype=dtype,
                               kernel_init=_INIT, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        cos, sin = jax_llama.rotary(_config(self.fields), ids.shape[1], x.dtype)
        x = sj.scan_blocks(self.layers, x, cos, sin)
        return self.head(self.norm(x)).astype(jnp.float32)


def loss_fn(model, ids):
    """Next-token cross-entropy over the whole sequence (fp32), as jax_llama.head_loss."""
    logp = jax.nn.log_softmax(model(ids)[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))


def load_jax_llama(model, blocks, residents):
    """jax_llama's weights (init_params' blocks, listed, and residents) into the model."""
    model.embed.embedding[...] = jnp.asarray(residents["embed"])
    model.norm.scale[...] = jnp.asarray(residents["norm"])
    model.head.kernel[...] = jnp.asarray(residents["head"])
    for key in jax_llama.BLOCK_KEYS:
        layer = getattr(model.layers, key)
        var = layer.scale if key.endswith("norm") else layer.kernel
        var[...] = jnp.stack([jnp.asarray(b[key]) for b in blocks])
