"""bench/moe_bench.py on the CPU (--dry-run: a tiny Qwen3-MoE of the same structure): strata,
the resident model and the MegaTrain peer (a stand-in `infinity` package whose training is the
Hugging Face model's own: MegaTrain needs CUDA and is not part of the repository), each
result's JSON line checked field by field; the parameter counts the TFLOPS figures use, for
Qwen3-30B-A3B's layer shape, against the model transformers builds."""
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3MoeForCausalLM"):
    pytest.skip("transformers %s has no Qwen3-MoE" % transformers.__version__,
                allow_module_level=True)

import megatrain_stub  # noqa: E402
import moe_bench  # noqa: E402 (bench/ is on the tests' path)

BENCH = pathlib.Path(moe_bench.__file__)


def run_bench(tmp_path, *args):
    jsonl = tmp_path / "results.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(BENCH), "--dry-run", "--batch", "2", "--seq",
                           "32", *args, "--jsonl", str(jsonl)],
                          capture_output=True, text=True, env=env, timeout=600)
    results = [json.loads(line) for line in jsonl.read_text().splitlines()] \
        if jsonl.exists() else []
    return proc, results


def test_counts_are_the_models():
    """Every parameter as transformers builds the model (Qwen3-30B-A3B's shape, 10 layers:
    6.85B); the active ones: all but the experts a token does not use and the embedding."""
    for config in (moe_bench.moe_config(10, 0.001), moe_bench.moe_config(2, 0.0, tiny=True)):
        with torch.device("meta"):
            model = transformers.Qwen3MoeForCausalLM(config)
        total, active, attention = moe_bench.counts(config)
        assert total == sum(p.numel() for p in model.parameters())
        idle = config.num_experts - config.num_experts_per_tok
        unused = sum(p.numel() // config.num_experts * idle for n, p in model.named_parameters()
                     if ".experts." in n)
        assert active == total - unused - model.get_input_embeddings().weight.numel()
        assert attention == 2 * config.num_attention_heads * config.head_dim * \
            config.num_hidden_layers
    assert round(moe_bench.counts(moe_bench.moe_config(10, 0.001))[0] / 1e9, 2) == 6.85


def test_dry_run_strata_resident_and_megatrain(tmp_path):
    tree = megatrain_stub.write(tmp_path / "megatrain", megatrain_stub.PLAIN_TRAINING)
    proc, results = run_bench(tmp_path, "--modes", "strata,resident", "--peer", "megatrain",
                              "--megatrain-dir", str(tree))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r["mode"] for r in results] == ["strata", "resident", "megatrain"]
    config = moe_bench.moe_config(2, 0.001, tiny=True)
    total, active, attention = moe_bench.counts(config)
    for r in results:
        assert "error" not in r, r
        assert (r["model"], r["batch"], r["seq"], r["router_loss"]) == \
            ("qwen3-moe-2L-tiny", 2, 32, 0.001)
        assert (r["params"], r["active_params"]) == (total, active)
        assert len(r["losses"]) == 3 and all(math.isfinite(x) for x in r["losses"])
        # A seeded init of every weight (the experts' and the router's too): the first loss is
        # near ln(vocab) for all three, from the same weights.
        assert r["losses"][0] == pytest.approx(math.log(config.vocab_size), rel=0.05)
        assert r["losses"][0] == pytest.approx(results[0]["losses"][0], rel=1e-3)
        t = r["median_step_seconds"]
        assert r["tokens_per_second"] == pytest.approx(64 / t)
        assert r["tflops_6pt_active"] == pytest.approx(6 * active * 64 / t / 1e12)
        assert r["tflops_attention"] == pytest.approx(3 * attention * 32 * 64 / t / 1e12)
        assert r["peak_host_bytes"] > 0
        assert "a step" in proc.stdout
    assert results[0]["experts_implementation"] == "grouped_mm"  # Hugging Face's default
    assert results[2]["optimizer"]  # the peer's own report


def test_arguments_refused(tmp_path):
    proc, _ = run_bench(tmp_path, "--peer", "megatrain")
    assert proc.returncode != 0 and "--megatrain-dir" in proc.stderr
    proc, _ = run_bench(tmp_path, "--modes", "fsdp2")
    assert proc.returncode != 0 and "fsdp2" in proc.stderr
