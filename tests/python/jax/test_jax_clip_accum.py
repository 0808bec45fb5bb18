"""strata.jax.AdamW's max_grad_norm and accumulation against optax's semantics: the package's
small JAX Llama trained by strata.jax (blocks streamed, residents by optax) and by plain JAX
with optax.MultiSteps(optax.chain(optax.clip_by_global_norm(c), optax.adamw(...)), k) over
all parameters, on the same init and data: the same losses (per micro-batch) and parameters to
fp32 tolerance, with clipping that triggers (the global norm, blocks and residents together,
is above c) and that does not; and bad values refused with errors naming them."""
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import strata.jax as sj  # noqa: E402
import jax_parity_models as api  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# Thresholds below and far above the tiny Llama's global grad norms (the cases assert which side
# of the threshold every update is on, so a model change cannot make a case vacuous). Not far
# below: AdamW divides by sqrt(v) + eps, so grads scaled far down leave the embedding's rare
# rows near eps, where two programs' fp32 rounding differs beyond 1e-5.
CLIPS, NO_CLIP = 0.25, 1e4


def plain_optax(max_norm, k):
    inner = optax.chain(optax.clip_by_global_norm(max_norm), optax.adamw(api.LR,
                                                                        weight_decay=api.WD))
    return optax.MultiSteps(inner, every_k_schedule=k) if k > 1 else inner


def plain_norms(blocks, residents, data, k):
    """The global norm of each update's mean grads at the plain run's parameters (plain JAX,
    no clipping), to tell whether a threshold clips."""
    params = {"blocks": blocks, "res": residents}
    grad = jax.jit(jax.grad(api.plain_loss))
    g = [grad(params, ids) for ids in data[:k]]
    mean = jax.tree_util.tree_map(lambda *x: sum(x) / k, *g)
    return float(optax.tree.norm(mean))


def trainer_with(blocks, residents, adamw, ffi=None):
    return sj.Trainer(api.block_fn, blocks, residents, embed_fn=api.embed_fn,
                      loss_fn=api.loss_fn, optimizer=optax.adamw(api.LR, weight_decay=api.WD),
                      block_optimizer=adamw, ffi=ffi)


def run_case(max_norm, k, updates, ffi=None):
    blocks, residents = api.llama_params()
    data = api.batches(updates * k)
    expected, final = api.plain_train(api.plain_loss, {"blocks": blocks, "res": residents},
                                      plain_optax(max_norm, k), data)
    adamw = sj.AdamW(api.LR, weight_decay=api.WD, max_grad_norm=max_norm, accumulation=k)
    with trainer_with(blocks, residents, adamw, ffi=ffi) as trainer:
        got, norms = [], []
        for ids in data:
            got.append(trainer.step(ids))
            if trainer.micro_step == 0:
                norms.append(trainer.last_grad_norm)
        api.assert_losses(expected, got)
        got_blocks, got_res = trainer.get_params()
        api.assert_close(final["blocks"], got_blocks, what="blocks")
        api.assert_close(final["res"], got_res, what="residents")
        assert trainer.step_count == len(data) and len(norms) == updates
    # The first update's norm is the plain model's at init: the trainer measured all of it.
    assert abs(norms[0] - plain_norms(blocks, residents, data, k)) <= 1e-5 * norms[0]
    assert expected[-1] < expected[0]  # it trains
    return norms


@pytest.mark.parametrize("ffi", [None, False], ids=["default", "host_loop"])
def test_clipping_that_triggers_matches_optax(ffi):
    norms = run_case(CLIPS, 1, updates=4, ffi=ffi)
    assert all(n > CLIPS for n in norms)  # every update was clipped


def test_clipping_that_does_not_trigger_matches_optax():
    norms = run_case(NO_CLIP, 1, updates=3)
    assert all(n < NO_CLIP for n in norms)


def test_accumulation_with_clipping_matches_multisteps():
    norms = run_case(CLIPS, 3, updates=2)
    assert all(n > CLIPS for n in norms)


def test_accumulation_without_clipping_matches_multisteps():
    blocks, residents = api.llama_params()
    data = api.batches(4)
    expected, final = api.plain_train(
        api.plain_loss, {"blocks": blocks, "res": residents},
        optax.MultiSteps(optax.adamw(api.LR, weight_decay=api.WD), every_k_schedule=2), data)
    adamw = sj.AdamW(api.LR, weight_decay=api.WD, accumulation=2)
    with trainer_with(blocks, residents, adamw) as trainer:
        got, updated = [], trainer.get_params()
        for i, ids in enumerate(data):
            got.append(trainer.step(ids))
            assert trainer.micro_step == (i + 1) % 2
            b, r = trainer.get_params()
            if trainer.micro_step:  # between micro-batches nothing is updated
                api.assert_close(updated[0], b, rtol=0, what="blocks mid-accumulation")
                api.assert_close(updated[1], r, rtol=0, what="residents mid-accumulation")
                with pytest.raises(ValueError, match="inside an accumulation"):
                    trainer.save("/nonexistent/strata-jax-ckpt")
            updated = (b, r)
        api.assert_losses(expected, got)
        got_blocks, got_res = trainer.get_params()
        api.assert_close(final["blocks"], got_blocks, what="blocks")
        api.assert_close(final["res"], got_res, what="residents")


@pytest.mark.parametrize("kw, error, match", [
    ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm must be a finite number above 0"),
    ({"max_grad_norm": 0.0}, ValueError, "max_grad_norm must be a finite number above 0"),
    ({"max_grad_norm": float("nan")}, ValueError, "max_grad_norm"),
    ({"max_grad_norm": "1"}, TypeError, "max_grad_norm must be a number"),
    ({"accumulation": 0}, ValueError, "accumulation must be at least 1"),
    ({"accumulation": -2}, ValueError, "accumulation must be at least 1"),
    ({"accumulation": 2.5}, TypeError, "accumulation must be an integer"),
    ({"accumulation": True}, TypeError, "accumulation must be an integer"),
])
def test_bad_values_are_refused(kw, error, match):
    with pytest.raises(error, match=match):
        sj.AdamW(1e-3, **kw)


def test_apply_blocks_without_step_refuses_held_updates():
    blocks, residents = api.llama_params()
    with pytest.raises(TypeError, match="max_grad_norm and accumulation"):
        sj.Trainer(api.block_fn, blocks, block_optimizer=sj.AdamW(max_grad_norm=1.0))
