"""bench/dist_bench.py's choice of runs and peers, its CPU threads, its reading of a stopped run's
progress and its summary, on the CPU (issue 39 item 3); one short series end to end under gloo
on Strata's host backend (the GPU peers reported as unavailable there); a timed-out job's whole
process group killed."""
import json
import os
import pathlib
import subprocess
import sys
import time
import types

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parents[3]
BENCH = ROOT / "bench" / "dist_bench.py"

import bench_models  # noqa: E402 (bench/ is on the path: conftest.py)
import dist_job  # noqa: E402 (the job side: shapes, data, step)
import dist_bench  # noqa: E402 (bench/ is on the path: conftest.py)
import megatrain_stub  # noqa: E402


def test_parse_run_modes_and_rows():
    assert dist_bench.parse_run("strata:4") == ("strata", 4, 1)
    assert dist_bench.parse_run("strata:1:4") == ("strata", 1, 4)
    for mode in ("fsdp2", "deepspeed", "deepspeed-nvme", "megatrain"):
        assert dist_bench.parse_run(mode + ":4") == (mode, 4, 1)
    for bad in ("zero3:4", "strata", "strata:0", "fsdp2:4:2", "megatrain:2:2", "strata:1:2:3"):
        with pytest.raises(ValueError):
            dist_bench.parse_run(bad)


def test_default_runs_strata_first_slowest_peers_last():
    runs = [dist_bench.parse_run(s) for s in dist_bench.default_runs(4).split(",")]
    assert runs[:3] == [("strata", 1, 1), ("strata", 4, 1), ("strata", 1, 4)]
    assert [m for m, _, _ in runs[3:]] == ["megatrain", "deepspeed", "fsdp2", "deepspeed-nvme"]
    assert all(g == 4 and mult == 1 for _, g, mult in runs[3:])


def test_threads_per_rank_is_the_hosts_cores_over_its_gpus(monkeypatch):
    monkeypatch.setattr(dist_bench, "host_cores", lambda: 64)
    runs = [("strata", 1, 1), ("fsdp2", 4, 1)]
    args = types.SimpleNamespace(threads=0, device="cuda", host_gpus=0)
    assert dist_bench.threads_per_rank(args, runs) == 16  # not torchrun's 1
    args.host_gpus = 8
    assert dist_bench.threads_per_rank(args, runs) == 8
    args.threads = 3
    assert dist_bench.threads_per_rank(args, runs) == 3
    monkeypatch.setattr(dist_bench, "host_cores", lambda: 2)
    args = types.SimpleNamespace(threads=0, device="cpu", host_gpus=0)
    assert dist_bench.threads_per_rank(args, [("strata", 4, 1)]) == 1


def test_unavailable_peers_say_why():
    args = types.SimpleNamespace(device="cpu", megatrain_dir=None)
    assert "CUDA" in dist_bench.unavailable("deepspeed", args, {})
    assert "--megatrain-dir" in dist_bench.unavailable("megatrain", args, {})
    assert dist_bench.unavailable("strata", args, {}) is None
    assert dist_bench.unavailable("fsdp2", args, {}) is None
    args.device = "cuda"
    ok = {"version": "0.19.8", "aio": True}
    assert dist_bench.unavailable("deepspeed", args, ok) is None
    assert dist_bench.unavailable("deepspeed-nvme", args, ok) is None
    no_aio = {"version": "0.19.8", "aio": False}
    assert dist_bench.unavailable("deepspeed", args, no_aio) is None
    assert dist_bench.unavailable("deepspeed-nvme", args, no_aio).startswith("libaio missing")
    missing = {"error": "DeepSpeed not importable: ModuleNotFoundError", "aio": False}
    assert "not importable" in dist_bench.unavailable("deepspeed", args, missing)
    broken = {"version": "0.19.8", "aio": True, "cpu_adam_error": "RuntimeError: nvcc"}
    assert "DeepSpeedCPUAdam" in dist_bench.unavailable("deepspeed", args, broken)


