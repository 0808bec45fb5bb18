#!/usr/bin/env python3
"""JAX training through Strata next to the same model fully resident in JAX, same run (each in
its own process): tokens/s with bf16 compute and fp32 masters, per-block recomputation in both.

    python bench/jax_bench.py --model 1b --batch 8 --seq 2048 --steps 5
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bindings" / "python"))
# XLA would take 75% of the GPU's memory up front; Strata's arena needs its share.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def run_one(mode, preset, batch, seq, steps, warmup):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from llama_zoo import jax_llama as models
    from llama_zoo.jax_trainer import StreamedTrainer

    config = models.PRESETS[preset]
    blocks, residents = models.init_params(config, seed=0)
    rng = np.random.default_rng(0)
    data = [rng.integers(0, config.vocab_size, (batch, seq), dtype=np.int32) for _ in range(2)]
    if mode == "strata":
        trainer = StreamedTrainer(config, blocks, residents, lr=1e-4, weight_decay=0.1,
                                  dtype=jnp.bfloat16)
        del blocks
        step = trainer.step
    else:
        params = {"blocks": [{k: jnp.asarray(v) for k, v in b.items()} for b in blocks],
                  "res": {k: jnp.asarray(v) for k, v in residents.items()}}
        del blocks
        m = jax.tree_util.tree_map(jnp.zeros_like, params)
        v = jax.tree_util.tree_map(jnp.zeros_like, params)

        def loss(p, ids):
            p = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), p)
            x = p["res"]["embed"][ids]
            cos, sin = models.rotary(config, ids.shape[1], x.dtype)
            block = jax.checkpoint(lambda bp, x_: models.block_forward(config, bp, x_, cos, sin))
            for bp in p["blocks"]:
                x = block(bp, x)
            return models.head_loss(config, p["res"], x, ids)

        @jax.jit
        def train(p, m, v, t, ids):
            value, g = jax.value_and_grad(loss)(p, ids)
            out = jax.tree_util.tree_map(
                lambda p_, g_, m_, v_: models.adamw(p_, g_.astype(jnp.float32), m_, v_, t, 1e-4,
                                                    wd=0.1), p, g, m, v)
            leaves = lambda i: jax.tree_util.tree_map(lambda o: o[i], out,  # noqa: E731
                                                      is_leaf=lambda o: isinstance(o, tuple))
            return value, leaves(0), leaves(1), leaves(2)

        state = {"p": params, "m": m, "v": v, "t": 0}

        def step(ids):
            state["t"] += 1
            value, state["p"], state["m"], state["v"] = train(state["p"], state["m"], state["v"],
                                                              state["t"], jnp.asarray(ids))
            return float(value)
    times, losses = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        losses.append(step(data[i % 2]))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    six_p, _ = models.flops_per_token(config, seq)
    return {"mode": mode, "model": preset, "tokens_per_second": batch * seq / t,
            "tflops_6pt": six_p * batch * seq / t / 1e12, "step_seconds": t, "losses": losses,
            "device": str(jax.devices()[0])}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="1b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.model, args.batch, args.seq, args.steps,
                                 args.warmup)), flush=True)
        return
    results = {}
    for mode in ("strata", "resident"):
        proc = subprocess.run([sys.executable, __file__, "--one", mode, "--model", args.model,
                               "--batch", str(args.batch), "--seq", str(args.seq),
                               "--steps", str(args.steps), "--warmup", str(args.warmup)],
                              capture_output=True, text=True)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
        if not lines:
            print("%s failed: %s" % (mode, (proc.stderr.strip().splitlines() or ["?"])[-1]))
            continue
        r = results[mode] = json.loads(lines[-1])
        print("%-8s %-4s %8.0f tokens/s  %6.1f TFLOPS (6PT/t)  step %.3f s  losses %s  (%s)"
              % (mode, r["model"], r["tokens_per_second"], r["tflops_6pt"], r["step_seconds"],
                 " ".join("%.3f" % x for x in r["losses"]), r["device"]))
    if len(results) == 2:
        print("strata / resident = %.3f (tokens/s)"
              % (results["strata"]["tokens_per_second"] / results["resident"]["tokens_per_second"]))


if __name__ == "__main__":
    main()
