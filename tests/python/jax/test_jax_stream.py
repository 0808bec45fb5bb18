"""strata.jax against plain JAX on the CPU (host backend): the same model, init and data give
the same losses step by step, with the blocks streamed through Strata and updated by its CPU
AdamW, the embedding, norm and head by AdamW in JAX."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from llama_zoo import jax_llama as models  # noqa: E402
from llama_zoo.jax_trainer import StreamedTrainer  # noqa: E402

STEPS = 6


def data(config, seed=0):
    rng = np.random.default_rng(seed)
    pair = [rng.integers(0, config.vocab_size, (4, 32), dtype=np.int32) for _ in range(2)]
    return [pair[i % 2] for i in range(STEPS)]


def plain_losses(config, blocks, residents, batches, lr, wd):
    params = {"blocks": [{k: jnp.asarray(v) for k, v in b.items()} for b in blocks],
              "res": {k: jnp.asarray(v) for k, v in residents.items()}}
    m = jax.tree_util.tree_map(jnp.zeros_like, params)
    v = jax.tree_util.tree_map(jnp.zeros_like, params)
    grad = jax.jit(jax.value_and_grad(
        lambda p, ids: models.loss_fn(config, p["blocks"], p["res"], ids)))
    losses = []
    for t, ids in enumerate(batches, start=1):
        loss, g = grad(params, jnp.asarray(ids))
        flat_p, tree = jax.tree_util.tree_flatten(params)
        out = [models.adamw(p_, g_, m_, v_, t, lr, wd=wd) for p_, g_, m_, v_ in zip(
            flat_p, jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(m),
            jax.tree_util.tree_leaves(v))]
        params = jax.tree_util.tree_unflatten(tree, [o[0] for o in out])
        m = jax.tree_util.tree_unflatten(tree, [o[1] for o in out])
        v = jax.tree_util.tree_unflatten(tree, [o[2] for o in out])
        losses.append(float(loss))
    return losses


def test_losses_match_plain_jax():
    # On a GPU, XLA's default fp32 matmuls use TF32, rounded differently in a whole-model
    # program than in per-layer ones: compare at full fp32 precision.
    jax.config.update("jax_default_matmul_precision", "highest")
    config = models.PRESETS["tiny"]
    blocks, residents = models.init_params(config, seed=0)
    batches = data(config)
    expected = plain_losses(config, blocks, residents, batches, 3e-3, 0.1)
    trainer = StreamedTrainer(config, blocks, residents, lr=3e-3, weight_decay=0.1)
    got = [trainer.step(ids) for ids in batches]
    trainer.synchronize()
    assert expected[-1] < expected[0] - 0.1
    for e, g in zip(expected, got):
        assert abs(e - g) <= 1e-5 * abs(e), (expected, got)
    assert trainer.optimizer.stats()["step"] == STEPS
    trainer.close()