def test_progress_lines_of_a_stopped_run(capsys):
    for i, (seconds, loss) in enumerate([(9.0, 12.5), (2.0, 12.25), (3.0, 12.0)]):
        dist_job.progress(i, 1, seconds, loss, 1000)
    err = "some log line\n" + capsys.readouterr().err
    times, losses = dist_bench.from_progress(err, 1, 1000)
    assert times == [2.0, 3.0] and losses == [12.5, 12.25, 12.0]


def test_summary_scaling_losses_and_peers():
    def run(mode, gpus, mult, tps, losses):
        out = {"mode": mode, "model": "8b", "gpus": gpus, "mult": mult, "params": 8e9}
        dist_job.measured(out, [gpus * 16384 / tps], losses, gpus * 16384, gpus)
        return out
    results = [run("strata", 1, 1, 1000.0, [2.0, 2.0]),
               run("strata", 4, 1, 4100.0, [3.0, 2.5]),
               run("strata", 1, 4, 1000.0, [3.0, 2.5 * (1 + 2e-3)]),
               run("fsdp2", 4, 1, 1000.0, [3.0, 2.6]),
               {"mode": "deepspeed", "model": "8b", "gpus": 4, "mult": 1, "skipped": "x"},
               dict(run("megatrain", 4, 1, 2050.0, [3.0, 2.5]), partial="1 measured step")]
    lines = dist_bench.summarize(results, ["8b"], 4)
    assert any("4 GPUs / 1 GPU = 4.100" in line for line in lines)
    losses = [line for line in lines if "strata losses" in line]
    assert len(losses) == 1 and "within" in losses[0] and "NOT" not in losses[0]
    assert any("fsdp2" in line and "= 4.100" in line for line in lines)
    # Skipped and partial runs are not compared.
    assert not any("deepspeed" in line or "megatrain" in line for line in lines)
    results[2]["losses"][1] = 2.5 * 1.01
    losses = [line for line in dist_bench.summarize(results, ["8b"], 4)
              if "strata losses" in line]
    assert "NOT within" in losses[0]
    table = dist_bench.markdown(results, lines, ["# header"])
    assert "| 8b deepspeed:4 | skipped: x |" in table and "(partial: 1 measured step)" in table


def test_timed_out_job_is_killed_with_its_children(tmp_path):
    pidfile = tmp_path / "child"
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "open(%r, 'w').write(str(p.pid))\n"
            "time.sleep(60)\n" % str(pidfile))
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.time() + 20
    while not pidfile.exists() or not pidfile.read_text():
        assert time.time() < deadline
        time.sleep(0.05)
    child = int(pidfile.read_text())
    dist_bench.kill_group(proc)
    assert proc.poll() is not None
    for _ in range(100):  # the grandchild is gone too (reaped by init)
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the job's child process outlived the kill")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "bindings" / "python"),
                                                      env.get("PYTHONPATH")]))
    return env


def test_plan_and_budget_run_nothing(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--models", "tiny",
                          "--gpus", "2", "--plan"], capture_output=True, text=True,
                         env=_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    names = [line.split()[0] for line in out.stdout.splitlines()[1:]]
    assert names == ["strata:1", "strata:2", "strata:1:2", "megatrain:2", "deepspeed:2",
                     "fsdp2:2", "deepspeed-nvme:2"]
    assert "CPU threads:" in out.stdout and "unavailable: no --megatrain-dir" in out.stdout
    report = tmp_path / "r.json"
    out = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--models", "tiny",
                          "--runs", "strata:1,fsdp2:2", "--budget", "1", "--json",
                          str(report)], capture_output=True, text=True, env=_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    results = json.loads(report.read_text())["results"]
    assert [r["skipped"].startswith("no time left") for r in results] == [True, True]


