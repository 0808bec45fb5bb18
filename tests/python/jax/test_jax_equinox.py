"""strata.jax.offload over an Equinox model: a small Llama-style transformer built from
Equinox's own layers (eqx.nn.Embedding, eqx.nn.Linear, eqx.nn.RMSNorm), its blocks made by
eqx.filter_vmap over split keys and applied with jax.lax.scan over their eqx.partition'ed
arrays, trained by the user's own eqx.filter_jit step with optax.adamw — once plainly, once
with the blocks streamed through Strata (their grads to strata.jax.AdamW, the rest to the same
optax). Same seed, same batches: losses and parameters to the tolerance of strata.jax's other
parity tests. Equinox is an optional extra: absent, this file skips."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
eqx = pytest.importorskip("equinox")
import jax.numpy as jnp  # noqa: E402

import strata.jax as sj  # noqa: E402
from strata.jax import _ffi  # noqa: E402
from jax_parity_models import LR, WD, assert_close, assert_losses  # noqa: E402
from llama_zoo.jax_llama import _rotate_half  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# As test_jax_ffi.py: the user's jitted step against plain JAX + optax, 1e-5 on the CPU; a
# GPU's fp32 reductions differ in order between the two programs.
PARAMS_RTOL = 1e-5 if jax.default_backend() == "cpu" else 5e-5
VOCAB, DIM, HEADS, FFN, LAYERS = 64, 32, 4, 64, 3


@pytest.fixture(autouse=True)
def _ffi_available():
    try:
        _ffi.load()
    except _ffi.FfiUnavailable as e:  # CI builds it: only a machine without a compiler skips
        pytest.skip("the FFI library cannot be built here: %s" % e)


def rotary(seq, dtype):
    d = DIM // HEADS
    freqs = jnp.outer(jnp.arange(seq, dtype=jnp.float32),
                      1.0 / (10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)))
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]  # (seq, 1, head_dim)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def tokens(layer, x):
    """An Equinox layer (one token at a time) over every token of x: (..., features)."""
    return jax.vmap(layer)(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)


class Block(eqx.Module):
    attn_norm: eqx.nn.RMSNorm
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    mlp_norm: eqx.nn.RMSNorm
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 7)
        self.attn_norm, self.mlp_norm = eqx.nn.RMSNorm(DIM), eqx.nn.RMSNorm(DIM)
        self.q, self.k, self.v, self.o = (eqx.nn.Linear(DIM, DIM, use_bias=False, key=k)
                                          for k in keys[:4])
        self.gate = eqx.nn.Linear(DIM, FFN, use_bias=False, key=keys[4])
        self.up = eqx.nn.Linear(DIM, FFN, use_bias=False, key=keys[5])
        self.down = eqx.nn.Linear(FFN, DIM, use_bias=False, key=keys[6])

    def __call__(self, x, cos, sin):  # x: (batch, seq, DIM)
        b, t, _ = x.shape
        h = tokens(self.attn_norm, x)

        def heads(layer, rotate):
            y = tokens(layer, h).reshape(b, t, HEADS, DIM // HEADS)
            return y * cos + _rotate_half(y) * sin if rotate else y

        att = jax.nn.dot_product_attention(heads(self.q, True), heads(self.k, True),
                                           heads(self.v, False), is_causal=True)
        x = x + tokens(self.o, att.reshape(b, t, DIM))
        h = tokens(self.mlp_norm, x)
        return x + tokens(self.down, jax.nn.silu(tokens(self.gate, h)) * tokens(self.up, h))


class Llama(eqx.Module):
    embed: eqx.nn.Embedding
    layers: eqx.Module
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k_embed, k_layers, k_head = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, DIM, key=k_embed)
        self.layers = eqx.filter_vmap(Block)(jax.random.split(k_layers, LAYERS))
        self.norm = eqx.nn.RMSNorm(DIM)
        self.head = eqx.nn.Linear(DIM, VOCAB, use_bias=False, key=k_head)

    def __call__(self, ids):
        x = self.embed.weight[ids]
        x = sj.scan_blocks(self.layers, x, *rotary(ids.shape[1], x.dtype))
        return tokens(self.head, tokens(self.norm, x))


def equinox_scan_forward(model, ids):
    """The model's forward written with the Equinox idiom (the oracle of scan_blocks)."""
    x = model.embed.weight[ids]
    cos, sin = rotary(ids.shape[1], x.dtype)
    arrays, static = eqx.partition(model.layers, eqx.is_array)

    def body(x, block):
        return eqx.combine(block, static)(x, cos, sin), None

    x, _ = jax.lax.scan(body, x, arrays)
    return tokens(model.head, tokens(model.norm, x))


