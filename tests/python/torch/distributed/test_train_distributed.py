"""strata-train under torchrun (issue 52, item 1): 2 CPU processes over gloo, each with its own
Strata runtime (host backend), train like one process with both ranks' rows: each rank reads
its half of every global micro-batch, the step's token count is summed over the ranks and
strata.torch averages the grads (DDP's semantics); the losses and the exported weights equal
the one-process run's within the data-parallel suite's tolerances (a batch's grad summed in
two halves rounds differently)."""
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")
if not torch.distributed.is_available():
    pytest.skip("torch without distributed support", allow_module_level=True)

import rank_launch  # noqa: E402
from strata.train import config, loop  # noqa: E402
from strata.train.metrics import read as read_metrics  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[4]


def losses(output):
    return [r["loss"] for r in read_metrics(os.path.join(output, "metrics.jsonl"))
            if "loss" in r]


def test_two_ranks_train_like_one_process(tmp_path, one_torch_thread):
    cfg = transformers.AutoConfig.from_pretrained(str(config.DEFAULT_DIR))
    cfg.num_hidden_layers = 2
    torch.manual_seed(5)
    checkpoint = tmp_path / "ckpt"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(checkpoint))
    transformers.AutoTokenizer.from_pretrained(str(config.DEFAULT_DIR)).save_pretrained(
        str(checkpoint))
    common = ["--model", checkpoint, "--max-steps", 3, "--accumulation", 2, "--lr", 2e-3,
              "--warmup-steps", 1, "--clip", 0.5, "--seq-len", 64, "--device", "cpu",
              "--threads", "1", "--eval-split", 0.05]
    one = tmp_path / "one"
    assert loop.main([str(a) for a in common + ["--micro-batch", 4, "--output", one]]) == 0
    two = tmp_path / "two"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "bindings" / "python"), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(rank_launch.free_port()), "-m", "strata.train"] +
        [str(a) for a in common + ["--micro-batch", 2, "--output", two]],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    a, b = losses(one), losses(two)
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-6 * abs(x), (a, b)
    from safetensors.torch import load_file
    w1 = load_file(str(one / "model" / "model.safetensors"))
    w2 = load_file(str(two / "model" / "model.safetensors"))
    assert set(w1) == set(w2)
    for name in w1:
        assert torch.allclose(w1[name], w2[name], atol=1e-5, rtol=1e-5), name
