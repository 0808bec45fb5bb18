"""strata.jax executing libstrata's step plan: the chunked head-and-loss against optax's whole
one, the Trainer with the plan's choices (blocks keeping their named outputs, checkpoints in
pinned host memory, a chunked loss) against plain JAX + optax on the same init and data, the
plan made again for a new batch shape, and bad input refused.

The CPU has no memory statistics, so these tests give step_memory (the device bytes the plan
plans within) to make the library choose kept activations and host checkpoints for the tiny
Llama; each case asserts which choices the plan made, so a change in XLA's measured peak that
moves them makes the case fail, not pass vacuously. Tolerances: fp32 with the highest matmul
precision; chunking changes only the order of the loss's and the head grad's sums (a sum of
per-chunk sums, not one), so values agree to about 1e-7 relative: 1e-5 as the other parity
suites (AdamW's sqrt(v) + eps amplifies rounding in rarely used embedding rows)."""
import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402

import strata.jax as sj  # noqa: E402
import jax_parity_models as api  # noqa: E402
from llama_zoo import jax_llama as models  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
C = api.CONFIG
# The tiny Llama at 4 x 32 tokens on the CPU (XLA's predicted step peak about 2.9 MB): with
# 2.6 MB every checkpoint goes to host memory; with 4 MB the last block keeps its named
# outputs and the rest recompute (two runs of one choice: two scans).
SPILL, KEEP_SOME = 2_600_000, 4_000_000
CHUNK = 48  # does not divide the 4 x 31 tokens of the loss: the last chunk is padded


def chunked_loss(r, x, ids):
    y = models.rms_norm(x, r["norm"], C.rms_norm_eps)
    return sj.chunked_cross_entropy(y[:, :-1], r["head"], ids[:, 1:])


def trainer(blocks, residents, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the plan's "short" at SPILL
        return sj.Trainer(api.block_fn, blocks, residents, embed_fn=api.embed_fn,
                          loss_fn=chunked_loss, saved_names=models.SAVED_NAMES,
                          optimizer=optax.adamw(api.LR, weight_decay=api.WD),
                          block_optimizer=sj.AdamW(api.LR, weight_decay=api.WD), **kw)


def train_both(data, **kw):
    """Plain JAX + optax (the whole fp32 logits, every activation kept) and the Trainer on the
    same init and data: (plain losses, plain params, the trainer's losses, its plans per step,
    its params). The trainer is closed."""
    blocks, residents = api.llama_params()
    expected, final = api.plain_train(api.plain_loss, {"blocks": blocks, "res": residents},
                                      optax.adamw(api.LR, weight_decay=api.WD), data)
    with trainer(blocks, residents, **kw) as t:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            got, plans = [], []
            for ids in data:
                got.append(t.step(ids))
                plans.append(t.plan)
        # Each plan's program as JAX traced it (the FFI path's; tracing runs nothing). Its
        # jaxpr, not its HLO: on the CPU a transfer between memory kinds lowers to nothing
        # (its memory is host memory), on a GPU to XLA's host-offload annotations.
        traced = {id(p): str(jax.make_jaxpr(t._program_for(ids))(t.residents, t.opt_state, ids))
                  for p, ids in zip(plans, data)} if t.uses_ffi else {}
        got_blocks, got_res = t.get_params()
        count = len(t.plans)
    api.assert_losses(expected, got)
    api.assert_close(final["blocks"], got_blocks, what="blocks")
    api.assert_close(final["res"], got_res, what="residents")
    # It trained: the blocks moved away from their init (so the parity above is not of
    # untouched weights).
    moved = jax.tree_util.tree_map(lambda a, b: float(jnp.max(jnp.abs(a - b))), blocks,
                                   list(got_blocks))
    assert min(jax.tree_util.tree_leaves(moved)) > 1e-4
    return plans, traced, count


def test_checkpoints_in_host_memory_train_as_plain_jax():
    plans, traced, _ = train_both(api.batches(3), step_memory=SPILL, loss_chunk_tokens=CHUNK,
                                  ffi=True)  # the choices are the FFI path's
    plan = plans[-1]
    assert [b["checkpoint"] for b in plan.blocks] == ["dram"] * C.num_hidden_layers, plan.text
    assert plan.loss_chunk_tokens == CHUNK
    # Executed, not only planned: the program moves the checkpoints to pinned host memory.
    assert "pinned_host" in traced[id(plan)]


def test_kept_outputs_and_recompute_train_as_plain_jax():
    plans, traced, _ = train_both(api.batches(3), step_memory=KEEP_SOME, ffi=True)
    keeps = [b["keep"] for b in plans[-1].blocks]
    assert "selective" in keeps and "recompute" in keeps, plans[-1].text
    assert all(b["checkpoint"] == "hbm" for b in plans[-1].blocks)
    assert "pinned_host" not in traced[id(plans[-1])]


def test_host_loop_with_chunked_loss_trains_as_plain_jax():
    plans, _, _ = train_both(api.batches(2), ffi=False, loss_chunk_tokens=CHUNK)
    assert plans[-1].loss_chunk_tokens == CHUNK


def test_plan_is_made_again_for_a_new_batch_shape():
    shapes = [(4, 32), (2, 16), (4, 32)]
    data = [api.batches(1, seed=i, shape=s)[0] for i, s in enumerate(shapes)]
    plans, traced, count = train_both(data, step_memory=KEEP_SOME)
    assert count == 2  # one plan per batch shape
    assert plans[0] is plans[2] and plans[1] is not plans[0]
    # Each planned at its own batch (the dump names the tokens a checkpoint is counted at).
    assert "at 128 tokens" in plans[0].text and "at 32 tokens" in plans[1].text
    if traced:  # the FFI path (the host loop measures no step, so plans no kept blocks)
        # The smaller batch's smaller step leaves room to keep more.
        assert plans[1].kept_blocks > plans[0].kept_blocks, (plans[0].text, plans[1].text)


def head_case(seed=0, shape=(3, 37), h=16, vocab=50):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.standard_normal(shape + (h,), np.float32))
    weight = jnp.asarray(rng.standard_normal((h, vocab), np.float32) * 0.3)
    labels = jnp.asarray(rng.integers(0, vocab, shape, dtype=np.int32))
    where = jnp.asarray(rng.random(shape) > 0.3)
    return hidden, weight, labels, where


