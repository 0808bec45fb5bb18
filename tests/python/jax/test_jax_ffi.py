"""strata.jax's XLA FFI path: each step one XLA program whose acquire and release of the
streamed blocks are custom calls (registered for the CPU too, where they drive the host
backend with a NULL stream, so CI runs the same program, ops and ordering as the GPU). Against
plain JAX + optax to 1e-5, against the host-synchronised loop, scanned and unrolled, and
after a failure inside the program."""
import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import strata.jax as sj  # noqa: E402
from strata.jax import _ffi  # noqa: E402
import jax_parity_models as api  # noqa: E402 (the models test_jax_api.py trains too)

jax.config.update("jax_default_matmul_precision", "highest")
# Two different programs of the same arithmetic (one XLA program against per-layer ones, or
# with a host callback in the block): equal on the CPU to float rounding, on the GPU (whose
# reductions may use atomics) to the parity tolerance.
OTHER_PROGRAM_RTOL = 1e-6 if jax.default_backend() == "cpu" else 1e-5
# Parameters after five steps against plain JAX + optax: 1e-5 on the CPU (the CI
# bound); on a GPU the two programs' fp32 reductions differ in order (measured on an H100:
# 1.07e-5 for one weight, unrolled), so 5e-5 there.
PLAIN_PARAMS_RTOL = 1e-5 if jax.default_backend() == "cpu" else 5e-5


def require_ffi():
    try:
        _ffi.load()
    except _ffi.FfiUnavailable as e:  # CI builds it: only a machine without a compiler skips
        pytest.skip("the FFI library cannot be built here: %s" % e)


@pytest.fixture(autouse=True)
def _ffi_available():
    require_ffi()


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
def test_ffi_step_matches_plain_jax_optax_and_host_loop(scan):
    blocks, residents = api.llama_params()
    data = api.batches(5)
    expected, final = api.plain_train(api.plain_loss, {"blocks": blocks, "res": residents},
                                      optax.adamw(api.LR, weight_decay=api.WD), data)
    with api.llama_trainer(blocks, residents, ffi=True, scan=scan) as trainer:
        assert trainer.uses_ffi and trainer.scan == scan
        got = [trainer.step(ids) for ids in data]
        api.assert_losses(expected, got)
        got_blocks, got_res = trainer.get_params()
        api.assert_close(final["blocks"], got_blocks, rtol=PLAIN_PARAMS_RTOL, what="blocks")
        api.assert_close(final["res"], got_res, rtol=PLAIN_PARAMS_RTOL, what="residents")
        stats = trainer.executor.stats()
        assert stats["steps"] == len(data)
        # Every layer came through the executor's slots in both passes (the backward may
        # reuse what the forward left in a slot).
        assert stats["loads"] == 2 * len(data) * api.CONFIG.num_hidden_layers
        assert trainer.optimizer.stats()["step"] == len(data)
    with api.llama_trainer(blocks, residents, ffi=False) as host_loop:
        assert not host_loop.uses_ffi
        api.assert_losses(got, [host_loop.step(ids) for ids in data], rtol=OTHER_PROGRAM_RTOL)


def test_ffi_stacked_blocks_extras_groups_match_plain_jax_optax():
    blocks, residents = api.mlp_params()
    data = api.mlp_data(6)
    expected, final = api.plain_train(
        api.mlp_plain_loss, {"blocks": blocks, "res": residents},
        optax.adamw(api.SCHEDULE, weight_decay=api.WD, mask=api.no_bias_decay), data)
    with api.mlp_trainer(blocks, residents, ffi=True) as trainer:
        assert trainer.uses_ffi and trainer.scan
        api.assert_losses(expected, [trainer.step(b) for b in data])
        got_blocks, got_res = trainer.get_params()
        api.assert_close(final["blocks"], got_blocks, what="blocks")
        api.assert_close(final["res"], got_res, what="residents")


def test_ffi_bf16_blocks_train_with_few_slots():
    # Two slots for three layers: the executor refills slots while the program runs.
    blocks, residents = api.mlp_params()
    data = api.mlp_data(4)
    with api.mlp_trainer(blocks, residents, ffi=True, dtype=jnp.bfloat16) as reference:
        ref = [reference.step(b) for b in data]
    with api.mlp_trainer(blocks, residents, ffi=True, dtype=jnp.bfloat16, gpu_budget=1 << 20,
                         slot_budget=40000) as trainer:  # a slot (weights, grads) is 16.5 KiB
        assert trainer.executor.plan_info().slots == 2
        # Bit for bit on the CPU; bf16 on the GPU rounds its atomic reductions' orders apart.
        rtol = api.SAME_RUN_RTOL if jax.default_backend() == "cpu" else 1e-3
        api.assert_losses(ref, [trainer.step(b) for b in data], rtol=rtol)


