"""The Hugging Face Trainer under torchrun (issue 52, item 4): strata.torch.StrataTrainer trains an
offloaded model data parallel through strata.torch's own data parallelism (no DDP). On the CPU:
ranks are processes under the gloo group accelerate creates from torchrun's environment
variables, each running tests/python/torch_trainer_dist_worker.py on the tiny Hugging Face
Llama, the Trainer's shuffled sampler, a cosine warm-up and max_grad_norm (it binds).

- 2 ranks with per-device batch b train like one process with batch 2b over the same rows:
  every micro-batch's loss (the ranks' mean) within 1e-6, the logged grad norms within 1e-6,
  the weights within 1e-5 (DDP itself departs that far from one process: a batch's grad
  summed in two halves rounds differently; test_torch_distributed.py measures it); with and
  without gradient accumulation.
- The plain Trainer's DDP over the plain model with torch's AdamW, 2 ranks, is the oracle of
  the same run: losses within 1e-6, weights within 2e-6 (test_torch_distributed.py's bounds).
- trainer.save_model() under data parallelism (collective gathers joined by every rank)
  writes what from_pretrained loads back as the trained weights; the Trainer's checkpoint
  (save_steps) resumed by a freshly initialized model continues bit for bit.
- The plain transformers.Trainer over an offloaded model under 2 ranks is refused on every rank
  with strata.torch's DDP message, which names StrataTrainer; StrataTrainer over a model that
  is not data parallel over the Trainer's processes is refused, saying why."""

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it
if not dist.is_available():
    pytest.skip("torch without distributed support", allow_module_level=True)
import torch_trainer_dist_worker as worker  # noqa: E402
import rank_launch  # noqa: E402
from torch_parity_models import assert_losses_close, assert_state_close  # noqa: E402

BATCH, STEPS, CLIP = 2, 3, 0.05  # the clip binds: every step scales the grads


def run(tmp_path, name, world, limit=180, **options):
    """`world` ranks of the worker; (exit codes, output texts). A rank still running at
    `limit` s is a hang: killed, and the test fails."""
    out = str(tmp_path / name)
    argv = ["--world", str(world), "--port", str(rank_launch.free_port()), "--out", out,
            "--batch", str(BATCH), "--steps", str(STEPS), "--clip", str(CLIP)]
    for k, v in options.items():
        argv += ["--" + k.replace("_", "-")] + ([] if v is True else [str(v)])
    ctx = rank_launch.forkserver("torch", "torch.distributed", "torch._dynamo", "transformers",
                                 "strata.torch", "torch_trainer_dist_worker")
    codes, texts, late = rank_launch.launch(ctx, worker.entry, argv, world, out, limit)
    assert not late, "a rank hung:\n%s" % "\n".join(t[-2000:] for t in texts)
    return codes, texts, out


def train(tmp_path, name, world, **options):
    codes, texts, out = run(tmp_path, name, world, **options)
    assert codes == [0] * world, "ranks failed: %s\n%s" % (codes, "\n".join(
        t[-3000:] for t in texts))
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("accumulate", [1, 2], ids=["one_micro_batch", "accumulated"])
def test_two_ranks_train_like_one_process_with_twice_the_batch_and_like_ddp(
        tmp_path, accumulate):
    got = train(tmp_path, "strata", 2, accumulate=accumulate, save=True, checkpoint_at=2)
    one = train(tmp_path, "one", 1, accumulate=accumulate, batch=2 * BATCH)
    ddp = train(tmp_path, "ddp", 2, accumulate=accumulate, mode="plain")
    assert len(got["losses"]) == STEPS * accumulate and len(got["norms"]) == STEPS
    assert got["losses"][-1] < got["losses"][0]  # it learns
    mine, theirs = got["rank_losses"]
    assert all(a != b for a, b in zip(mine, theirs))  # each rank its own rows
    assert_losses_close(got["losses"], one["losses"])
    assert_losses_close(got["norms"], one["norms"])
    assert all(n > CLIP for n in got["norms"])  # the clip bound every step
    assert_state_close(got["state"], one["state"], atol=1e-5, rtol=0)
    assert_losses_close(got["losses"], ddp["losses"])
    assert_losses_close(got["norms"], ddp["norms"])
    assert_state_close(got["state"], ddp["state"], atol=2e-6, rtol=0)
    # save_model under data parallelism: the trained weights, as from_pretrained reads them.
    assert_state_close(got["reloaded"], got["state"], exact=True)
    # A checkpoint the Trainer saved after step 2 (every rank joining the collective gathers of
    # the weights and the optimizer state), resumed by a freshly initialized model: the rest
    # of the run again, bit for bit.
    assert got["resumed"] == got["losses"][2 * accumulate:]
    assert_state_close(got["resumed_state"], got["state"], exact=True)


def refusal(tmp_path, mode):
    """Rank 0's traceback of what the worker's `mode` refused (the ranks exit cleanly)."""
    codes, texts, out = run(tmp_path, mode, 2, mode=mode)
    assert codes == [0, 0], "\n".join(t[-3000:] for t in texts)
    error = torch.load(out, weights_only=True)["error"]
    assert error is not None, "nothing was refused"
    return error


def test_the_plain_trainer_under_two_ranks_is_refused_naming_strata_trainer(tmp_path):
    error = refusal(tmp_path, "refused")
    assert "torch.nn.parallel.DistributedDataParallel cannot wrap an offloaded model" in error
    assert "use strata.torch.StrataTrainer in place of transformers.Trainer" in error, error


def test_strata_trainer_refuses_a_model_that_is_not_data_parallel_over_its_processes(
        tmp_path):
    # offload(data_parallel=False) under 2 processes: each rank would train its own model on
    # its own share of the batches.
    error = refusal(tmp_path, "unshared")
    assert "RuntimeError: strata.torch.StrataTrainer: the Trainer runs 2 processes" in error
    assert "averages its grads over 1 rank(s) (it was offloaded before torch.distributed was " \
           "initialized, or with data_parallel=False)" in error, error
