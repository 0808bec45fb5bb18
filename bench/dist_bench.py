#!/usr/bin/env python3
"""Data-parallel training throughput of Hugging Face Llama models streamed through Strata on
1 and N GPUs (issue 16), next to PyTorch FSDP2 with CPUOffloadPolicy and DeepSpeed ZeRO-3 with
CPU offload on N GPUs, in the same run. Each configuration runs in its own torchrun job (so its
peak memory is its own); NCCL_NVLS_ENABLE=0 is set for every job.

    python bench/dist_bench.py --models 3.6b,8b --gpus 2 --batch 16 --seq 1024 --steps 3

Runs (--runs, comma-separated MODE:GPUS[:ROWS], ROWS in units of --batch per GPU, default 1):
    strata:1      one GPU, --batch rows per step       (the throughput baseline)
    strata:2      two GPUs, --batch rows each          (tokens/s >= 1.9x strata:1 is the goal)
    strata:1:2    one GPU, twice the rows              (the losses strata:2 must equal)
    fsdp2:2       FSDP2 + CPUOffloadPolicy, two GPUs
    deepspeed:2   DeepSpeed ZeRO-3, params and optimizer offloaded to the CPU, two GPUs
Every run trains on the same two batches in turn (random tokens, seeded), each rank on its
slice of the step's rows, from the same weights (a seeded init that every rank computes alike,
much faster than Hugging Face's for 8B), with AdamW (lr 1e-4, weight decay 0.1), bf16, and
clip_grad_norm_(model.parameters(), --clip) before every step. Reported per run: tokens/s over
all GPUs, TFLOPS (6 P T / t) per GPU, median step time after warm-up, each step's loss (the mean
over all ranks' rows), peak host memory (VmHWM summed over ranks) and device memory (per GPU,
torch's peak plus Strata's HBM arena), setup time. Then per model: the scaling of strata over
GPUs, the largest relative loss difference between strata:N and strata:1:N, and strata:N
against each peer.

Staged builds: set STRATA_LIBRARY to the libstrata.so to use (e.g. .gpubuild/new/libstrata.so.1);
bindings/python of this tree is put on the path. On a machine without GPUs, --device cpu runs
the same code on Strata's host backend under gloo, for checking the script (--models tiny).
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

from host_memory import mem_available, peak_host_bytes  # noqa: E402

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

# Hugging Face Llama shapes (vocab 128256): "8b" is Llama 3.1 8B; "3.6b" is Llama 3.2 3B with an
# untied head (3.21 B + 0.39 B); "1b" Llama 3.2 1B's (untied: 1.5 B), for a quick check on GPUs;
# "tiny" checks the script on a CPU.
CONFIGS = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
    "3.6b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                 num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                 rope_theta=500000.0),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               rope_theta=500000.0),
}


def hf_config(name):
    from transformers import LlamaConfig
    return LlamaConfig(**CONFIGS[name], max_position_embeddings=8192, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, use_cache=False)


def parameters(config):
    h, i, v, n = (config.hidden_size, config.intermediate_size, config.vocab_size,
                  config.num_hidden_layers)
    kv = h // config.num_attention_heads * config.num_key_value_heads
    return n * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + 2 * v * h + h


_TILE = {}


def fast_init(module):
    """A seeded init every rank and every run computes alike, at memory speed: element k of a
    weight is element k mod 1,000,003 of one tile of normal values (std 0.02), norms are ones.
    Stands in for Hugging Face's _init_weights, which takes minutes for 8B parameters on the
    CPU. An FSDP2 parameter (a DTensor sharded on dim 0) gets its shard of the same values."""
    import torch
    from torch import nn
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.is_meta:
        return
    with torch.no_grad():
        local, start = weight, 0
        if hasattr(weight, "to_local"):  # FSDP2: rows [rank * ceil(R / W), ...) of the whole
            import torch.distributed as dist
            local = weight.to_local()
            rows = weight.shape[0]
            per = -(-rows // dist.get_world_size())
            start = min(dist.get_rank() * per, rows) * (weight.numel() // max(rows, 1))
        if "norm" in type(module).__name__.lower():
            local.fill_(1.0)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            key = (local.device, local.dtype)
            if key not in _TILE:
                g = torch.Generator().manual_seed(0)
                _TILE[key] = (torch.randn(1_000_003, generator=g) * 0.02).to(*key)
            tile, flat, pos = _TILE[key], local.view(-1), 0
            while pos < flat.numel():
                k = (start + pos) % tile.numel()
                n = min(tile.numel() - k, flat.numel() - pos)
                flat[pos:pos + n].copy_(tile[k:k + n])
                pos += n



def grow_host_memory(target):
    """Some VMs (the device machines here) give a guest its RAM as it is first touched: their
    MemAvailable starts far below the machine's memory, and Strata refuses a DRAM budget above
    MemAvailable. Touch what is missing in a child process (which then frees it), stopping
    early where memory does not grow (2 GiB left): never an OOM kill."""
    need = target - mem_available()
    if need <= 0:
        return 0.0
    t0 = time.perf_counter()
    code = ("import torch, sys\n"
            "sys.path.insert(0, %r)\n"
            "from host_memory import mem_available\n"
            "held, need = [], %d\n"
            "while sum(t.numel() for t in held) < need and mem_available() > (2 << 30):\n"
            "    held.append(torch.empty(min(1 << 30, need), dtype=torch.uint8).fill_(1))\n"
            % (str(pathlib.Path(__file__).parent), need))
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - t0



def data(config, rows, seq):
    import torch
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, config.vocab_size, (rows, seq), generator=g) for _ in range(2)]


# --- one run: a torchrun job, every rank in this function ------------------------------------

def run_job(mode, model_name, rows_per_gpu, seq, steps, warmup, clip, device_kind,
            resident_blocks=None):
    import torch
    import torch.distributed as dist
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if device_kind == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo")
    config = hf_config(model_name)
    batches = data(config, rows_per_gpu * world, seq)
    mine = [b[rank * rows_per_gpu:(rank + 1) * rows_per_gpu] for b in batches]
    out = {"mode": mode, "model": model_name, "params": parameters(config), "gpus": world,
           "rows_per_gpu": rows_per_gpu, "seq": seq, "clip": clip}
    t_setup = time.perf_counter()
    step, extra = SETUPS[mode](config, device, clip, rows_per_gpu, world, resident_blocks)
    out["setup_seconds"] = time.perf_counter() - t_setup
    times, losses = [], []
    for i in range(warmup + steps):
        ids = mine[i % 2].to(device, non_blocking=True)
        sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        loss = step(ids).detach().float().reshape(())
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    tokens = rows_per_gpu * world * seq
    device_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    out.update(step_seconds=t, tokens_per_second=tokens / t,
               tflops_6pt_per_gpu=6 * out["params"] * tokens / t / 1e12 / world,
               losses=losses, peak_device_gb=(device_peak + extra.get("arena", 0)) / 1e9)
    out.update({k: v for k, v in extra.items() if k not in ("arena", "close")})
    host = [None] * world
    dist.all_gather_object(host, peak_host_bytes())
    out["peak_host_gb"] = sum(host) / 1e9
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.barrier()
    if "close" in extra:
        extra["close"]()
    dist.destroy_process_group()


def sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_step(model, opt, clip):
    """The ordinary PyTorch step both strata.torch and FSDP2 run: forward, backward, optional
    clip_grad_norm_, opt.step(), opt.zero_grad() (set_to_none, torch's default)."""
    import torch

    def step(ids):
        loss = model(ids, labels=ids).loss
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        return loss
    return step


def meta_model(config):
    import torch
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    model._init_weights = fast_init
    return model


def setup_strata(config, device, clip, rows, world, resident_blocks=None):
    import torch
    import strata.torch as st
    model = st.offload(meta_model(config), device=device, dtype=torch.bfloat16,
                       resident_blocks=resident_blocks,
                       data_parallel=st.DataParallel(broadcast=False) if world > 1 else None)
    opt = st.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    info = model.strata.executor.plan_info()
    extra = {"resident_blocks": len(model.strata.resident_blocks),
             "plan": "%d slots of %.0f MB" % (info.slots, info.slot_bytes / 1e6),
             "optimizer_threads": model.strata.optimizer.stats()["threads"],
             "arena": model.strata.runtime.capabilities().tier_budget_bytes[0]
             if device.type == "cuda" else 0}
    if world > 1:
        extra["layout"] = model.strata.mesh.describe()
    extra["close"] = model.strata.close

    return plain_step(model, opt, clip), extra


def setup_fsdp2(config, device, clip, rows, world, resident_blocks=None):
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    model = meta_model(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32))
    if device.type == "cuda":
        policy["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    for block in model.model.layers:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    model.to_empty(device="cpu" if device.type == "cuda" else device)
    model.apply(fast_init)
    # to_empty leaves non-persistent buffers (rotary inv_freq) uninitialized: computed again.
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    return plain_step(model, opt, clip), {}


def setup_deepspeed(config, device, clip, rows, world, resident_blocks=None):
    import deepspeed
    import torch
    from transformers import LlamaForCausalLM
    ds_config = {
        "train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": 1,
        "gradient_clipping": clip, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 3,
                              "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    }
    # Built partitioned on the GPUs, with Hugging Face's own init (there it is quick): its
    # losses start from other weights than the other runs'.
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa",
                                              dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config)

    def step(ids):
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss
    return step, {}


SETUPS = {"strata": setup_strata, "fsdp2": setup_fsdp2, "deepspeed": setup_deepspeed}


# --- the driver ------------------------------------------------------------------------------

def parse_run(spec):
    parts = spec.split(":")
    if parts[0] not in SETUPS or not 2 <= len(parts) <= 3:
        raise ValueError("run %r: MODE:GPUS[:ROWS] with MODE in %s" % (spec, sorted(SETUPS)))
    return parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else 1


def launch(args, mode, gpus, mult, model_name):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(gpus), __file__, "--one", mode, model_name,
           "--batch", str(args.batch * mult), "--seq", str(args.seq), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--clip", str(args.clip), "--device", args.device]
    if args.resident_blocks is not None and mode == "strata":
        cmd += ["--resident-blocks", str(args.resident_blocks)]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "bindings" / "python"),
                                                      env.get("PYTHONPATH")]))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                              timeout=args.run_timeout)
    except subprocess.TimeoutExpired as e:
        return {"error": "timed out after %d s: %s" % (
            args.run_timeout, ((e.stderr or b"")[-300:] if isinstance(e.stderr, bytes)
                               else (e.stderr or "")[-300:]))}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if lines and proc.returncode != 0:  # measured, then failed on the way out: say so
        result = json.loads(lines[-1])
        result["exit"] = "exit code %d after the results" % proc.returncode
        return result
    if proc.returncode != 0 or not lines:
        # The first exception a rank raised, rather than torchrun's summary of it.
        err = proc.stderr.strip().splitlines()
        raised = [line for line in err if ("Error:" in line or "Exception:" in line)
                  and "elastic" not in line and "ChildFailedError" not in line]
        return {"error": (raised or err or ["exit %d" % proc.returncode])[0][:400]}
    return json.loads(lines[-1])