def test_ffi_failure_inside_the_program_leaves_the_trainer_usable():
    blocks, residents = api.llama_params()
    data = api.batches(3)
    with api.llama_trainer(blocks, residents, ffi=True) as fresh:
        expected = [fresh.step(ids) for ids in data]
    calls = {"n": 0, "fail": True}

    def check(x):
        calls["n"] += 1
        if calls["fail"] and calls["n"] == 3:  # the third block's forward, at run time
            raise RuntimeError("boom at run time")
        return x

    def flaky_block(p, x, cos, sin):
        # A host callback outside differentiation (no tangent reaches it), used by the block.
        seen = jax.pure_callback(check, jax.ShapeDtypeStruct(x.shape, x.dtype),
                                 jax.lax.stop_gradient(x))
        return api.block_fn(p, x + 0 * seen, cos, sin)

    trainer = sj.Trainer(flaky_block, blocks, residents, embed_fn=api.embed_fn,
                         loss_fn=api.loss_fn, optimizer=optax.adamw(api.LR, weight_decay=api.WD),
                         block_optimizer=sj.AdamW(api.LR, weight_decay=api.WD), ffi=True,
                         scan=False)
    with trainer:
        with pytest.raises(Exception, match="boom at run time"):
            trainer.step(data[0])
        # Failed in the forward pass: no grads were released, nothing was updated.
        assert trainer.step_count == 0 and trainer.optimizer.stats()["step"] == 0
        calls["fail"] = False
        api.assert_losses(expected, [trainer.step(ids) for ids in data], rtol=OTHER_PROGRAM_RTOL)
        with pytest.raises(TypeError, match="inside jax.jit"):
            jax.jit(lambda: trainer.step(data[0]))()


def test_ffi_true_refuses_a_backend_that_does_not_match_the_device():
    blocks, residents = api.mlp_params()
    other = "cuda" if jax.default_backend() == "cpu" else "host"
    with pytest.raises(ValueError, match="ffi=True: the FFI ops need JAX's device and Strata's"):
        api.mlp_trainer(blocks, residents, ffi=True, backend=other)


def test_ffi_session_refuses_unbound_use():
    session = _ffi.Session()
    session.close()
    fn = jax.jit(lambda t, x: session.acquire(t, x, 0, [jax.ShapeDtypeStruct((2,), jnp.float32)]))
    with pytest.raises(Exception, match="not bound"):
        jax.block_until_ready(fn(jnp.zeros((), jnp.uint32), jnp.zeros(3)))


def user_step(trainer, tx):
    """The user's own jitted step: embedding, the streamed blocks (trainer.apply_blocks), the
    head's loss, their optax update of the residents and a metric, in one jax.jit."""
    @jax.jit
    def train_step(residents, state, ids):
        def loss(r):
            x, extras = api.embed_fn(r, ids)
            return api.loss_fn(r, trainer.apply_blocks(x, *extras), ids)

        value, grads = jax.value_and_grad(loss)(residents)
        updates, state = tx.update(grads, state, residents)
        return (optax.apply_updates(residents, updates), state,
                {"loss": value, "grad_norm": optax.tree.norm(grads)})

    return train_step


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
def test_user_jitted_step_matches_plain_jax_optax(scan):
    blocks, residents = api.llama_params()
    data = api.batches(5)
    expected, final = api.plain_train(api.plain_loss, {"blocks": blocks, "res": residents},
                                      optax.adamw(api.LR, weight_decay=api.WD), data)
    # No embed_fn, loss_fn or optimizer: the user's step owns them.
    with sj.Trainer(api.block_fn, blocks, block_optimizer=sj.AdamW(api.LR, weight_decay=api.WD),
                    ffi=True, scan=scan) as trainer:
        # Where setup went, per phase (bench/jax_bench.py --setup prints it).
        assert {"check", "runtime", "ffi", "read", "weights", "optimizer_state",
                "executor"} <= set(trainer.setup_seconds)
        assert all(v >= 0 for v in trainer.setup_seconds.values())
        tx = optax.adamw(api.LR, weight_decay=api.WD)
        train_step = user_step(trainer, tx)
        r, state, got = residents, tx.init(residents), []
        for ids in data:
            r, state, metrics = train_step(r, state, ids)
            got.append(float(metrics["loss"]))
            assert np.isfinite(float(metrics["grad_norm"]))
        api.assert_losses(expected, got)
        assert trainer.step_count == len(data) == trainer.optimizer.stats()["step"]
        got_blocks, _ = trainer.get_params()
        api.assert_close(final["blocks"], got_blocks, rtol=PLAIN_PARAMS_RTOL, what="blocks")
        api.assert_close(final["res"], r, rtol=PLAIN_PARAMS_RTOL, what="residents")

        # Not differentiated: a forward-only step (evaluation inside jit), nothing updated.
        @jax.jit
        def eval_loss(residents, ids):
            x, extras = api.embed_fn(residents, ids)
            return api.loss_fn(residents, trainer.apply_blocks(x, *extras), ids)

        ids = data[0]
        assert abs(float(eval_loss(r, ids)) - float(api.plain_loss(final, ids))) \
            <= 1e-5 * expected[0]
        assert trainer.step_count == len(data) == trainer.optimizer.stats()["step"]
        with pytest.raises(TypeError, match="needs embed_fn and loss_fn"):
            trainer.step(ids)