@pytest.mark.parametrize("chunk", [1, 8, 37, None, 10_000])
@pytest.mark.parametrize("masked", [False, True])
def test_chunked_cross_entropy_equals_optax(chunk, masked):
    hidden, weight, labels, where = head_case()
    where = where if masked else None

    def whole(x, w):
        losses = optax.softmax_cross_entropy_with_integer_labels((x @ w).astype(jnp.float32),
                                                                 labels)
        return jnp.mean(losses, where=where)

    def chunked(x, w):
        return sj.chunked_cross_entropy(x, w, labels, where=where, chunk_tokens=chunk)

    e, (ex, ew) = jax.value_and_grad(whole, argnums=(0, 1))(hidden, weight)
    g, (gx, gw) = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(hidden, weight)
    assert abs(float(e) - float(g)) <= 1e-6 * abs(float(e))
    api.assert_close([ex, ew], [gx, gw], rtol=1e-6, what="grads")


def test_chunked_cross_entropy_holds_one_chunk_of_logits():
    """Its compiled step (loss and grads) holds a chunk's logits, not the whole [tokens, V]."""
    hidden, weight, labels, _ = head_case(shape=(8, 128), h=16, vocab=4096)
    whole_logits = 8 * 128 * 4096 * 4

    def temp(f):
        grad = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
        return grad.lower(hidden, weight).compile().memory_analysis().temp_size_in_bytes

    chunked = temp(lambda x, w: sj.chunked_cross_entropy(x, w, labels, chunk_tokens=64))
    whole = temp(lambda x, w: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        (x @ w).astype(jnp.float32), labels)))
    assert whole >= whole_logits and chunked < whole_logits // 4, (chunked, whole)


def test_bad_input_is_refused():
    hidden, weight, labels, where = head_case()
    ce = sj.chunked_cross_entropy
    with pytest.raises(ValueError, match="head weight must be"):
        ce(hidden, weight[None], labels)
    with pytest.raises(ValueError, match="last axis"):
        ce(hidden, weight.T, labels)
    with pytest.raises(ValueError, match="labels' shape"):
        ce(hidden, weight, labels[:, :-1])
    with pytest.raises(TypeError, match="integer"):
        ce(hidden, weight, labels.astype(jnp.float32))
    with pytest.raises(ValueError, match="where's shape"):
        ce(hidden, weight, labels, where=where[0])
    with pytest.raises(ValueError, match="chunk_tokens"):
        ce(hidden, weight, labels, chunk_tokens=0)
    blocks, residents = api.llama_params()
    with pytest.raises(ValueError, match="step_memory"):
        trainer(blocks, residents, step_memory=-1)
    with pytest.raises(TypeError, match="saved_names"):
        sj.Trainer(api.block_fn, blocks, residents, embed_fn=api.embed_fn,
                   loss_fn=chunked_loss, saved_names="proj")
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        trainer(blocks, residents, loss_chunk_tokens=0)
