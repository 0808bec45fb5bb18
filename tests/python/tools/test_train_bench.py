"""bench/train_bench.py on the CPU (its --device cpu check, the tiny preset): Hugging Face's
LlamaForCausalLM through strata.torch as one batch and as micro-batches, and the MegaTrain peer's
driving of its API (against a stand-in `infinity` package that trains the same model with plain
PyTorch: MegaTrain itself needs CUDA and is not part of the repository), each result's JSON
line checked field by field."""
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import megatrain_stub  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[3]
BENCH = ROOT / "bench" / "train_bench.py"

# MegaTrain's API as bench/megatrain_peer.py drives it, its training the Hugging Face model's
# own on the CPU (megatrain_stub.PLAIN_TRAINING).
FAKE_MODEL = megatrain_stub.PLAIN_TRAINING

COMMON = ["--models", "tiny", "--device", "cpu", "--batch", "4", "--seq", "32", "--steps", "2",
          "--warmup", "0", "--clip", "1.0"]


def run_bench(tmp_path, *args):
    """The driver run with these arguments; its JSON lines (--jsonl) and its stdout."""
    jsonl = tmp_path / ("results-%d.jsonl" % len(list(tmp_path.glob("results-*"))))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(BENCH), *COMMON, *args, "--jsonl", str(jsonl),
                           "--logs", str(tmp_path / "logs")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads(line) for line in jsonl.read_text().splitlines()]
    for r in results:
        assert "error" not in r, (r, "\n".join(
            p.read_text() for p in (tmp_path / "logs").glob("*.log")))
    return results, proc.stdout


def check_measured(r, accum):
    """The fields every measured configuration reports, consistent with each other."""
    assert (r["model"], r["batch"], r["seq"], r["accum"], r["clip"]) == ("tiny", 4, 32, accum, 1.0)
    assert r["tokens_per_step"] == 4 * 32
    assert r["params"] == 250432  # tiny: every parameter, the embedding and the head included
    assert len(r["losses"]) == 2 and all(math.isfinite(x) and x > 0 for x in r["losses"])
    assert len(r["every_step_seconds"]) == 2
    assert r["step_seconds"] > 0
    assert r["tokens_per_second"] == pytest.approx(4 * 32 / r["step_seconds"])
    assert r["tflops_6pt"] == pytest.approx(6 * r["params"] * 4 * 32 / r["step_seconds"] / 1e12)
    assert r["tflops_done"] > r["tflops_6pt"]
    assert r["peak_host_gb"] > 0
    assert isinstance(r["placement"], str) and r["placement"]


@pytest.fixture(scope="module")
def one_batch(tmp_path_factory):
    """Strata, then the MegaTrain peer (the stand-in), on the whole batch: (results, stdout)."""
    tmp_path = tmp_path_factory.mktemp("one_batch")
    tree = megatrain_stub.write(tmp_path / "megatrain", FAKE_MODEL)
    return run_bench(tmp_path, "--modes", "strata", "--peer", "megatrain",
                     "--megatrain-dir", str(tree))


def test_strata_one_batch_and_megatrain_peer(one_batch):
    results, stdout = one_batch
    strata, peer = results
    assert (strata["mode"], strata["impl"]) == ("strata", "hf")
    check_measured(strata, 1)
    assert "optimizer state" in strata["placement"]  # model.strata.placement()
    # The setup in its three parts, each within the whole.
    split = strata["setup_split"]
    assert set(split) == {"build", "offload", "optimizer"} and min(split.values()) >= 0
    assert sum(split.values()) <= strata["setup_seconds"]
    assert "model on meta" in stdout
    assert (peer["mode"], peer["impl"]) == ("megatrain", "megatrain")
    check_measured(peer, 1)
    assert peer["optimizer"].startswith(("DeepSpeedCPUAdam", "torch.optim.AdamW"))
    assert peer["megatrain_forward_backward_seconds"] == [0.5, 1.5]  # its own timings
    # The same model (fast_init's weights) on the same batch: the first losses agree (Strata's
    # bf16 compute from fp32 masters, the stand-in's bf16 model).
    assert peer["losses"][0] == pytest.approx(strata["losses"][0], rel=1e-4)
    assert "strata / megatrain" in stdout and "losses" in stdout


def test_strata_micro_batches(tmp_path, one_batch):
    (r,), stdout = run_bench(tmp_path, "--modes", "strata", "--accum", "2")
    assert (r["mode"], r["impl"]) == ("strata", "hf")
    check_measured(r, 2)
    assert "as 2 micro-batches of 2" in stdout
    # A step's loss is its micro-batches' mean: the first step's, from the same weights, is
    # the whole batch's.
    whole = one_batch[0][0]
    assert r["losses"][0] == pytest.approx(whole["losses"][0], rel=1e-3)


def test_megatrain_arguments_refused(tmp_path):
    def fails(*args):
        proc = subprocess.run([sys.executable, str(BENCH), *COMMON, *args], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode != 0
        return proc.stderr
    assert "--megatrain-dir" in fails("--modes", "", "--peer", "megatrain")
    assert "--accum 1 only" in fails("--peer", "megatrain", "--megatrain-dir", str(tmp_path),
                                     "--accum", "2")
    # A tree without MegaTrain's package, then one without the sdpa mask patch.
    import megatrain_peer
    with pytest.raises(SystemExit, match="no infinity/ package"):
        megatrain_peer.load(str(tmp_path / "none"))
    unpatched = tmp_path / "unpatched"
    (unpatched / "infinity" / "model").mkdir(parents=True)
    (unpatched / "infinity" / "__init__.py").write_text("")
    (unpatched / "infinity" / "model" / "__init__.py").write_text("")
    (unpatched / "infinity" / "model" / "cpu_master.py").write_text("class CPUMasterModel:\n"
                                                                    "    pass\n")
    try:
        with pytest.raises(SystemExit, match="lacks the sdpa attention-mask patch"):
            megatrain_peer.load(str(unpatched))
    finally:
        sys.path.remove(str(unpatched))
        for name in [n for n in sys.modules if n == "infinity" or n.startswith("infinity.")]:
            del sys.modules[name]


@pytest.mark.skipif(not os.environ.get("STRATA_MEGATRAIN_DIR"),
                    reason="STRATA_MEGATRAIN_DIR: MegaTrain's patched source tree")
def test_megatrain_dry_run(tmp_path):
    """MegaTrain itself (not in the repository): imported, configured, and its layers run on the
    CPU with the patched mask equal the model's own forward pass."""
    (r,), stdout = run_bench(tmp_path, "--modes", "", "--peer", "megatrain", "--megatrain-dir",
                             os.environ["STRATA_MEGATRAIN_DIR"], "--dry-run")
    assert r["mode"] == "megatrain" and "dry run" in stdout
    assert r["layer_max_abs_diff"] < 1e-2
