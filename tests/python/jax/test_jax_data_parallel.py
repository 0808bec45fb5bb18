"""strata.jax data parallel against one process with the rows of all: two processes of a
jax.distributed job on the CPU (gloo collectives; tests/python/support/jax_dp_worker.py) train
the tiny Llama through strata.jax.Trainer, each on its half of every step's rows, and must give
the losses and the parameters of one strata.jax process (and of plain JAX + optax) trained on
all the rows, with the blocks' state shared out between the two (each runtime holds half of
it) or, with shard_size=1, a full copy in each. Not bit for bit: each rank's grads are the mean
over its own rows and the two means are averaged, where one process sums all the rows in one
reduction, so the grads differ by float rounding (fp32 tolerance, as the other parity tests).
A rank that dies mid-job stops the other promptly, with strata.jax.DataParallelError."""
import os

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax_dp_worker as worker  # noqa: E402
import jax_parity_models as api  # noqa: E402
import rank_launch  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
WORLD, ROWS, STEPS = 2, 2, 3
LIMIT = 240  # seconds for a launch: two processes compiling the step on two busy cores


def launch(tmp_path, *extra, limit=LIMIT):
    out = str(tmp_path / "dp")
    argv = ["--world", str(WORLD), "--port", str(rank_launch.free_port()), "--out", out,
            "--rows", str(ROWS), "--steps", str(STEPS)] + list(extra)
    ctx = rank_launch.forkserver("numpy")
    codes, texts, late = rank_launch.launch(ctx, worker.entry, argv, WORLD, out, limit)
    return out, codes, texts, late


def one_process(clip=None, k=1):
    """strata.jax in this process on every row, and plain JAX + optax: (losses and then the
    first batch's evaluate() after training, params, the bytes of block weights its runtime
    holds)."""
    import strata.jax as sj
    blocks, residents = api.llama_params()
    data = api.batches(STEPS, shape=(ROWS * WORLD, 32))
    plain_opt = optax.adamw(api.LR, weight_decay=api.WD)
    if clip:
        plain_opt = optax.chain(optax.clip_by_global_norm(clip), plain_opt)
    plain, final = api.plain_train(api.plain_loss, {"blocks": blocks, "res": residents},
                                   optax.MultiSteps(plain_opt, k) if k > 1 else plain_opt, data)
    adamw = sj.AdamW(api.LR, weight_decay=api.WD, max_grad_norm=clip, accumulation=k)
    with sj.Trainer(api.block_fn, blocks, residents, embed_fn=api.embed_fn, loss_fn=api.loss_fn,
                    optimizer=optax.adamw(api.LR, weight_decay=api.WD),
                    block_optimizer=adamw) as trainer:
        losses = [trainer.step(ids) for ids in data]
        evaluated = trainer.evaluate(data[0])
        got_blocks, got_res = trainer.get_params()
        held = sum(int(w.info().nbytes) for ws in trainer.weights for w in ws)
    api.assert_losses(plain, losses)
    assert evaluated < losses[0]
    api.assert_close(final["blocks"], got_blocks, what="blocks")
    return losses + [evaluated], jax.tree_util.tree_leaves((got_blocks, got_res)), held


# Each case is two processes compiling the step (about a minute on two busy cores): the
# replicas' case also sends the checkpoints to host memory.
@pytest.mark.parametrize("shard_size,step_memory", [(0, 0), (1, 1_000_000)],
                         ids=["shared_per_host", "replicas_checkpoints_in_host_memory"])
def test_two_processes_train_as_one_with_the_rows_of_both(tmp_path, shard_size, step_memory):
    out, codes, texts, late = launch(tmp_path, "--shard-size", str(shard_size),
                                     "--step-memory", str(step_memory))
    assert codes == [0] * WORLD and not late, "\n\n".join(texts)
    losses, leaves, held_one = one_process()
    ranks = [np.load("%s.rank%d.npz" % (out, r)) for r in range(WORLD)]
    for r, got in enumerate(ranks):
        api.assert_losses(losses, list(got["losses"]) + [float(got["evaluated"])])
        for i, expected in enumerate(leaves):
            e, g = np.asarray(expected, np.float64), got["leaf%d" % i].astype(np.float64)
            err = np.linalg.norm(e - g) / max(np.linalg.norm(e), 1e-30)
            assert err <= 1e-5, (r, i, err)
    assert losses[-2] < losses[0]  # it trains
    for got in ranks:
        # 1 MB for the tiny Llama's step: the plan sends every checkpoint to host memory (the
        # transfer inside the shard_map names the memory space; a no-op on the CPU, whose
        # device memory is host memory); without, none.
        assert set(got["homes"]) == {"dram" if step_memory else "hbm"}, got["homes"]
        # shard_size 0: the two processes of this host share one copy of the blocks' state
        # (each holds its chunk: half, plus the padding to 64 elements); 1: each a full copy.
        if shard_size == 1:
            assert int(got["held"]) == held_one, str(got["describe"])
        else:
            assert held_one / 2 <= int(got["held"]) < held_one / 2 + held_one / 20, \
                (int(got["held"]), held_one, str(got["describe"]))


def test_clipping_and_accumulation_over_the_ranks(tmp_path):
    """The global norm over every rank's chunks and the replicated residents, and micro-batches
    accumulated in each rank's chunks, as one process with every row (and as optax)."""
    out, codes, texts, late = launch(tmp_path, "--clip", "0.25", "--accumulation", "3")
    assert codes == [0] * WORLD and not late, "\n\n".join(texts)
    losses, leaves, _ = one_process(clip=0.25, k=3)
    for r in range(WORLD):
        got = np.load("%s.rank%d.npz" % (out, r))
        api.assert_losses(losses, list(got["losses"]) + [float(got["evaluated"])])
        for i, expected in enumerate(leaves):
            e, g = np.asarray(expected, np.float64), got["leaf%d" % i].astype(np.float64)
            assert np.linalg.norm(e - g) <= 1e-5 * max(np.linalg.norm(e), 1e-30), (r, i)


def test_a_rank_that_dies_stops_the_other_promptly(tmp_path):
    out, codes, texts, late = launch(tmp_path, "--fail-at", "1", limit=180)
    assert not late, "a rank hung after its peer died:\n" + "\n\n".join(texts)
    assert codes[WORLD - 1] == 3, texts[WORLD - 1]
    assert codes[0] != 0, texts[0]
    # The survivor's step failed in a collective (gloo: the peer's connection reset) and said so.
    assert "DataParallelError" in texts[0] and "rank 0 of 2" in texts[0], texts[0]
    assert not os.path.exists("%s.rank0.npz" % out)


def test_data_parallel_needs_several_processes():
    import strata.jax as sj
    blocks, residents = api.llama_params()
    with pytest.raises(ValueError, match="jax.distributed.initialize"):
        api.llama_trainer(blocks, residents, data_parallel=True)
    with pytest.raises(ValueError, match="shard_size"):
        sj.DataParallel(shard_size=0)
    with pytest.raises(TypeError, match="data_parallel"):
        api.llama_trainer(blocks, residents, data_parallel="yes")
