"""strata.jax.Trainer (the general API) against plain JAX + optax on the CPU (host backend):
the same model, init and data give the same losses and final parameters to 1e-5 relative with
the blocks streamed through Strata (its CPU AdamW) and the residents trained by optax; plus
param groups and schedules, eval, get/set of params, whole-state checkpoints that resume bit
for bit, and a trainer that stays usable after errors."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import strata.jax as sj  # noqa: E402
from jax_parity_models import (  # noqa: E402 (the models both sides train)
    H, LAYERS, LR, SAME_RUN_RTOL, SCHEDULE, WD, assert_close, assert_losses, batches, block_fn,
    embed_fn, llama_params, llama_trainer, loss_fn, mlp_data, mlp_params, mlp_plain_loss,
    mlp_trainer, no_bias_decay, plain_loss, plain_train)

jax.config.update("jax_default_matmul_precision", "highest")


def test_listed_blocks_match_plain_jax_optax():
    blocks, residents = llama_params()
    data = batches(6)
    expected, final = plain_train(plain_loss, {"blocks": blocks, "res": residents},
                                  optax.adamw(LR, weight_decay=WD), data)
    with llama_trainer(blocks, residents) as trainer:
        got = [trainer.step(ids) for ids in data]
        assert expected[-1] < expected[0] - 0.1
        assert_losses(expected, got)
        got_blocks, got_res = trainer.get_params()
        assert_close(final["blocks"], got_blocks, what="blocks")
        assert_close(final["res"], got_res, what="residents")
        assert trainer.optimizer.stats()["step"] == len(data) == trainer.step_count
        # Eval without grads: the loss of the trained parameters, nothing updated.
        ids = data[0]
        assert abs(trainer.evaluate(ids) - float(plain_loss(final, ids))) <= 1e-5 * expected[0]
        assert trainer.optimizer.stats()["step"] == len(data)
        # set_params: the plain run's parameters in, the plain loss out.
        trainer.set_params(blocks, residents)
        assert abs(trainer.evaluate(ids) - expected[0]) <= 1e-5 * expected[0]


def test_stacked_blocks_schedule_groups_match_plain_jax_optax():
    blocks, residents = mlp_params()
    data = mlp_data(8)
    expected, final = plain_train(
        mlp_plain_loss, {"blocks": blocks, "res": residents},
        optax.adamw(SCHEDULE, weight_decay=WD, mask=no_bias_decay), data)
    with mlp_trainer(blocks, residents) as trainer:
        assert trainer.names == ["mlp.b1", "mlp.w1", "w2"]
        got = [trainer.step(b) for b in data]
        assert expected[-1] < expected[0]
        assert_losses(expected, got)
        got_blocks, got_res = trainer.get_params()
        assert got_blocks["w2"].shape == (LAYERS, 2 * H, H)
        assert_close(final["blocks"], got_blocks, what="blocks")
        assert_close(final["res"], got_res, what="residents")


def test_checkpoint_resumes_bit_for_bit(tmp_path):
    blocks, residents = mlp_params()
    data = mlp_data(6)
    with mlp_trainer(blocks, residents) as a:
        for b in data[:3]:
            a.step(b)
        a.save(tmp_path / "ckpt")
        a.save(tmp_path / "ckpt")  # replaces the previous one
        rest = [a.step(b) for b in data[3:]]
        a_blocks, a_res = a.get_params(masters=True)
        a_state = a.opt_state
    other_blocks, other_res = mlp_params(seed=5)
    with mlp_trainer(other_blocks, other_res) as b:
        b.load(tmp_path / "ckpt")
        assert b.step_count == 3
        assert_losses(rest, [b.step(x) for x in data[3:]], rtol=SAME_RUN_RTOL)
        b_blocks, b_res = b.get_params(masters=True)
        for x, y in zip(jax.tree_util.tree_leaves((a_blocks, a_res, a_state)),
                        jax.tree_util.tree_leaves((b_blocks, b_res, b.opt_state))):
            if SAME_RUN_RTOL == 0:
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
            else:
                np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def test_bf16_and_fp16_blocks_train():
    blocks, residents = mlp_params()
    data = mlp_data(4)
    for dtype in (jnp.bfloat16, jnp.float16):
        with mlp_trainer(blocks, residents, dtype=dtype) as trainer:
            losses = [trainer.step(b) for b in data]
            assert np.all(np.isfinite(losses)) and losses[3] < losses[0], (dtype, losses)
            got, _ = trainer.get_params()
            assert got["w2"].dtype == dtype
            masters, _ = trainer.get_params(masters=True)
            assert masters["w2"].dtype == np.float32
            # The masters started from the fp32 values, not their rounding.
            assert not np.array_equal(masters["w2"], np.asarray(got["w2"], np.float32))
    # Leaves already in fp16 (no dtype given) keep it.
    half = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), blocks)
    with mlp_trainer(half, residents) as trainer:
        assert np.isfinite(trainer.step(data[0]))
        assert trainer.get_params()[0]["mlp"]["w1"].dtype == jnp.float16


def test_unsupported_leaves_and_dtypes_raise_clearly():
    blocks, residents = llama_params()
    bad = [dict(b) for b in blocks]
    bad[2]["extra"] = jnp.ones(3)
    with pytest.raises(ValueError, match=r"block 2.*extra leaves \['extra'\]"):
        llama_trainer(bad, residents)
    bad = [dict(b, step=jnp.zeros((), jnp.int32)) for b in blocks]
    with pytest.raises(TypeError, match="'step' has dtype int32"):
        llama_trainer(bad, residents)
    bad = [dict(b, name="layer") for b in blocks]
    with pytest.raises(TypeError, match="'name' is a str, not an array"):
        llama_trainer(bad, residents)
    bad = [dict(b, wq=np.asarray(b["wq"], np.float64)) for b in blocks]
    with pytest.raises(TypeError, match="float64"):
        llama_trainer(bad, residents)
    with pytest.raises(TypeError, match="dtype int8 is not supported"):
        llama_trainer(blocks, residents, dtype=jnp.int8)
    stacked, res = mlp_params()
    stacked["w2"] = stacked["w2"][:2]
    with pytest.raises(ValueError, match="layer count"):
        mlp_trainer(stacked, res)
    with pytest.raises(TypeError, match="learning rate"):
        sj.Trainer(block_fn, blocks, residents, embed_fn=embed_fn, loss_fn=loss_fn,
                   block_optimizer=sj.AdamW("fast"))


def test_errors_leave_the_trainer_usable():
    blocks, residents = llama_params()
    data = batches(3)
    with llama_trainer(blocks, residents) as fresh:
        expected = [fresh.step(ids) for ids in data]
    traces = {"n": 0, "fail_at": {1, 2}}

    def flaky_block(p, x, cos, sin):
        traces["n"] += 1
        if traces["n"] in traces["fail_at"]:
            raise RuntimeError("boom %d" % traces["n"])
        return block_fn(p, x, cos, sin)

    trainer = sj.Trainer(flaky_block, blocks, residents, embed_fn=embed_fn, loss_fn=loss_fn,
                         optimizer=optax.adamw(LR, weight_decay=WD),
                         block_optimizer=sj.AdamW(LR, weight_decay=WD))
    with trainer:
        with pytest.raises(RuntimeError, match="boom 1"):  # the forward pass's first trace
            trainer.step(data[0])
        traces["fail_at"] = {3}  # the next step's forward traces (2), then its backward (3)
        with pytest.raises(RuntimeError, match="boom 3"):
            trainer.step(data[0])
        # Inside jax.jit: a clear error, with the batch traced or closed over.
        with pytest.raises(TypeError, match="inside jax.jit"):
            jax.jit(trainer.step)(data[0])
        with pytest.raises(TypeError, match="inside jax.jit"):
            jax.jit(lambda: trainer.step(data[0]))()
        with pytest.raises(TypeError, match="inside jax.jit"):
            jax.grad(lambda ids: trainer.evaluate(ids))(data[0].astype(np.float32))
        assert trainer.step_count == 0 and trainer.optimizer.stats()["step"] == 0
        assert_losses(expected, [trainer.step(ids) for ids in data], rtol=SAME_RUN_RTOL)


class CountingBlocks:
    """A lazy sequence of blocks: builds (here: copies) block i when indexed."""

    def __init__(self, blocks):
        self.blocks, self.reads = blocks, 0

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        self.reads += 1
        return {k: np.array(v) for k, v in self.blocks[i].items()}


def test_lazy_listed_blocks_are_read_one_block_at_a_time():
    blocks, residents = llama_params()
    data = batches(2)
    with llama_trainer(blocks, residents) as listed:
        expected = [listed.step(ids) for ids in data]
    lazy = CountingBlocks(blocks)
    with llama_trainer(lazy, residents, stacked=False) as trainer:
        # Block 0's structure, each block checked, each block registered: never all at once.
        assert lazy.reads == 1 + 2 * len(blocks)
        assert_losses(expected, [trainer.step(ids) for ids in data], rtol=SAME_RUN_RTOL)