def test_cpu_series_end_to_end(tmp_path):
    """A short series on the host backend: Strata's job reports the threads it was given, the
    DeepSpeed peers are reported as unavailable without CUDA, MegaTrain's data-parallel
    configuration is dry-run where STRATA_MEGATRAIN_DIR names its tree."""
    if not os.environ.get("STRATA_LIBRARY"):
        pytest.skip("needs a built libstrata (STRATA_LIBRARY)")
    megatrain = os.environ.get("STRATA_MEGATRAIN_DIR")
    runs = "strata:1,deepspeed-nvme:2" + (",megatrain:2" if megatrain else "")
    report = tmp_path / "r.json"
    cmd = [sys.executable, str(BENCH), "--device", "cpu", "--models", "tiny", "--runs", runs,
           "--batch", "2", "--seq", "16", "--steps", "1", "--warmup", "1", "--threads", "1",
           "--json", str(report), "--markdown", str(tmp_path / "r.md"),
           "--logs", str(tmp_path / "logs"), "--run-timeout", "240"]
    if megatrain:
        cmd += ["--megatrain-dir", megatrain]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    got = json.loads(report.read_text())
    assert got["threads_per_rank"] == 1
    by = {r["mode"]: r for r in got["results"]}
    strata = by["strata"]
    assert "error" not in strata, strata
    assert strata["cpu_threads"] == 1 and strata["process_group"] == "gloo"
    assert len(strata["losses"]) == 2 and strata["tokens_per_second"] > 0
    assert "CUDA" in by["deepspeed-nvme"]["skipped"]
    assert "ZeRO-Infinity: skipped" in out.stdout
    assert (tmp_path / "logs" / "tiny_strata-1.log").exists()
    assert "| tiny strata:1 |" in (tmp_path / "r.md").read_text()
    if megatrain:
        mt = by["megatrain"]
        assert "over 2 devices" in mt["dry_run"], mt
        assert mt["cpu_threads"] == 2 and mt["worker_cpu_threads"] == 1


# MegaTrain's data-parallel mode as its SharedState sets it up: each parameter's grad is a
# shared-memory tensor attached once, into which the workers add every step's grads (here the
# grads of the Hugging Face model on the CPU); nothing attaches it again.
FAKE_DP_MODEL = '''
class CPUMasterModel:
    def __init__(self, hf_model, config):
        assert len(config.devices) == 2 and config.batch_size % 2 == 0
        self.hf, self.config = hf_model, config
        self.params = [p for p in hf_model.parameters()]
        self.shared = [torch.zeros_like(p) for p in self.params]
        for p, g in zip(self.params, self.shared):
            p.grad = g

    @staticmethod
    def _layer_attention_mask(mask, attn_implementation, dtype):
        return None

    def forward_and_backward(self, input_ids, attention_mask, labels):
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()
        loss = self.hf(input_ids, labels=labels).loss
        for g, d in zip(self.shared, torch.autograd.grad(loss, self.params)):
            g.add_(d)
        return loss.item(), input_ids.numel(), {"forward": 0.5, "backward": 1.5}

    def get_parameters(self):
        return self.params

    def _sync_params_to_gpu(self):
        pass

    def zero_grad(self):
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()

    def cleanup(self):
        pass
'''


def test_megatrain_data_parallel_step_trains_every_step(tmp_path, monkeypatch):
    """The peer's step over MegaTrain's data-parallel mode updates the weights on every step,
    not only the first (its train.py's optimizer.zero_grad() would detach the shared grads)."""
    import torch
    import megatrain_peer
    megatrain_stub.write(tmp_path, FAKE_DP_MODEL)
    for name in [m for m in sys.modules if m == "infinity" or m.startswith("infinity.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(megatrain_peer, "_optimizer", lambda params, config: (
        torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1), "torch.optim.AdamW"))
    config = dist_job.hf_config("tiny")
    hf = dist_job.meta_model(config)
    hf.to_empty(device="cpu")
    hf.apply(bench_models.fast_init)
    peer = megatrain_peer.setup(str(tmp_path), hf, 4, 8, 1.0, devices=[0, 1])
    assert "data parallel over 2 GPUs" in peer.info["plan"]
    ids = dist_job.data(config, 4, 8)[0]
    weight = hf.model.layers[0].mlp.up_proj.weight
    for _ in range(3):
        before = weight.detach().clone()
        peer.step(ids)
        assert not torch.equal(before, weight.detach())
    for name in [m for m in sys.modules if m == "infinity" or m.startswith("infinity.")]:
        del sys.modules[name]


