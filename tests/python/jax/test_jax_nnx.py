"""strata.jax.offload over a Flax NNX model: a small Llama-style transformer built from Flax's
own layers (nnx.Embed, nnx.Linear, nnx.RMSNorm), its blocks made by nnx.vmap over split rngs
and applied with nnx.scan, trained by the user's own nnx.jit step with nnx.Optimizer(optax.adamw)
— once plainly, once with the blocks streamed through Strata (their grads to strata.jax.AdamW,
the rest to the same optax). Same seed, same batches: losses and parameters to the tolerance of
strata.jax's other parity tests. Flax is an optional extra: absent, this file skips."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
nnx = pytest.importorskip("flax.nnx")
import jax.numpy as jnp  # noqa: E402

import strata.jax as sj  # noqa: E402
from strata.jax import _ffi  # noqa: E402
from jax_parity_models import LR, WD, assert_close, assert_losses  # noqa: E402

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
    half = DIM // HEADS // 2
    freqs = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def rope(x, cos, sin):  # x: (batch, seq, heads, head_dim)
    a, b = jnp.split(x, 2, axis=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


class Block(nnx.Module):
    def __init__(self, rngs):
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)  # noqa: E731
        self.attn_norm = nnx.RMSNorm(DIM, rngs=rngs)
        self.q, self.k, self.v, self.o = (linear(DIM, DIM) for _ in range(4))
        self.mlp_norm = nnx.RMSNorm(DIM, rngs=rngs)
        self.gate, self.up, self.down = linear(DIM, FFN), linear(DIM, FFN), linear(FFN, DIM)

    def __call__(self, x, cos, sin):
        b, t, _ = x.shape
        h = self.attn_norm(x)
        heads = lambda y: y.reshape(b, t, HEADS, DIM // HEADS)  # noqa: E731
        q, k = rope(heads(self.q(h)), cos, sin), rope(heads(self.k(h)), cos, sin)
        att = jax.nn.dot_product_attention(q, k, heads(self.v(h)), is_causal=True)
        x = x + self.o(att.reshape(b, t, DIM))
        h = self.mlp_norm(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Llama(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return Block(rngs)

        self.layers = make_blocks(rngs)
        self.norm = nnx.RMSNorm(DIM, rngs=rngs)
        self.head = nnx.Linear(DIM, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        x = sj.scan_blocks(self.layers, x, *rotary(ids.shape[1], x.dtype))
        return self.head(self.norm(x))


def flax_scan_forward(model, ids):
    """The model's forward written with Flax's own nnx.scan (the oracle of scan_blocks)."""
    x = model.embed(ids)
    cos, sin = rotary(ids.shape[1], x.dtype)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, block):
        return block(x, cos, sin)

    return model.head(model.norm(forward(x, model.layers)))


def loss_fn(model, ids):
    logits = model(ids[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


@nnx.jit
def train_step(model, optimizer, ids):
    """The user's step, the same for both runs."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, ids)
    optimizer.update(model, grads)
    return loss


def batches(n):
    """Two batches in turn (as jax_parity_models.batches): the loss falls within a few steps."""
    rng = np.random.default_rng(0)
    pair = [jnp.asarray(rng.integers(0, VOCAB, (4, 17), dtype=np.int32)) for _ in range(2)]
    return [pair[i % 2] for i in range(n)]


def train(model, data):
    optimizer = nnx.Optimizer(model, optax.adamw(LR, weight_decay=WD), wrt=nnx.Param)
    return [float(train_step(model, optimizer, ids)) for ids in data]


def test_nnx_model_with_its_own_nnx_jit_step_matches_plain_flax():
    data = batches(6)
    plain = Llama(nnx.Rngs(0))
    ids = data[0]
    # scan_blocks on a plain stack is Flax's own nnx.scan, exactly.
    np.testing.assert_array_equal(np.asarray(plain(ids)), np.asarray(flax_scan_forward(plain,
                                                                                       ids)))
    expected = train(plain, data)
    assert expected[-1] < expected[0] - 0.1

    model = Llama(nnx.Rngs(0))
    model, trainer = sj.offload(model, "layers",
                                block_optimizer=sj.AdamW(LR, weight_decay=WD))
    with trainer:
        assert isinstance(model.layers, sj._nnx.StreamedBlocks)
        # The rest of the model is all nnx.state sees: the blocks live in Strata.
        assert set(nnx.state(model, nnx.Param).keys()) == {"embed", "norm", "head"}
        assert trainer.names[:3] == ["attn_norm.scale", "down.kernel", "gate.kernel"]
        got = train(model, data)
        assert_losses(expected, got)
        assert trainer.step_count == len(data) == trainer.optimizer.stats()["step"]
        assert_close(nnx.state(plain.layers, nnx.Param), nnx.state(model.layers.plain(),
                                                                    nnx.Param),
                     rtol=PARAMS_RTOL, what="blocks")
        for name in ("embed", "norm", "head"):
            assert_close(nnx.state(getattr(plain, name), nnx.Param),
                         nnx.state(getattr(model, name), nnx.Param), rtol=PARAMS_RTOL,
                         what=name)
        # Not differentiated (evaluation in nnx.jit): the blocks stream forward only.
        logits = nnx.jit(lambda m, x: m(x))(model, ids)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(plain(ids)), rtol=1e-4,
                                   atol=1e-5)
        assert trainer.step_count == len(data)