def test_user_jitted_step_with_schedule_and_stacked_extras():
    # Learned extras (their grads come back through the blocks), an integer mask, a schedule
    # the begin op evaluates at each step, a param group: as Trainer.step, to float rounding.
    blocks, residents = api.mlp_params()
    data = api.mlp_data(6)
    with api.mlp_trainer(blocks, residents, ffi=True) as reference:
        expected = [reference.step(b) for b in data]
    tx = optax.adamw(api.SCHEDULE, weight_decay=api.WD, mask=api.no_bias_decay)
    with sj.Trainer(api.mlp_block, blocks, ffi=True, block_optimizer=sj.AdamW(
            api.SCHEDULE, weight_decay=api.WD, groups=[
                {"params": lambda name: name.endswith("b1"), "weight_decay": 0.0}])) as trainer:
        @jax.jit
        def train_step(r, state, batch):
            def loss(r_):
                x, extras = api.mlp_embed(r_, batch)
                return api.mlp_loss(r_, trainer.apply_blocks(x, *extras), batch)

            value, grads = jax.value_and_grad(loss)(r)
            updates, state = tx.update(grads, state, r)
            return optax.apply_updates(r, updates), state, value

        r, state, got = residents, tx.init(residents), []
        for b in data:
            r, state, value = train_step(r, state, b)
            got.append(float(value))
        api.assert_losses(expected, got, rtol=OTHER_PROGRAM_RTOL)


def test_user_jitted_step_failure_is_abandoned_by_the_next_step():
    blocks, residents = api.llama_params()
    data = api.batches(3)
    tx = optax.adamw(api.LR, weight_decay=api.WD)
    with sj.Trainer(api.block_fn, blocks, block_optimizer=sj.AdamW(api.LR, weight_decay=api.WD),
                    ffi=True) as fresh:
        step = user_step(fresh, tx)
        r, state, expected = residents, tx.init(residents), []
        for ids in data:
            r, state, m = step(r, state, ids)
            expected.append(float(m["loss"]))
    fail = {"on": True}

    def check(x):
        if fail["on"]:
            raise RuntimeError("boom in the user's step")
        return x

    with sj.Trainer(api.block_fn, blocks, block_optimizer=sj.AdamW(api.LR, weight_decay=api.WD),
                    ffi=True) as trainer:
        @jax.jit
        def flaky(r, state, ids):
            def loss(r_):
                x, extras = api.embed_fn(r_, ids)
                x = trainer.apply_blocks(x, *extras)
                # Fails at run time after the step began, before the blocks' backward.
                seen = jax.pure_callback(check, jax.ShapeDtypeStruct(x.shape, x.dtype),
                                         jax.lax.stop_gradient(x))
                return api.loss_fn(r_, x + 0 * seen, ids)

            value, grads = jax.value_and_grad(loss)(r)
            updates, state = tx.update(grads, state, r)
            return optax.apply_updates(r, updates), state, {"loss": value}

        with pytest.raises(Exception, match="boom in the user's step"):
            jax.block_until_ready(flaky(residents, tx.init(residents), data[0]))
        assert trainer.step_count == 0 and trainer.optimizer.stats()["step"] == 0
        fail["on"] = False
        r, state, got = residents, tx.init(residents), []
        for ids in data:  # the first one's begin abandons the failed step
            r, state, m = flaky(r, state, ids)
            got.append(float(m["loss"]))
        api.assert_losses(expected, got, rtol=OTHER_PROGRAM_RTOL)
        assert trainer.step_count == len(data)


def test_apply_blocks_needs_the_ffi_path():
    blocks, residents = api.mlp_params()
    with api.mlp_trainer(blocks, residents, ffi=False) as trainer:
        with pytest.raises(RuntimeError, match="apply_blocks needs the XLA FFI ops"):
            trainer.apply_blocks(jnp.zeros((2, api.H)))
