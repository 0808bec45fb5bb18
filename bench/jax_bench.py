#!/usr/bin/env python3
"""JAX training through Strata next to the same model fully resident in JAX, same run (each
mode in its own process): tokens/s with bf16 compute and fp32 masters, per-block recomputation
in every mode.

    python bench/jax_bench.py --model 1b --batch 8 --seq 2048 --steps 5
    python bench/jax_bench.py --model 1b,8b --modes ffi,ffi-unrolled,hostloop,resident \\
        --json results.json

Modes: ffi (strata.jax.Trainer, each step one XLA program with the FFI acquire/release ops,
the blocks in a jax.lax.scan), ffi-unrolled (the same, the blocks unrolled), hostloop (the
host-synchronised loop of per-layer programs), resident (every parameter in HBM, one jitted
step with jax.checkpoint per block and AdamW in JAX). Both sides start from the same weights:
with --init device (the default) drawn on the device by jax.random one block at a time
(DeviceBlocks: LazyBlocks' distribution), which strata.jax converts there and copies straight
into Strata's pinned memory; with --init host, llama_zoo.jax_llama.LazyBlocks (numpy, one block
at a time, so the 8B model's init does not need its fp32 copy in host memory). --setup prints
where each streamed mode's setup went, per phase (Trainer.setup_seconds; "init": building the
weights before the Trainer). A mode that fails (the resident 8B model does not fit in
HBM) is reported with its error; --json writes the results in the strata-bench format
(docs/benchmarks.md: ratio = tokens/s over resident JAX's in the same run) plus every run's details.
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
sys.path.insert(0, str(ROOT / "bench"))
# XLA would take 75% of the GPU's memory up front; Strata's arena needs its share.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

MODES = ("ffi", "ffi-unrolled", "hostloop", "resident")


class DeviceBlocks:
    """The blocks as a sequence that draws block i on JAX's default device when indexed, from
    jax.random.fold_in(key(seed), i): llama_zoo.jax_llama.LazyBlocks' distribution (uniform with
    standard deviation 0.02, unit norms), not its values. Nothing passes through host memory."""

    def __init__(self, config, seed=0):
        import jax
        import jax.numpy as jnp
        self.config, self.key = config, jax.random.key(seed)
        h, inter = config.hidden_size, config.intermediate_size
        kv = h // config.num_attention_heads * config.num_key_value_heads
        a = 0.02 * 3 ** 0.5

        def draw(key, shapes):
            keys = jax.random.split(key, len(shapes))
            return {name: jax.random.uniform(k, shape, jnp.float32, -a, a)
                    for k, (name, shape) in zip(keys, shapes.items())}

        def block(key):
            out = draw(key, {"wq": (h, h), "wk": (h, kv), "wv": (h, kv), "wo": (h, h),
                             "w_gate": (h, inter), "w_up": (h, inter), "w_down": (inter, h)})
            out.update(attn_norm=jnp.ones(h, jnp.float32), mlp_norm=jnp.ones(h, jnp.float32))
            return {k: out[k] for k in ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm",
                                        "w_gate", "w_up", "w_down")}

        def residents(key):
            out = draw(key, {"embed": (config.vocab_size, h), "head": (h, config.vocab_size)})
            return {"embed": out["embed"], "norm": jnp.ones(h, jnp.float32), "head": out["head"]}

        self._block, self._residents = jax.jit(block), jax.jit(residents)

    def __len__(self):
        return self.config.num_hidden_layers

    def __getitem__(self, i):
        import jax
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._block(jax.random.fold_in(self.key, i))

    def residents(self):
        import jax
        return self._residents(jax.random.fold_in(self.key, len(self)))


def run_one(mode, preset, batch, seq, steps, warmup, init="device"):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from llama_zoo import jax_llama as models

    t_setup = time.perf_counter()
    config = models.PRESETS[preset]
    lazy = DeviceBlocks(config, seed=0) if init == "device" else models.LazyBlocks(config, seed=0)
    residents = lazy.residents()
    jax.block_until_ready(residents)
    t_init = time.perf_counter() - t_setup
    rng = np.random.default_rng(0)
    data = [rng.integers(0, config.vocab_size, (batch, seq), dtype=np.int32) for _ in range(2)]
    extra = {}
    if mode != "resident":
        from llama_zoo.jax_trainer import StreamedTrainer
        trainer = StreamedTrainer(config, lazy, residents, lr=1e-4, weight_decay=0.1,
                                  dtype=jnp.bfloat16, ffi=mode != "hostloop",
                                  scan=mode == "ffi")
        if trainer.uses_ffi != (mode != "hostloop"):
            raise RuntimeError("mode %s: uses_ffi is %s" % (mode, trainer.uses_ffi))
        info = trainer.executor.plan_info()
        extra = {"slots": info.slots, "slot_bytes": info.slot_bytes,
                 "prefetch": [info.forward_prefetch_depth, info.backward_prefetch_depth],
                 "plan_bottleneck": info.bottleneck.decode(),
                 "backend": trainer.runtime.backend,
                 "setup_phases": dict(init=t_init, **trainer.setup_seconds)}
        step = trainer.step
    else:
        blocks = [lazy[i] for i in range(len(lazy))]
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
    setup = time.perf_counter() - t_setup
    times, losses = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        losses.append(step(data[i % 2]))
        times.append(time.perf_counter() - t0)
    t = statistics.median(times[warmup:])
    if mode != "resident":
        extra["step_plan"] = trainer.plan.text  # what the library chose for this batch, why
    six_p, _ = models.flops_per_token(config, seq)
    device = jax.devices()[0]
    try:
        peak = device.memory_stats().get("peak_bytes_in_use")
    except Exception:  # noqa: BLE001: the CPU has no memory stats
        peak = None
    return dict({"mode": mode, "model": preset, "batch": batch, "seq": seq,
                 "tokens_per_second": batch * seq / t, "tflops_6pt": six_p * batch * seq / t / 1e12,
                 "step_seconds": t, "step_times": times, "first_step_seconds": times[0],
                 "setup_seconds": setup, "losses": losses, "device": str(device),
                 "device_kind": getattr(device, "device_kind", device.platform),
                 "peak_device_bytes": peak, "jax": jax.__version__}, **extra)


def _phases(r):
    phases = r.get("setup_phases")
    if not phases:
        return ""
    return "  setup phases: " + ", ".join("%s %.2f s" % kv for kv in phases.items()
                                          if kv[1] >= 0.005)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="1b", help="preset(s), comma-separated: 1b,8b")
    p.add_argument("--modes", default="ffi,resident",
                   help="comma-separated, of %s" % ",".join(MODES))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900, help="seconds per mode")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--init", choices=("device", "host"), default="device",
                   help="where the weights are drawn (default: device)")
    p.add_argument("--setup", action="store_true",
                   help="print each streamed mode's setup seconds per phase")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.model, args.batch, args.seq, args.steps,
                                 args.warmup, args.init)), flush=True)
        return
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            p.error("unknown mode %r (modes: %s)" % (m, ", ".join(MODES)))
    runs, results = [], []
    for model in [m for m in args.model.split(",") if m]:
        by_mode = {}
        for mode in modes:
            cmd = [sys.executable, __file__, "--one", mode, "--model", model,
                   "--batch", str(args.batch), "--seq", str(args.seq),
                   "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--init", args.init]
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                out, err, rc = proc.stdout, proc.stderr, proc.returncode
            except subprocess.TimeoutExpired as e:
                out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                err, rc = "timed out after %.0f s" % args.timeout, None
            lines = [l for l in out.splitlines() if l.startswith("{")]
            if not lines:
                tail = [l for l in err.strip().splitlines() if l.strip()] or ["?"]
                # The line naming the error (XLA's RESOURCE_EXHAUSTED, a Strata status, ...).
                named = [l for l in tail if "Error" in l or "RESOURCE_EXHAUSTED" in l
                         or "timed out" in l] or tail
                r = {"mode": mode, "model": model, "error": named[-1][-400:], "rc": rc,
                     "wall_seconds": time.perf_counter() - t0}
                print("%-12s %-4s failed: %s" % (mode, model, r["error"]), flush=True)
            else:
                r = json.loads(lines[-1])
                r["wall_seconds"] = time.perf_counter() - t0
                print("%-12s %-4s %8.0f tokens/s  %6.1f TFLOPS (6PT/t)  step %.3f s  first %.1f s"
                      "  setup %.0f s  losses %s  (%s)"
                      % (mode, model, r["tokens_per_second"], r["tflops_6pt"],
                         r["step_seconds"], r["first_step_seconds"], r["setup_seconds"],
                         " ".join("%.3f" % x for x in r["losses"]), r["device"]), flush=True)
                if args.setup and _phases(r):
                    print(_phases(r), flush=True)
            runs.append(r)
            by_mode[mode] = r
        base = by_mode.get("resident")
        for mode in modes:
            r = by_mode[mode]
            if mode == "resident" or "error" in r:
                continue
            res = {"metric": "tokens_per_second_%s_%s" % (model, mode),
                   "value": r["tokens_per_second"], "unit": "tokens/s"}
            if base is not None and "error" not in base:
                res.update(baseline="resident JAX", baseline_value=base["tokens_per_second"],
                           ratio=r["tokens_per_second"] / base["tokens_per_second"])
                print("%s %s / resident = %.3f (tokens/s)" % (model, mode, res["ratio"]))
            elif base is not None:
                res["note"] = "resident JAX failed: %s" % base["error"]
            results.append(res)
    if args.json:
        device = next((r["device_kind"] for r in runs if "device_kind" in r), "?")
        doc = {"bench": "jax", "device": device, "batch": args.batch, "seq": args.seq,
               "results": results, "runs": runs}
        pathlib.Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print("wrote", args.json)


if __name__ == "__main__":
    main()