def test_nnx_bf16_streamed_blocks_with_param_groups_train():
    # The streamed weights in bf16 (fp32 masters), the rest fp32; norms without weight decay
    # by a group over the leaves' names inside one block.
    data = batches(6)
    model, trainer = sj.offload(Llama(nnx.Rngs(0)), "layers", dtype=jnp.bfloat16,
                                block_optimizer=sj.AdamW(LR, weight_decay=WD, groups=[
                                    {"params": lambda n: n.endswith("norm.scale"),
                                     "weight_decay": 0.0}]))
    with trainer:
        assert trainer.leaf_groups == [1 if n.endswith("norm.scale") else 0
                                       for n in trainer.names]
        losses = train(model, data)
        assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.1, losses
        plain = model.layers.plain()
        assert plain.q.kernel[...].dtype == jnp.bfloat16
        assert plain.q.kernel[...].shape == (LAYERS, DIM, DIM)
    with pytest.raises(RuntimeError, match="the trainer is closed"):
        model.layers.plain()  # after the with block: named, not an AttributeError


class Noisy(nnx.Module):
    """A block with an RNG stream (dropout): state that changes as it runs."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(DIM, DIM, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.lin(x))


class NoisyStack(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return Noisy(rngs)

        self.layers = make_blocks(rngs)


def test_nnx_offload_refuses_what_it_cannot_stream():
    model = Llama(nnx.Rngs(0))
    with pytest.raises(TypeError, match="attribute path"):
        sj.offload(model, 3)
    with pytest.raises(TypeError, match="model.norm.missing is NoneType, not a stacked"):
        sj.offload(model, "norm.missing")
    with pytest.raises(TypeError, match=r"\['optimizer'\] cannot be given"):
        sj.offload(model, "layers", optimizer=optax.adamw(LR))
    with pytest.raises(TypeError, match="not a Flax NNX module"):
        sj.offload({"layers": 1})
    with pytest.raises(TypeError, match="variables other than nnx.Param"):
        sj.offload(NoisyStack(nnx.Rngs(0)), "layers")
    model, trainer = sj.offload(model, "layers")
    with trainer:
        with pytest.raises(TypeError, match="already offloaded"):
            sj.offload(model, "layers")


def test_nnx_llama_offloaded_matches_the_package_jax_llama_on_the_same_weights():
    """llama_zoo.nnx_llama (Flax's layers) with jax_llama's weights: the same loss as the
    package's own JAX Llama, and trained offloaded by an nnx.jit step, the same losses and
    parameters as strata.jax.Trainer over jax_llama's functions (issue 51's acceptance, on the
    CPU at the tiny preset)."""
    from llama_zoo import jax_llama, nnx_llama
    import jax_parity_models as api

    blocks, residents = api.llama_params()
    data = api.batches(4)
    model = nnx_llama.Llama(api.CONFIG, nnx.Rngs(1))
    nnx_llama.load_jax_llama(model, blocks, residents)
    ids = data[0]
    reference = float(jax_llama.loss_fn(api.CONFIG, blocks, residents, ids))
    assert abs(float(nnx_llama.loss_fn(model, ids)) - reference) <= 1e-6 * reference
    with api.llama_trainer(blocks, residents, ffi=True) as trainer:
        expected = [trainer.step(x) for x in data]
        expected_blocks, expected_res = trainer.get_params()

    model, trainer = sj.offload(model, "layers",
                                block_optimizer=sj.AdamW(LR, weight_decay=WD))
    with trainer:
        assert_losses(expected, train(model, data))  # this file's nnx.jit step
        got = model.layers.plain()
        for key in jax_llama.BLOCK_KEYS:
            layer = getattr(got, key)
            var = layer.scale if key.endswith("norm") else layer.kernel
            assert_close([b[key] for b in expected_blocks], list(var[...]), rtol=PARAMS_RTOL,
                         what=key)
        assert_close([expected_res["embed"], expected_res["head"]],
                     [model.embed.embedding[...], model.head.kernel[...]], rtol=PARAMS_RTOL,
                     what="residents")