def loss_fn(model, ids):
    logits = model(ids[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


TX = optax.adamw(LR, weight_decay=WD)


@eqx.filter_jit
def train_step(model, opt_state, ids):
    """The user's step, the same for both runs."""
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, ids)
    updates, opt_state = TX.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def batches(n):
    """Two batches in turn (as jax_parity_models.batches): the loss falls within a few steps."""
    rng = np.random.default_rng(0)
    pair = [jnp.asarray(rng.integers(0, VOCAB, (4, 17), dtype=np.int32)) for _ in range(2)]
    return [pair[i % 2] for i in range(n)]


def train(model, data):
    opt_state, losses = TX.init(eqx.filter(model, eqx.is_array)), []
    for ids in data:
        model, opt_state, loss = train_step(model, opt_state, ids)
        losses.append(float(loss))
    return model, losses


def test_equinox_model_with_its_own_filter_jit_step_matches_plain_equinox():
    data = batches(6)
    plain = Llama(jax.random.key(0))
    ids = data[0]
    # scan_blocks on a plain stack is the Equinox idiom, exactly.
    np.testing.assert_array_equal(np.asarray(plain(ids)),
                                  np.asarray(equinox_scan_forward(plain, ids)))
    plain, expected = train(plain, data)
    assert expected[-1] < expected[0] - 0.1

    model, trainer = sj.offload(Llama(jax.random.key(0)), lambda m: m.layers,
                                block_optimizer=sj.AdamW(LR, weight_decay=WD))
    with trainer:
        assert isinstance(model.layers, sj._equinox.StreamedBlocks)
        # The rest of the model is all eqx.filter sees: the blocks live in Strata.
        assert len(jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))) == 4
        assert "attn_norm.weight" in trainer.names and "q.weight" in trainer.names
        model, got = train(model, data)
        assert_losses(expected, got)
        assert trainer.step_count == len(data) == trainer.optimizer.stats()["step"]
        assert_close(eqx.filter(plain.layers, eqx.is_array),
                     eqx.filter(model.layers.plain(), eqx.is_array), rtol=PARAMS_RTOL,
                     what="blocks")
        for name in ("embed", "norm", "head"):
            assert_close(eqx.filter(getattr(plain, name), eqx.is_array),
                         eqx.filter(getattr(model, name), eqx.is_array), rtol=PARAMS_RTOL,
                         what=name)
        # Not differentiated (evaluation in eqx.filter_jit): the blocks stream forward only.
        logits = eqx.filter_jit(lambda m, x: m(x))(model, ids)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(plain(ids)), rtol=1e-4,
                                   atol=1e-5)
        assert trainer.step_count == len(data)


class Counted(eqx.Module):
    lin: eqx.nn.Linear
    uses: jax.Array

    def __init__(self, key):
        self.lin = eqx.nn.Linear(DIM, DIM, key=key)
        self.uses = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        return tokens(self.lin, x)


class CountedStack(eqx.Module):
    layers: eqx.Module

    def __init__(self):
        self.layers = eqx.filter_vmap(Counted)(jax.random.split(jax.random.key(0), LAYERS))


def test_equinox_offload_refuses_what_it_cannot_stream():
    model = Llama(jax.random.key(0))
    with pytest.raises(TypeError, match="function model -> stacked blocks"):
        sj.offload(model, 3)
    with pytest.raises(TypeError, match="the blocks are ArrayImpl, not a stacked eqx.Module"):
        sj.offload(model, "head.weight")
    with pytest.raises(TypeError, match="'uses' has dtype int32"):
        sj.offload(CountedStack(), "layers")
    with pytest.raises(TypeError, match=r"\['embed_fn', 'loss_fn'\] cannot be given"):
        sj.offload(model, "layers", embed_fn=lambda r, b: b, loss_fn=lambda r, x, b: x)
    with pytest.raises(TypeError, match="scan_blocks: the blocks are a dict"):
        sj.scan_blocks({"w": jnp.ones(3)}, jnp.ones(3))
    streamed, trainer = sj.offload(model, "layers")
    with trainer:
        assert isinstance(model.layers, eqx.Module) and not hasattr(model.layers, "streamed")
        with pytest.raises(TypeError, match="already offloaded"):
            sj.offload(streamed, "layers")
