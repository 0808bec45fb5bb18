#!/usr/bin/env python3
"""strata.jax data parallel on several GPUs (one process each under jax.distributed) against
one GPU: tokens/s and losses of the Llama of llama_zoo through strata.jax's Trainer.

    python bench/jax_dp_bench.py --model 1b --world 2 --batch 16 --seq 1024 --steps 5
    python bench/jax_dp_bench.py --model tiny --world 2 --batch 2 --seq 64 --cpu   # a smoke run

Three runs, each in processes of its own: one process on --batch rows (the per-GPU baseline),
--world processes on --batch rows each (CUDA_VISIBLE_DEVICES: one GPU each), and one process on
--world x --batch rows (the losses' reference: data parallel must give its losses;
--no-reference skips it where that batch does not fit one GPU). Every run starts from the same
weights (bench/jax_bench.py's DeviceBlocks, seed 0) and trains on the same two batches in turn.
Prints each run's tokens/s, the speedup over one GPU and the largest relative loss difference
from the reference; --json writes them. --cpu: every process on the CPU (gloo collectives)."""
import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bindings" / "python"))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # Strata's arena needs room


def rank_main(args):
    """One process of a run: trains, and rank 0 writes its step times and losses."""
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    if args.cpu:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.world > 1:
        jax.distributed.initialize("127.0.0.1:%d" % args.port, args.world, args.rank)
    import jax.numpy as jnp
    import numpy as np
    from jax_bench import DeviceBlocks
    from llama_zoo import jax_llama as models
    from llama_zoo.jax_trainer import StreamedTrainer

    config = models.PRESETS[args.model]
    lazy = DeviceBlocks(config, seed=0)
    trainer = StreamedTrainer(config, lazy, lazy.residents(), lr=1e-4, weight_decay=0.1,
                              dtype=jnp.bfloat16, data_parallel=args.world > 1)
    rng = np.random.default_rng(0)
    data = [rng.integers(0, config.vocab_size, (args.total_rows, args.seq), dtype=np.int32)
            for _ in range(2)]
    mine = slice(args.rank * args.batch, (args.rank + 1) * args.batch)  # this process's rows
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        losses.append(trainer.step(data[i % 2][mine]))
        times.append(time.perf_counter() - t0)
    trainer.close()
    if args.rank == 0:
        with open(args.out, "w") as f:
            json.dump({"times": times, "losses": losses, "device": str(jax.local_devices()[0]),
                       "describe": trainer.data_parallel.describe()
                       if trainer.data_parallel is not None else "one process"}, f)


def run(args, world, batch, total_rows):
    """A run of `world` processes of `batch` rows each: (its rank 0's results, seconds)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(suffix=".json")
    procs = []
    for rank in range(world):
        env = dict(os.environ)
        if not args.cpu:
            env["CUDA_VISIBLE_DEVICES"] = str(rank)
        cmd = [sys.executable, __file__, "--one", "--rank", str(rank), "--world", str(world),
               "--port", str(port), "--out", out, "--model", args.model, "--batch", str(batch),
               "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--total-rows", str(total_rows)] + (["--cpu"] if args.cpu else [])
        procs.append(subprocess.Popen(cmd, env=env))
    deadline = time.monotonic() + args.timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append("timeout")
    if any(c != 0 for c in codes):
        return {"error": "exit codes %s" % codes}
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    t = statistics.median(result["times"][args.warmup:])
    result.update(world=world, rows_per_process=batch, step_seconds=t,
                  tokens_per_second=world * batch * args.seq / t)
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="1b")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--batch", type=int, default=16, help="rows per process")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--total-rows", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        return rank_main(args)
    rows = args.world * args.batch
    results = {"one_gpu": run(args, 1, args.batch, rows),
               "data_parallel": run(args, args.world, args.batch, rows)}
    if not args.no_reference:
        results["reference"] = run(args, 1, rows, rows)
    for name, r in results.items():
        print("%-14s %s" % (name, r.get("error") or "%d x %d rows: %.0f tokens/s (%.3f s a step)"
                            " losses %s" % (r["world"], r["rows_per_process"],
                                            r["tokens_per_second"], r["step_seconds"],
                                            ["%.5f" % v for v in r["losses"]])))
    one, dp = results["one_gpu"], results["data_parallel"]
    if "error" not in one and "error" not in dp:
        results["speedup"] = dp["tokens_per_second"] / one["tokens_per_second"]
        print("speedup over one GPU: %.2fx" % results["speedup"])
    ref = results.get("reference", {})
    if "error" not in dp and ref and "error" not in ref:
        results["max_loss_rel_diff"] = max(abs(a - b) / abs(b)
                                           for a, b in zip(dp["losses"], ref["losses"]))
        print("largest relative loss difference from one process on every row: %.2e"
              % results["max_loss_rel_diff"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