def summarize(results, models, gpus):
    lines = []
    for m in models:
        by = {(r["mode"], r["gpus"], r.get("mult", 1)): r for r in results
              if r["model"] == m and "error" not in r}
        one, many, double = by.get(("strata", 1, 1)), by.get(("strata", gpus, 1)), \
            by.get(("strata", 1, gpus))
        if one and many:
            lines.append("%-5s strata %d GPUs / 1 GPU = %.3f (tokens/s, same rows per GPU; "
                         "goal >= %.1f)" % (m, gpus, many["tokens_per_second"] /
                                            one["tokens_per_second"], 0.95 * gpus))
        if many and double:
            worst = max(abs(a - b) / abs(b) for a, b in zip(many["losses"], double["losses"]))
            lines.append("%-5s strata losses, %d GPUs vs 1 GPU with %dx the rows: largest "
                         "relative difference %.2e" % (m, gpus, gpus, worst))
        for peer in ("fsdp2", "deepspeed"):
            p = by.get((peer, gpus, 1))
            if many and p:
                lines.append("%-5s strata / %-9s on %d GPUs = %.3f (tokens/s)" % (
                    m, peer, gpus, many["tokens_per_second"] / p["tokens_per_second"]))
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="3.6b,8b")
    p.add_argument("--gpus", type=int, default=2, help="N in the default runs")
    p.add_argument("--runs", default=None,
                   help="MODE:GPUS[:ROWS] list (default strata:1,strata:N,strata:1:N,fsdp2:N,"
                        "deepspeed:N)")
    p.add_argument("--batch", type=int, default=16, help="rows per GPU per step")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--resident-blocks", type=int, default=None,
                   help="strata: blocks kept in HBM (default: strata.torch.offload's choice)")
    p.add_argument("--run-timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--host-memory", type=float, default=0,
                   help="GB of MemAvailable to make sure of first, touching memory where the "
                        "VM grows its RAM on demand (nvidia-h200-x2 starts at ~31 GiB)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--one", nargs=2, metavar=("MODE", "MODEL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        run_job(args.one[0], args.one[1], args.batch, args.seq, args.steps, args.warmup,
                args.clip, args.device, args.resident_blocks)
        return
    n = args.gpus
    runs = [parse_run(s) for s in (args.runs or "strata:1,strata:%d,strata:1:%d,fsdp2:%d,"
                                   "deepspeed:%d" % (n, n, n, n)).split(",")]
    models = args.models.split(",")
    if args.host_memory:
        seconds = grow_host_memory(int(args.host_memory * 1e9))
        print("host memory: %.0f GB available (%.0f s to grow it; %.0f GB asked for)"
              % (mem_available() / 1e9, seconds, args.host_memory), flush=True)
    results = []
    for model_name in models:
        for mode, gpus, mult in runs:
            r = launch(args, mode, gpus, mult, model_name)
            r.update(mode=mode, model=model_name, gpus=gpus, mult=mult)
            results.append(r)
            name = "%s:%d%s" % (mode, gpus, ":%d" % mult if mult != 1 else "")
            if "error" in r:
                print("%-5s %-13s failed: %s" % (model_name, name, r["error"]), flush=True)
            else:
                print("%-5s %-13s %8.0f tokens/s  %6.1f TFLOPS/GPU (6PT/t)  step %.2f s  host "
                      "%.1f GB  device %.1f GB/GPU  setup %.0f s  losses %s %s"
                      % (model_name, name, r["tokens_per_second"], r["tflops_6pt_per_gpu"],
                         r["step_seconds"], r["peak_host_gb"], r["peak_device_gb"],
                         r["setup_seconds"], " ".join("%.4f" % x for x in r["losses"]),
                         r.get("layout", "")), flush=True)
    for line in summarize(results, models, n):
        print(line, flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
