"""The models both sides of strata.jax's parity tests train (jax/test_jax_api.py and
jax/test_jax_ffi.py): the Llama-style model of llama_zoo.jax_llama as the three functions
strata.jax.Trainer takes, a stacked-block MLP that is not the Llama, plain JAX + optax training
of either, the trainers over them, and the comparisons."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

import strata.jax as sj
from llama_zoo import jax_llama as models

CONFIG = models.PRESETS["tiny"]
LR, WD = 3e-3, 0.1
# Two runs of the same program agree bit for bit on the CPU; XLA's GPU reductions (atomics in
# the backward pass) do not promise that, so there the same runs agree to float rounding.
SAME_RUN_RTOL = 0 if jax.default_backend() == "cpu" else 1e-6


def batches(n, seed=0, shape=(4, 32)):
    rng = np.random.default_rng(seed)
    pair = [rng.integers(0, CONFIG.vocab_size, shape, dtype=np.int32) for _ in range(2)]
    return [pair[i % 2] for i in range(n)]


# The Llama-style model of llama_zoo.jax_llama as the three functions the Trainer takes.
def embed_fn(r, ids):
    x = r["embed"][ids]
    return x, models.rotary(CONFIG, ids.shape[1], x.dtype)


def block_fn(p, x, cos, sin):
    return models.block_forward(CONFIG, p, x, cos, sin)


def loss_fn(r, x, ids):
    return models.head_loss(CONFIG, r, x, ids)


def plain_loss(params, ids):
    x, extras = embed_fn(params["res"], ids)
    for p in params["blocks"]:
        x = block_fn(p, x, *extras)
    return loss_fn(params["res"], x, ids)


def plain_train(loss, params, opt, data):
    """Plain JAX: one jitted step over all parameters, optax over all of them."""
    state = opt.init(params)

    @jax.jit
    def step(params, state, batch):
        value, g = jax.value_and_grad(loss)(params, batch)
        updates, state = opt.update(g, state, params)
        return value, optax.apply_updates(params, updates), state

    losses = []
    for batch in data:
        value, params, state = step(params, state, batch)
        losses.append(float(value))
    return losses, params


def llama_params(seed=0):
    blocks, residents = models.init_params(CONFIG, seed=seed)
    return ([{k: jnp.asarray(v) for k, v in b.items()} for b in blocks],
            {k: jnp.asarray(v) for k, v in residents.items()})


def llama_trainer(blocks, residents, lr=LR, **kw):
    return sj.Trainer(block_fn, blocks, residents, embed_fn=embed_fn, loss_fn=loss_fn,
                      optimizer=optax.adamw(lr, weight_decay=WD),
                      block_optimizer=sj.AdamW(lr, weight_decay=WD), **kw)


def assert_close(expected, got, rtol=1e-5, what=""):
    for (path, e), g in zip(jax.tree_util.tree_leaves_with_path(expected),
                            jax.tree_util.tree_leaves(got)):
        e, g = np.asarray(e, np.float64), np.asarray(g, np.float64)
        err = np.linalg.norm(e - g) / max(np.linalg.norm(e), 1e-30)
        assert err <= rtol, (what, jax.tree_util.keystr(path), err)


def assert_losses(expected, got, rtol=1e-5):
    assert len(expected) == len(got)
    for e, g in zip(expected, got):
        assert abs(e - g) <= rtol * abs(e), (expected, got)


# A model that is not the Llama: stacked block params (a nested pytree with a leading layer
# axis, as jax.lax.scan takes them), a learned extra (its grads flow back through every block
# into the residents) and an integer mask among the extras; a warmup-cosine schedule and a
# param group without weight decay.
H, LAYERS = 32, 3


def mlp_params(seed=0):
    rng = np.random.default_rng(seed)
    n = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32) * 0.2)  # noqa: E731
    blocks = {"mlp": {"w1": n(LAYERS, H, 2 * H), "b1": n(LAYERS, 2 * H)}, "w2": n(LAYERS, 2 * H, H)}
    residents = {"inp": n(8, H), "gate": n(H), "out": n(H, 1)}
    return blocks, residents


def mlp_embed(r, batch):
    x = batch["x"] @ r["inp"]
    return x, (jnp.tanh(r["gate"]), batch["mask"])


def mlp_block(p, x, gate, mask):
    h = jnp.tanh(x @ p["mlp"]["w1"] + p["mlp"]["b1"])
    return x + jnp.where(mask[:, None] > 0, (h @ p["w2"]) * gate, 0.0)


def mlp_loss(r, x, batch):
    return jnp.mean((x @ r["out"] - batch["y"]) ** 2)


def mlp_plain_loss(params, batch):
    x, extras = mlp_embed(params["res"], batch)
    x, _ = jax.lax.scan(lambda x, p: (mlp_block(p, x, *extras), None), x, params["blocks"])
    return mlp_loss(params["res"], x, batch)


def mlp_data(n):
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        out.append({"x": rng.standard_normal((16, 8), np.float32),
                    "y": rng.standard_normal((16, 1), np.float32),
                    "mask": (rng.random(16) > 0.2).astype(np.int32)})
    return out


SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 8)


def no_bias_decay(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not jax.tree_util.keystr(path).endswith("['b1']"), params)


def mlp_trainer(blocks, residents, **kw):
    return sj.Trainer(mlp_block, blocks, residents, embed_fn=mlp_embed, loss_fn=mlp_loss, **kw,
                      optimizer=optax.adamw(SCHEDULE, weight_decay=WD, mask=no_bias_decay),
                      block_optimizer=sj.AdamW(SCHEDULE, weight_decay=WD, groups=[
                          {"params": lambda name: name.endswith("b1"), "weight_decay": 0.0}]))