def test_accumulation_and_nvme_under_data_parallel(tmp_path):
    """Issue 39 item 2a's run on the CPU: strata on 2 ranks with 2 micro-batches a step and an
    NVMe tier (one file a rank, removed after the run) reports 2 x 1 rows per GPU a step and
    its tokens over them, and its losses equal one rank's with twice the rows in 2
    micro-batches; a peer that does not accumulate here is refused before anything runs."""
    if not os.environ.get("STRATA_LIBRARY"):
        pytest.skip("needs a built libstrata (STRATA_LIBRARY)")
    report = tmp_path / "r.json"
    nvme = tmp_path / "nv"
    cmd = [sys.executable, str(BENCH), "--device", "cpu", "--models", "tiny",
           "--runs", "strata:2,strata:1:2", "--batch", "1", "--accum", "2", "--seq", "16",
           "--steps", "2", "--warmup", "1", "--threads", "1", "--strata-nvme", str(nvme),
           "--json", str(report), "--run-timeout", "240"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    by = {(r["gpus"], r.get("mult", 1)): r for r in json.loads(report.read_text())["results"]}
    two, one = by[(2, 1)], by[(1, 2)]
    for r in (two, one):
        assert "error" not in r, r
        assert r["micro_batches"] == 2 and len(r["losses"]) == 3
        assert r["nvme"].startswith(str(nvme))
        # the arena's pinned part (sized by the library) holds every block the GPU's copies
        # touch: nothing fell back to the unpinned part
        assert r["dram_fallbacks"] == 0 and 0 < r["dram_pinned_gb"][0] <= r["dram_pinned_gb"][1]
        assert r["dram_pinned_gb"][1] < r["dram_pinned_gb"][2]
        # tokens a step: rows per GPU a step x GPUs x sequence
        tokens = r["rows_per_gpu"] * r["gpus"] * 16
        assert r["tokens_per_second"] == pytest.approx(tokens / r["step_seconds"])
    assert two["rows_per_gpu"] == 2 and one["rows_per_gpu"] == 4
    assert dist_bench.max_relative(two["losses"], one["losses"]) <= dist_bench.BF16_TOLERANCE
    assert "within bf16" in out.stdout
    assert list(nvme.iterdir()) == []  # each run's directory, every rank's file in it, removed
    refused = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--models", "tiny",
                              "--runs", "strata:2,deepspeed:2", "--accum", "2", "--plan"],
                             capture_output=True, text=True, env=_env(), timeout=60)
    assert refused.returncode == 2 and "only strata and fsdp2 runs accumulate" in refused.stderr
    one = subprocess.run([sys.executable, str(BENCH), "--one", "deepspeed", "tiny", "--device",
                          "cpu", "--accum", "2"], capture_output=True, text=True, env=_env(),
                         timeout=60)
    assert one.returncode == 2 and "only strata and fsdp2 runs accumulate" in one.stderr


def test_first_error_names_the_exception_a_rank_raised():
    """The run's error is the exception, not the progress line before it nor torchrun's summary;
    Strata's exceptions are named for their status (no "Error" in the name): the 40B run of the
    22nd session was reported as its progress line."""
    stderr = "\n".join([
        "progress: strata: 4 ranks, 16 CPU threads each, process group nccl",
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "/work/main/bench/dist_bench.py", line 212, in run_job',
        "[rank0]:     loss = step(ids).detach().float().reshape(())",
        "[rank0]: strata.errors.OutOfMemory: OUT_OF_MEMORY: strata_step_begin: gradient "
        "accumulation needs an fp32 sum per parameter",
        "W1128 07:50:11.133000 1733 torch/distributed/elastic/multiprocessing/api.py:1012] "
        "Sending process 1768 closing signal SIGTERM",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "Root Cause (first observed failure):",
    ])
    assert dist_bench.first_error(stderr, 1) == (
        "strata.errors.OutOfMemory: OUT_OF_MEMORY: strata_step_begin: gradient accumulation "
        "needs an fp32 sum per parameter")
    assert dist_bench.first_error("[rank1]: ValueError: bad rows\n", 1) == "ValueError: bad rows"
    # Nothing raised: the first line, or the exit status.
    assert dist_bench.first_error("progress: strata: 2 ranks\n", 1) == \
        "progress: strata: 2 ranks"
    assert dist_bench.first_error("", 9) == "exit 9"
